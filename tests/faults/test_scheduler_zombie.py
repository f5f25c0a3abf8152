"""Fault: two schedulers race for the same partitions. Instance A is frozen (SIGSTOP) past its
group session while B takes its partitions over, then thawed: A is a zombie holding a stale
view and an open batch. Expectation: A's stale transaction cannot commit (the consumer group
generation fences it through send_offsets_to_transaction), so read_committed consumers see
every command exactly once and equal to the pure policy's. Counted: commands, duplicates,
aborted transactions reported by the instances."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime

import orjson
import pytest

from rose.contract.wire import encode
from rose.kafka.producer import make_producer, produce
from rose.sim.telemetry_workload import expected_commands, workload
from tests.kafka_checks import by_gpu, duplicate_ids, wait_for_commands
from tests.processes import SHUTDOWN_BOUND_S, terminate_all

pytestmark = pytest.mark.stack


def test_zombie_scheduler_is_fenced(cfg, tmp_path):
    events = workload(24, 240, prefix="z", seed=5)
    env = {
        **os.environ,
        "ROSE_KAFKA_BOOTSTRAP": cfg.kafka.bootstrap,
        "ROSE_KAFKA__TOPIC_PREFIX": cfg.kafka.topic_prefix,
    }

    def feed():
        p = make_producer(cfg.kafka)
        for i in range(0, len(events), 240):
            for ev in events[i : i + 240]:
                produce(p, cfg.kafka.telemetry_topic, encode(ev), ev.gpu)
            p.flush(10)
            time.sleep(0.4)

    def start(name):
        return subprocess.Popen(
            [sys.executable, "-m", "rose", "scheduler", "--instance", name],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / f"{name}.log", "wb"),
        )

    a, b = start("a"), start("b")
    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        time.sleep(6)
        a.send_signal(signal.SIGSTOP)  # A freezes mid-stream; B gets its partitions after the session timeout
        frozen_at = datetime.now(UTC)
        time.sleep(14)
        thawed_at = datetime.now(UTC)
        a.send_signal(signal.SIGCONT)  # A wakes up as a zombie
        feeder.join()
        want = expected_commands(events, cfg.policy)
        n_want = sum(map(len, want.values()))
        got = wait_for_commands(cfg, n_want, timeout_s=90, settle_s=3)
    finally:
        for p in (a, b):
            p.send_signal(signal.SIGCONT)
        exit_s = terminate_all({"a": a, "b": b})
    logs = {n: (tmp_path / f"{n}.log").read_text(errors="replace") for n in ("a", "b")}
    aborts = {n: log.count("transaction.abort") for n, log in logs.items()}
    dups = duplicate_ids(got)
    held_by_a = owned_partitions(logs["a"], until=frozen_at)
    held_by_b = owned_partitions(logs["b"], until=thawed_at)
    print(
        f"\n[zombie] commands expected={n_want} got={len(got)} duplicates={len(dups)} aborted transactions={aborts} "
        f"A held {sorted(held_by_a)} when frozen, B held {sorted(held_by_b)} when A thawed; exit after SIGTERM {exit_s}"
    )
    assert held_by_a, "A owned no partition when it was frozen: the test would not exercise a zombie"
    assert held_by_a <= held_by_b, "B did not take over the partitions of the frozen A"
    assert not dups
    assert by_gpu(got) == want
    assert all(t <= SHUTDOWN_BOUND_S for t in exit_s.values()), (
        f"not gone within {SHUTDOWN_BOUND_S}s of SIGTERM: {exit_s}"
    )


def owned_partitions(log: str, until: datetime) -> set[int]:
    """The partitions a scheduler owned at `until`, from its partitions.assigned/revoked log lines."""
    owned: set[int] = set()
    for line in log.splitlines():
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(rec, dict) or rec.get("event") not in ("partitions.assigned", "partitions.revoked"):
            continue
        if datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")) > until:
            break
        if rec["event"] == "partitions.assigned":
            owned |= set(rec["partitions"])
        else:
            owned -= set(rec["partitions"])
    return owned
