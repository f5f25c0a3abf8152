"""The whole system under load on the real local stack, with one fault injected per test.

Running: telemetry (a feeder of calm/spiky synthetic telemetry stamped with the current time,
or `rose agent --simulate` on the Azure code trace), `rose scheduler`, `rose executor
--simulate 4` starting rollout workers inside its leases, a dedicated rollout worker, a
trainer publishing weight versions (WeightPublisher) and a `rose weights follow` process;
tasks are submitted to the task queue while it runs. One fault per test, at seeded random
points (ROSE_FAULT_SEED to replay), then everything drains and tests/faults/audit.py checks
commands, transactions, leases, tasks and weights — the same audit for every fault. Each test
prints what it injected and what the audit counted. The processes and the load are
tests/faults/system.py; the records the audit read are left in the test's logs/records.ndjson
(`rose replay --diff` takes them).

Where a fault's effect is its point, the test checks that it landed: the scheduler is killed
inside an open transaction (whose records must then be aborted), and a killed executor's
workers must be gone within the revoke deadline of the kill, with no executor left to enforce
it.

Covered elsewhere, reused rather than repeated here: the scheduler partitioned past the
lease TTL (test_scheduler_partitioned.py), two schedulers racing (test_scheduler_zombie.py),
hostile telemetry (test_hostile_telemetry.py); the same kills in isolation, with more kills
of one component: scheduler (test_scheduler.py), executor (test_executor.py), worker
(test_rollout_tasks.py), follower (test_weights_stream.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import psutil
import pytest

from tests.faults.system import REVOKE_DEADLINE_S, System, fault_rng, wait_for
from tests.processes import SHUTDOWN_BOUND_S

pytestmark = pytest.mark.stack


def report(tag: str, fault: dict, counts: dict, codes: dict, stop_s: dict) -> None:
    print(f"\n[full-system/{tag}] fault: {orjson.dumps(fault).decode()}")
    for k, v in counts.items():
        print(f"[full-system/{tag}] {k}: {orjson.dumps(v).decode()}")
    print(f"[full-system/{tag}] exit codes after SIGTERM: {codes}; seconds to exit: {stop_s}")
    slow = {n: s for n, s in stop_s.items() if s is not None and s > SHUTDOWN_BOUND_S}
    assert not slow, f"not gone within {SHUTDOWN_BOUND_S}s of SIGTERM: {slow}"


def exit_times(pids: list[int], since: float, timeout: float) -> dict[int, float]:
    """Seconds from `since` (wall clock) until each of `pids` is gone (exited, or a zombie
    nobody reaped yet), polled every 10 ms; those still running at `timeout` are left out."""
    left, out = set(pids), {}
    deadline = time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        for pid in list(left):
            try:
                gone = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                gone = True
            if gone:
                out[pid] = round(time.time() - since, 3)
                left.discard(pid)
        time.sleep(0.01)
    return out


def run_with_kills(target: str, cfg, tmp_path: Path, traces_dir: Path, kills: int, duration_s: float) -> None:
    rng, seed = fault_rng(target)
    sysm = System(
        cfg,
        tmp_path,
        duration_s=duration_s,
        seed=7,
        agent_trace=traces_dir / "azure_llm2023_code.csv" if target == "agent" else None,
    )
    fault = {"kind": f"SIGKILL {target}", "seed": seed, "at_s": [], "restarted": 0}
    executor_kills: list[float] = []
    orphans_exit_s: list[float] = []
    open_at_kills: list[dict] = []
    if target == "follower":  # the follower exits at the last version: it comes after the kills
        sysm.last_version_gate.clear()
    sysm.faults_done_gate.clear()  # the load goes on until the last kill has landed
    try:
        sysm.start()
        sysm.wait_loaded()
        window_end = sysm.t0 + duration_s * 0.8
        for k in range(kills):
            # spread over what is left of the window: a kill's own waits (for episodes in flight,
            # for an open transaction) must not push the later ones past the load
            time.sleep(rng.uniform(1.0, max(1.5, (window_end - time.time()) / (kills - k))))
            sysm.ensure_in_flight()
            if target == "worker":  # a leased worker if one runs, and the dedicated one
                pids = sysm.leased_worker_pids()
                if pids:
                    os.kill(rng.choice(pids), signal.SIGKILL)  # the executor restarts it inside the lease
                    fault.setdefault("leased_workers_killed", 0)
                    fault["leased_workers_killed"] += 1
                p = sysm.procs["worker"]
            else:
                p = sysm.procs[target]
            if not p.alive():
                continue
            orphans = sysm.leased_worker_pids() if target == "executor" else []
            fault.setdefault("episodes_in_flight", []).append(sysm.in_flight())
            if target == "scheduler":
                t, open_tx = sysm.kill_scheduler_in_transaction()
                open_at_kills.append(open_tx)
            else:
                t = p.kill()
            fault["at_s"].append(round(t - sysm.t0, 1))
            if target == "executor":
                executor_kills.append(t)
                # its workers got SIGTERM (pdeathsig) and no executor is left to SIGKILL them at the
                # revoke deadline: they must drain and exit within it by themselves
                gone = exit_times(orphans, t, REVOKE_DEADLINE_S + 10)
                late = {pid: gone.get(pid) for pid in orphans if gone.get(pid, float("inf")) > REVOKE_DEADLINE_S}
                assert not late, (
                    f"orphaned workers alive past the revoke deadline ({REVOKE_DEADLINE_S}s) of their "
                    f"executor's kill: seconds to exit {late} (None: still running after {REVOKE_DEADLINE_S + 10}s)"
                )
                orphans_exit_s += gone.values()
            time.sleep(rng.uniform(0.0, 1.5))
            if target == "worker":
                sysm.start_worker()
            elif target == "agent":
                sysm.start_agent()
            else:
                p.start()
            fault["restarted"] += 1
        sysm.last_version_gate.set()
        sysm.faults_done_gate.set()
        if sysm.extra_waves:
            fault["extra_waves"] = sysm.extra_waves
        if target == "executor":
            fault["orphaned_workers_exit_s"] = sorted(orphans_exit_s)
        if target == "scheduler":
            fault["open_transaction_at_kill"] = [  # records in it, per topic[partition]
                {f"{topic}[{part}]": hwm - lso for (topic, part), (lso, hwm) in sorted(o.items())}
                for o in open_at_kills
            ]
        codes = sysm.finish()
        # a killed scheduler's successor rebuilds its views once it is assigned its partitions
        rebuilds = [(k, k + 60) for k in sysm.procs["scheduler"].kills]
        counts = sysm.audit(executor_kills, open_at_kills=open_at_kills, rebuilds=rebuilds)
    except BaseException:
        sysm.print_log_tails()
        raise
    finally:
        sysm.last_version_gate.set()
        sysm.faults_done_gate.set()
        sysm.stop_all()
    counts["trainer"] = {"versions": sysm.published, "redis_retries": sysm.trainer_retries}
    report(f"sigkill-{target}", fault, counts, codes, sysm.stop_s)
    assert fault["restarted"] >= 1, "no kill landed while the process ran"
    assert all(open_at_kills), "a scheduler kill did not land inside an open transaction"
    assert codes["scheduler"] == 0 and codes["executor"] == 0, codes


KILL_TARGETS = ["scheduler", "executor", "worker", "follower", "agent"]


@pytest.mark.parametrize("target", KILL_TARGETS)
def test_sigkill_under_load(target, cfg, tmp_path, traces_dir):
    """Fault: SIGKILL of one process (scheduler, executor, rollout worker — a leased one and
    the dedicated one —, weight follower, or agent) at two random points while telemetry
    flows, leases are held, episodes run and weights are published; each time it is
    restarted. Expectation: the common audit holds (no command lost or duplicated, no lease
    held past its expiry, no task or trajectory lost or duplicated, the follower
    bit-identical with every version applied once); a killed executor's workers exit by
    themselves within the revoke deadline. Counted: kills, restarts, and the audit's counts."""
    run_with_kills(target, cfg, tmp_path, traces_dir, kills=2, duration_s=30)


@pytest.mark.slow
@pytest.mark.parametrize("target", KILL_TARGETS)
def test_sigkill_under_load_long(target, cfg, tmp_path, traces_dir):
    """As test_sigkill_under_load, with five kills over a longer run."""
    run_with_kills(target, cfg, tmp_path, traces_dir, kills=5, duration_s=75)


def run_with_outage(which: str, cfg, stack, tmp_path: Path, outages: int, duration_s: float) -> None:
    rng, seed = fault_rng(which)
    sysm = System(cfg, tmp_path, duration_s=duration_s, seed=7)
    fault = {"kind": f"{which} stop/start", "seed": seed, "at_s": [], "down_s": []}
    try:
        sysm.start()
        sysm.supervise_worker()
        sysm.wait_loaded()
        for _ in range(outages):
            time.sleep(rng.uniform(1.0, 4.0))
            sysm.ensure_in_flight()
            fault.setdefault("episodes_in_flight", []).append(sysm.in_flight())
            t0 = time.time()
            fault["at_s"].append(round(t0 - sysm.t0, 1))
            try:
                stopped = (stack.kafka_down if which == "kafka" else stack.redis_down)()
                assert stopped, f"no {which} process of the local stack to stop"
                assert not (stack.kafka_alive if which == "kafka" else stack.redis_alive)(), f"{which} still answers"
                time.sleep(rng.uniform(2.0, 4.0))
            finally:  # other tests share the stack: it always comes back
                (stack.kafka_up if which == "kafka" else stack.redis_up)()
            fault["down_s"].append(round(time.time() - t0, 1))
        codes = sysm.finish(drain_s=150)
        # a Redis outage may stall live workers past min_idle_ms: another may take over an episode
        # its holder then finishes too (completed twice, appended once); a broker outage does not
        counts = sysm.audit(
            max_duplicates=sum(fault["episodes_in_flight"]) if which == "redis" else 0,
            # the scheduler loses its group session, or replaces its clients, and rebuilds its views
            rebuilds=[(sysm.t0 + fault["at_s"][0], float("inf"))] if which == "kafka" else [],
        )
    except BaseException:
        sysm.print_log_tails()
        raise
    finally:
        sysm.stop_all()
    counts["trainer"] = {"versions": sysm.published, "redis_retries": sysm.trainer_retries}
    fault["dedicated_worker_restarts"] = sysm.worker_restarts
    fault["starts"] = {n: p.starts for n, p in sysm.procs.items()}
    fault["leased_worker_starts"] = sum(ln.get("event") == "worker.started" for ln in sysm.procs["executor"].lines())
    report(f"{which}-restart", fault, counts, codes, sysm.stop_s)
    assert codes["scheduler"] == 0 and codes["executor"] == 0, codes


def test_kafka_broker_restart_under_load(cfg, stack, tmp_path):
    """Fault: the Kafka broker is stopped and restarted while the whole system runs.
    Expectation: no process dies (clients buffer, retry, or are replaced in-process), open
    transactions abort, and the common audit holds. Counted: outage seconds, and the audit's
    counts. The broker comes back in any case (try/finally): other tests share it."""
    run_with_outage("kafka", cfg, stack, tmp_path, outages=1, duration_s=30)


def test_redis_restart_under_load(cfg, stack, tmp_path):
    """Fault: Redis is stopped and restarted (append-only file: streams survive) while the
    whole system runs. Expectation: the common audit holds — the task queue, results and
    weight stream come back intact, the follower and trainer retry, and no task or
    trajectory is lost or duplicated. Counted: outage seconds, process (re)starts and the
    audit's counts."""
    run_with_outage("redis", cfg, stack, tmp_path, outages=1, duration_s=30)


def test_stack_stops_its_process_without_a_pid_file(tmp_path):
    """The outage tests need `kafka_down`/`redis_down` to stop the running service even when
    its pid file is gone or names a dead process (two `up`s raced): the stack adopts the
    process listening on its port if it runs from the stack's directory, and only that one."""
    import dataclasses

    from rose.config import StackConfig
    from rose.stack import LocalStack, free_port

    port = free_port()
    (tmp_path / "redis").mkdir()
    listen = [
        sys.executable,
        "-c",
        f"import socket,time\ns=socket.socket();s.bind(('127.0.0.1',{port}));s.listen();time.sleep(60)",
    ]
    st = LocalStack(dataclasses.replace(StackConfig(), data_dir=str(tmp_path), redis_port=port), "", "")
    other = subprocess.Popen(listen, cwd=tmp_path)  # on the port, but not from the stack's redis dir
    try:
        wait_for(lambda: st._adopt("redis") is None and psutil.Process(other.pid).connections(), 10, "listening")
        assert st.redis_down() is False and other.poll() is None
    finally:
        other.kill()
        other.wait()
    ours = subprocess.Popen(listen, cwd=tmp_path / "redis")
    try:
        wait_for(lambda: st._adopt("redis") == ours.pid, 10, "adopted")
        (tmp_path / "redis.pid").write_text("999999999")  # stale
        assert st.redis_down() is True
        ours.wait(5)  # (the stack reaped it: its exit status is gone)
        assert not psutil.pid_exists(ours.pid) and not (tmp_path / "redis.pid").exists()
    finally:
        if ours.poll() is None:
            ours.kill()
            ours.wait()
