"""Every ROSE process is gone within 10 s of SIGTERM, in any state: its broker or Redis down,
its producer fenced by a newer instance, or its graceful exit wedged (the hard deadline)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rose.shutdown import EXIT_FORCED
from rose.stack import free_port
from tests.conftest import TRACES
from tests.faults.system import log_records, wait_for
from tests.processes import SHUTDOWN_BOUND_S, terminate_all


def spawn(args: list[str], env: dict, log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rose", *args], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log
    )


def test_every_process_stops_within_the_bound_while_kafka_and_redis_are_down(tmp_path):
    env = {
        **os.environ,
        "ROSE_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}",
        "ROSE_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
    }
    procs = {
        "scheduler": ["scheduler", "--instance", "down"],
        "executor": ["executor", "--simulate", "2"],
        "agent": ["agent", "--simulate", str(TRACES / "azure_llm2023_code.csv"), "--gpus", "2"],
        "weights-follow": ["weights", "follow", "--model", "m", "--out", str(tmp_path / "w")],
    }
    logs = {n: open(tmp_path / f"{n}.log", "wb") for n in procs}
    running = {n: spawn(a, env, logs[n]) for n, a in procs.items()}
    # each says it is retrying its connection: it is now deep in a client call
    says = {"scheduler": "kafka.unreachable", "executor": "kafka.unreachable", "agent": "kafka.unreachable"}
    says["weights-follow"] = "redis.unreachable"
    wait_for(
        lambda: all(logged(tmp_path / f"{n}.log", e) for n, e in says.items()),
        90,
        f"not every process said it was retrying ({says})",
    )
    alive = {n: p.poll() is None for n, p in running.items()}
    exit_s = terminate_all(running)
    tails = {n: (tmp_path / f"{n}.log").read_text(errors="replace")[-600:] for n in procs}
    print(f"\n[shutdown/outage] alive before SIGTERM: {alive}; seconds to exit: {exit_s}")
    slow = {n: s for n, s in exit_s.items() if s > SHUTDOWN_BOUND_S}
    assert not slow, f"not gone within {SHUTDOWN_BOUND_S}s of SIGTERM: {slow}; logs: {tails}"
    assert alive["scheduler"] and alive["weights-follow"], f"gave up instead of retrying: {tails}"


@pytest.mark.stack
def test_a_fenced_scheduler_stops_within_the_bound(cfg, tmp_path):
    """A second instance with the same id fences the first (init_transactions bumps the epoch):
    the first replaces its client in a loop; SIGTERM still ends it in time."""
    env = {
        **os.environ,
        "ROSE_KAFKA_BOOTSTRAP": cfg.kafka.bootstrap,
        "ROSE_KAFKA__TOPIC_PREFIX": cfg.kafka.topic_prefix,
    }
    logs = {n: tmp_path / f"{n}.log" for n in ("first", "second")}
    first = spawn(["scheduler", "--instance", "same"], env, open(logs["first"], "wb"))
    wait_for(lambda: logged(logs["first"], "partitions.assigned"), 90, "the first instance never started")
    second = spawn(["scheduler", "--instance", "same"], env, open(logs["second"], "wb"))
    fenced = wait_for(lambda: logged(logs["first"], "scheduler.client_replaced"), 90, "the first was not fenced")
    exit_s = terminate_all({"first": first, "second": second})
    print(
        f"\n[shutdown/fenced] first fenced: {fenced['error']}; seconds to exit: {exit_s}; "
        f"codes {first.returncode} {second.returncode}"
    )
    assert max(exit_s.values()) <= SHUTDOWN_BOUND_S, exit_s


def test_a_wedged_graceful_exit_is_cut_at_the_deadline():
    """The hard deadline itself: a process whose stop hook never lets it return is ended with
    EXIT_FORCED after GRACE_S, and one log line says so."""
    code = (
        "import time\nfrom rose.shutdown import Shutdown\n"
        "s = Shutdown.install(grace_s=1.0, name='wedged')\n"
        "print('ready', flush=True)\n"
        "while True:\n    time.sleep(0.1)  # ignores s.stop: a wedged client call\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=10)
    took = time.monotonic() - t0
    assert p.returncode == EXIT_FORCED, err
    assert 0.9 <= took < 5, took
    assert '"shutdown.forced"' in err and "wedged" in err


def logged(log: Path, event: str) -> dict | None:
    """The first line of `log` that records `event`, if there is one yet."""
    return next((r for r in log_records(log) if r.get("event") == event), None)
