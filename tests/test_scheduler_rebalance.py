"""Scale-out: scheduler instances in one consumer group split the telemetry partitions, and
a rebalance in the middle of a load (an instance joins, then the first one leaves) loses and
duplicates no command. The audit: commands read with read_committed equal the pure policy's,
per GPU and in order, each command id exactly once."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import orjson
import pytest

from rose.sim.telemetry_workload import expected_commands, workload
from tests.kafka_checks import by_gpu, commands, duplicate_ids, wait_for_commands
from tests.processes import SHUTDOWN_BOUND_S, terminate_all
from tests.test_rollout_tasks import wait_for
from tests.test_scheduler import _produce

pytestmark = pytest.mark.stack


def _assignments(log: str) -> list[tuple[str, list[int]]]:
    """(event, partitions) of each partitions.assigned / partitions.revoked line of a JSON log."""
    out = []
    for line in log.splitlines():
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("event") in ("partitions.assigned", "partitions.revoked"):
            out.append((rec["event"], rec["partitions"]))
    return out


def _owned(log: str) -> set[int]:
    """The partitions an instance held at the end of its log."""
    held: set[int] = set()
    for event, parts in _assignments(log):
        held = held | set(parts) if event == "partitions.assigned" else held - set(parts)
    return held


def test_an_instance_joins_and_one_leaves_under_load_nothing_lost_or_duplicated(cfg, tmp_path):
    events = workload(32, 160, prefix="rb", seed=5)
    step = 160
    feeder = threading.Thread(
        target=lambda: [_produce(cfg, events[i : i + step]) or time.sleep(0.5) for i in range(0, len(events), step)]
    )
    env = {
        **os.environ,
        "ROSE_KAFKA_BOOTSTRAP": cfg.kafka.bootstrap,
        "ROSE_KAFKA__TOPIC_PREFIX": cfg.kafka.topic_prefix,
        "ROSE_KAFKA__PARTITIONS": str(cfg.kafka.partitions),
    }
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b")}

    def start(name: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "rose", "scheduler", "--instance", f"rb-{name}", "--log-level", "INFO"]
        return subprocess.Popen(cmd, env=env, stdout=open(logs[name], "wb"), stderr=subprocess.STDOUT)

    a = start("a")
    feeder.start()  # 32 batches over ~16 s
    wait_for(lambda: commands(cfg), 60, "a committed no command")  # a owns every partition and works
    b = start("b")  # joins: the group splits the partitions between a and b
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (_owned(logs["a"].read_text()) and _owned(logs["b"].read_text())):
        time.sleep(0.5)
    split = (_owned(logs["a"].read_text()), _owned(logs["b"].read_text()))
    time.sleep(2.0)  # both work a while (the scenario's pace: nothing is asserted on it)
    exit_a = terminate_all({"a": a})  # leaves: b takes a's partitions over
    feeder.join()
    want = expected_commands(events, cfg.policy)
    n_want = sum(map(len, want.values()))
    got = wait_for_commands(cfg, n_want)
    b_at_end = _owned(logs["b"].read_text())
    exit_b = terminate_all({"b": b})
    dups = duplicate_ids(got)
    print(
        f"\n[rebalance] split a={sorted(split[0])} b={sorted(split[1])} events={len(events)} "
        f"commands expected={n_want} got={len(got)} duplicates={len(dups)}"
    )
    assert split[0] and split[1], f"both instances must hold partitions at once: {split}"
    assert not split[0] & split[1], f"a partition owned twice: {split}"
    assert b_at_end == set(range(cfg.kafka.partitions)), f"b took every partition over: {b_at_end}"
    assert n_want > 50, "the workload must make the policy act"
    assert not dups
    assert by_gpu(got) == want
    assert exit_a["a"] <= SHUTDOWN_BOUND_S and exit_b["b"] <= SHUTDOWN_BOUND_S, (exit_a, exit_b)
