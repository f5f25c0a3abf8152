"""Gang leases on the real stack (docs/contract.md §2 `group_id`, `group_size`, §4.9): `rose
executor --simulate 2` starts one worker for the group only once every member's grant has
arrived, and when one member is revoked, every member's lease ends and the one worker goes;
through `rose scheduler`, a node's two GPUs are granted, paused and revoked together."""

from __future__ import annotations

import time

import psutil
import pytest

from rose.config import GiB
from rose.contract.wire import encode
from rose.kafka.producer import make_producer, produce
from rose.obs.tracing import inject_headers
from tests.examples import command_example
from tests.kafka_checks import commands
from tests.processes import start_scheduler, terminate_all
from tests.test_coelastic import Feeder
from tests.test_executor import ExecutorProc, LeaseStates, env_for, send, submit, wait_until

pytestmark = pytest.mark.stack

GROUP = "sim#sim/0#1"


def gang_command(cfg, producer, gpu: str, kind: str, cid: str) -> None:
    now = time.time()
    cmd = command_example(
        kind=kind,
        gpu=gpu,
        epoch=1,
        command_id=cid,
        lease_id=f"{gpu}#1",
        mem_bytes=GiB,
        compute_share=0.5,
        ts=now,
        expires_at=now + 30.0,
        group_id=GROUP,
        group_size=2,
    )
    produce(producer, cfg.kafka.commands_topic, encode(cmd), gpu, inject_headers())
    producer.flush(10)


def seen(states: LeaseStates) -> set[tuple[str, str]]:
    states.states()
    return {(s.gpu, s.state) for s, _ in states.seen if s.epoch == 1}


def test_one_worker_per_gang_and_a_members_revoke_ends_the_gang(cfg, tmp_path, redis_client):
    submit(cfg, 20)
    states = LeaseStates(cfg)
    ex = ExecutorProc(env_for(cfg, tmp_path), gpus=2)
    p = make_producer(cfg.kafka)
    try:
        gang_command(cfg, p, "sim/0", "grant", "g0")
        ex.wait_log("gang.waiting", 30, gpu="sim/0")
        send(cfg, p, "renew", 0, "stale0")  # rejected once handled: the executor went on past the grant
        states.wait("rejected", 0, gpu="sim/0")
        assert not any(ln.get("event") == "gang.started" for ln in ex.lines), "a gang worker before every member"

        gang_command(cfg, p, "sim/1", "grant", "g1")
        started = ex.wait_log("gang.started", 60, group_id=GROUP)
        assert started["gpus"] == "sim/0,sim/1"
        pid = started["pid"]
        wait_until(lambda: seen(states) >= {("sim/0", "active"), ("sim/1", "active")}, 30, "both members active")
        assert sum(1 for ln in ex.lines if ln.get("event") == "gang.started") == 1

        gang_command(cfg, p, "sim/1", "revoke", "r1")
        wait_until(
            lambda: seen(states) >= {("sim/0", "revoked"), ("sim/1", "revoked")},
            30,
            "a member's revoke did not end the whole gang",
        )
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        ex.stop()
        states.close()


def test_scheduler_grants_pauses_and_revokes_a_gang_end_to_end(cfg, tmp_path, redis_client):
    """`policy.group_size` 2: live telemetry of sim/0 and sim/1 (node "sim") through `rose
    scheduler` gives two grants of one group in one transaction, one worker; a spike on one
    member pauses both; memory pressure on the other revokes both."""
    env = env_for(cfg, tmp_path, ROSE_POLICY__GROUP_SIZE="2")
    submit(cfg, 40, turns=4)
    states = LeaseStates(cfg)
    sched = start_scheduler(env, "gang", tmp_path / "scheduler.log")
    ex = ExecutorProc(env, gpus=2)
    feed = Feeder(cfg, gpus=("sim/0", "sim/1"))
    try:
        started = ex.wait_log("gang.started", 90)
        assert started["gpus"] == "sim/0,sim/1"
        wait_until(lambda: seen(states) >= {("sim/0", "active"), ("sim/1", "active")}, 30, "both members active")
        grants = [c for c in commands(cfg) if c["kind"] == "grant"]
        assert sorted(c["gpu"] for c in grants) == ["sim/0", "sim/1"]
        assert len({c["group_id"] for c in grants}) == 1 and {c["group_size"] for c in grants} == {2}
        assert len({c["cause_event_id"] for c in grants}) == 1, "the gang's grants came from different steps"

        feed.modes["sim/1"] = "spike"
        wait_until(
            lambda: seen(states) >= {("sim/0", "paused"), ("sim/1", "paused")}, 20, "a member's spike paused both"
        )
        pauses = [c for c in commands(cfg) if c["kind"] == "throttle" and c["compute_share"] == 0.0]
        assert {c["gpu"] for c in pauses} == {"sim/0", "sim/1"} and len({c["cause_event_id"] for c in pauses}) == 1

        feed.modes.pop("sim/1")
        feed.modes["sim/0"] = "memory"
        wait_until(lambda: seen(states) >= {("sim/0", "revoked"), ("sim/1", "revoked")}, 30, "memory revoked both")
        assert sum(1 for ln in ex.lines if ln.get("event") == "gang.started") == 1
    finally:
        feed.stop()
        ex.stop()
        terminate_all({"scheduler": sched})
        states.close()
