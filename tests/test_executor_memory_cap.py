"""Enforced memory caps and worker niceness on the real local stack: `rose executor` in a
subprocess, real Kafka topics, a real Redis task queue and real rollout worker processes. A
worker made to exceed its lease (the `ROSE_TEST_ALLOCATE_BYTES` fault-injection hook of
rose.rollout.worker_process) is stopped and its lease revoked by the executor; workers run at
the configured niceness. The pure parts: tests/test_memory_cap.py."""

from __future__ import annotations

import itertools
import os
import time

import psutil
import pytest

from rose.config import GiB
from rose.kafka.producer import make_producer
from rose.rollout.worker_process import FAULT_ALLOCATE_BYTES_ENV
from tests.test_executor import ExecutorProc, LeaseStates, env_for, send, submit, wait_until

pytestmark = pytest.mark.stack

NICE = 5  # env_for's ROSE_EXECUTOR__WORKER_NICE


def expected_nice() -> int:
    """Workers are niced to the configured value, never to less than the executor's own."""
    return max(NICE, os.getpriority(os.PRIO_PROCESS, 0))


def fenced_renewal(cfg, producer, states: LeaseStates, after: float, timeout: float = 30):
    """Renew the ended lease at epoch 1 until the executor rejects one at or after `after`
    (its clock): the state of that rejection."""
    deadline = time.monotonic() + timeout
    for n in itertools.count(1):
        send(cfg, producer, "renew", 1, f"n{n}", ttl=60.0, mem=GiB)
        while time.monotonic() < deadline:
            got = [s for s, _ in states.seen if s.state == "rejected" and s.command_id == f"n{n}"]
            if got and got[0].ts >= after:
                return got[0]
            if got:
                break
            states.states()
        assert time.monotonic() < deadline, f"no renewal rejected after {after} within {timeout}s"
    raise AssertionError("unreachable")


def test_a_worker_over_its_lease_is_stopped_and_the_lease_revoked(cfg, tmp_path, redis_client):
    submit(cfg, 10)
    states = LeaseStates(cfg)
    # the watchdog's path on any host: without cgroup's memory.max, which would OOM-kill it first
    hook = {FAULT_ALLOCATE_BYTES_ENV: str(GiB), "ROSE_EXECUTOR__MEM_CAP_CGROUP": "off"}
    env = env_for(cfg, tmp_path, ROSE_EXECUTOR__WARM_WORKERS="0", **hook)
    ex = ExecutorProc(env)
    p = make_producer(cfg.kafka)
    try:
        cap = ex.wait_log("executor.memory_cap")
        assert cap["watchdog"] is True and cap["poll_s"] == 0.25 and cap["cgroup"] is False
        send(cfg, p, "grant", 1, "g1", ttl=60.0, mem=GiB)
        states.wait("active", 1)
        pid = ex.wait_log("worker.started", 30, epoch=1)["pid"]
        assert psutil.Process(pid).nice() == expected_nice()
        # the worker's model, then its injected GiB: over the GiB lease, seen within two polls
        over = ex.wait_log("worker.over_memory_cap", 45, gpu="sim/0")
        t_over = time.monotonic()
        assert over["pid"] == pid and over["by"] == "watchdog"
        assert over["cap_bytes"] == GiB and over["rss_bytes"] > GiB
        assert len(over["samples"]) == 2 and min(over["samples"]) > GiB
        revoking, _ = states.wait("revoking", 1, timeout=10)
        assert revoking.rollout_mem_bytes > GiB  # the lease state shows why: more than its grant
        revoked, _ = states.wait("revoked", 1, timeout=10)
        assert time.monotonic() - t_over < 1.0 + 3.0  # within the grace (SIGKILL), with slack
        assert revoked.command_id == "g1"  # no revoke command: the executor ended the lease itself
        logged = ex.wait_log("lease.state", 10, state="revoked", epoch=1, measured_pid=pid)  # re-read once reaped
        assert revoked.rollout_mem_bytes == logged["rollout_mem_bytes"] == 0 and not psutil.pid_exists(pid)
        exited = ex.wait_log("worker.exited", 5, pid=pid)
        assert exited["gpu"] == "sim/0"
        # the lease is gone for good: its renewals are fenced; one handled past the restart
        # backoff after the exit shows that nothing restarted inside the ended lease
        past = time.time() + cfg.executor.restart_backoff_s + 0.5
        fenced = fenced_renewal(cfg, p, states, after=past)
        assert sum(1 for ln in ex.lines if ln.get("event") == "worker.started") == 1
        seen = states.states()
        assert ("active", 1) not in seen[seen.index(("revoked", 1)) :]
        assert fenced.ts >= past
    finally:
        ex.stop()
        states.close()
    assert ex.proc.returncode == 0


def test_workers_run_at_the_configured_nice_value_and_within_their_lease(cfg, tmp_path, redis_client):
    q = submit(cfg, 10)
    states = LeaseStates(cfg)
    ex = ExecutorProc(env_for(cfg, tmp_path))  # with the warm pool (one worker)
    p = make_producer(cfg.kafka)
    try:
        warm_pid = ex.wait_log("worker.warming", 30)["pid"]
        assert psutil.Process(warm_pid).nice() == expected_nice()  # from its first instruction
        ex.wait_log("worker.warm_ready", 60)
        send(cfg, p, "grant", 1, "g1", ttl=60.0, mem=GiB)
        states.wait("active", 1)
        pid = ex.wait_log("worker.started", 30, epoch=1)["pid"]
        assert psutil.Process(pid).nice() == expected_nice()
        wait_until(lambda: len(q.all_results()) >= 2, 60, "the worker completed no episodes")
        assert psutil.Process(pid).nice() == expected_nice()  # still, while it runs the lease
        assert not [ln for ln in ex.lines if ln.get("event") == "worker.over_memory_cap"]  # within its GiB
        send(cfg, p, "revoke", 1, "r1")
        states.wait("revoked", 1, timeout=10)
    finally:
        ex.stop()
        states.close()
    assert ex.proc.returncode == 0
