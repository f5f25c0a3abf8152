"""Fault: the scheduler is cut off (SIGSTOP) past the lease TTL while the executor holds a
lease, then resumes (SIGCONT). Expectation: the executor revokes by expiry on its own
(serving gets the GPU back) and never re-activates that lease; renews the resumed scheduler
computes from its telemetry backlog before it reads the executor's `expired` are rejected by
epoch fencing; once it reads it, the scheduler drops the lease and grants at a new epoch.
Counted: seconds from SIGSTOP to `expired`, rejected backlog renews, duplicates."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import orjson
import pytest

from rose.config import GiB
from rose.contract.events import Latency, Telemetry
from rose.contract.wire import encode
from rose.kafka.consumer import read_all
from rose.kafka.producer import make_producer, produce
from tests.faults.system import wait_for
from tests.kafka_checks import commands, duplicate_ids
from tests.processes import SHUTDOWN_BOUND_S, terminate_all

pytestmark = pytest.mark.stack
GPU = "part/0"


def calm(i: int) -> Telemetry:
    return Telemetry(
        event_id=f"p-{i}",
        ts=time.time(),
        node="part",
        gpu=GPU,
        pool="serving",
        gpu_util=0.3,
        mem_total_bytes=80 * GiB,
        mem_used_bytes=30 * GiB,
        rollout_mem_bytes=0,
        latency_ms=Latency(100.0, 10.0),
        slo_ms=Latency(1000.0, 100.0),
        rps=2.0,
        queue_depth=0,
    )


def lease_states(cfg) -> list[dict]:
    return [
        {**orjson.loads(m.value()), "_ts": m.timestamp()[1] / 1000}
        for m in read_all(cfg.kafka, [cfg.kafka.lease_state_topic])
        if m.value()
    ]


def first_state(cfg, state: str, lease_id: str | None = None, since: float = 0.0) -> dict | None:
    """The first published lease state `state` (of `lease_id` if given) stamped at or after `since`."""
    return next(
        (
            s
            for s in lease_states(cfg)
            if s["state"] == state and s["_ts"] >= since and lease_id in (None, s["lease_id"])
        ),
        None,
    )


def test_partitioned_scheduler_does_not_resurrect_leases(cfg, tmp_path):
    env = {
        **os.environ,
        "ROSE_KAFKA_BOOTSTRAP": cfg.kafka.bootstrap,
        "ROSE_REDIS_URL": cfg.redis.url,
        "ROSE_KAFKA__TOPIC_PREFIX": cfg.kafka.topic_prefix,
        "ROSE_REDIS__KEY_PREFIX": cfg.redis.key_prefix,
        "ROSE_EXECUTOR__LATENCY_DIR": str(tmp_path / "lat"),
        "ROSE_EXECUTOR__REVOKE_DEADLINE_S": "2",
    }
    stop_feed = threading.Event()

    def feed():
        p = make_producer(cfg.kafka)
        i = 0
        while not stop_feed.is_set():
            ev = calm(i)
            produce(p, cfg.kafka.telemetry_topic, encode(ev), GPU)
            p.poll(0)
            i += 1
            time.sleep(0.25)
        p.flush(10)

    ex = subprocess.Popen(
        [sys.executable, "-m", "rose", "executor", "--gpus", GPU],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "executor.log", "wb"),
    )
    sch = subprocess.Popen(
        [sys.executable, "-m", "rose", "scheduler", "--instance", "part"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "scheduler.log", "wb"),
    )
    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        active = wait_for(lambda: first_state(cfg, "active"), 60, "no lease granted while calm")
        lease = active["lease_id"]
        epoch = int(lease.rsplit("#", 1)[1])
        # a renew goes through: the scheduler is renewing the lease when it is cut off
        wait_for(lambda: any(c["kind"] == "renew" and c["lease_id"] == lease for c in commands(cfg)), 30, "no renew")
        sch.send_signal(signal.SIGSTOP)
        t_stop = time.time()
        expired = wait_for(
            lambda: first_state(cfg, "expired", lease, since=t_stop), cfg.policy.ttl_s + 30, "no revoke by expiry"
        )
        took = expired["_ts"] - t_stop
        sch.send_signal(signal.SIGCONT)
        # the resumed scheduler reads the expiry and grants at a new epoch; the executor takes
        # that grant up, and so has handled every command the scheduler sent before it
        regrant = wait_for(
            lambda: next((s for s in lease_states(cfg) if s["state"] == "active" and s["epoch"] > epoch), None),
            60,
            "the resumed scheduler never granted again",
        )
    finally:
        stop_feed.set()
        feeder.join()
        for proc in (sch, ex):
            proc.send_signal(signal.SIGCONT)
        exit_s = terminate_all({"scheduler": sch, "executor": ex})
    cmds = [orjson.loads(m.value()) for m in read_all(cfg.kafka, [cfg.kafka.commands_topic])]  # offset order
    dups = duplicate_ids(cmds)
    new_grant = next((i for i, c in enumerate(cmds) if c["kind"] == "grant" and c["epoch"] > epoch), None)
    final_states = lease_states(cfg)
    after = [s for s in final_states if s["lease_id"] == lease and s["_ts"] > expired["_ts"]]
    rejected = [s for s in after if s["state"] == "rejected"]
    print(
        f"\n[partition] SIGSTOP->expired {took:.2f}s; backlog renews of the expired lease rejected by the "
        f"executor: {len(rejected)}; new grant: {regrant['lease_id']}; "
        f"duplicates: {len(dups)}"
    )
    assert took <= cfg.policy.ttl_s + 3, "lease held well past its expiry"
    assert regrant["lease_id"] != lease
    assert not any(s["state"] == "active" for s in after), "expired lease came back to life"
    assert new_grant is not None, "the resumed scheduler never learned that the lease expired"
    assert not any(c["lease_id"] == lease for c in cmds[new_grant:]), "expired lease renewed after the new grant"
    assert not dups
    assert max(exit_s.values()) <= SHUTDOWN_BOUND_S, f"not gone within {SHUTDOWN_BOUND_S}s of SIGTERM: {exit_s}"
