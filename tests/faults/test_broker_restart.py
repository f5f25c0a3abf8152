"""Fault: the Kafka broker stops and restarts while telemetry flows and the scheduler runs.
Expectation: neither the producer nor the scheduler crashes; open transactions abort and are
retried; after the restart every command is there exactly once and equal to the pure
policy's. Counted: outage seconds, scheduler restarts (none allowed), commands, duplicates."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from rose.contract.wire import encode
from rose.kafka.producer import make_producer, produce
from rose.sim.telemetry_workload import expected_commands, workload
from tests.faults.system import wait_for
from tests.kafka_checks import by_gpu, commands, duplicate_ids, wait_for_commands
from tests.processes import SHUTDOWN_BOUND_S, terminate_all

pytestmark = pytest.mark.stack


def test_broker_restart_under_load(cfg, stack, tmp_path):
    events = workload(16, 200, prefix="br", seed=9)
    env = {
        **os.environ,
        "ROSE_KAFKA_BOOTSTRAP": cfg.kafka.bootstrap,
        "ROSE_KAFKA__TOPIC_PREFIX": cfg.kafka.topic_prefix,
    }
    sched = subprocess.Popen(
        [sys.executable, "-m", "rose", "scheduler", "--instance", "br"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "scheduler.log", "wb"),
    )

    def feed():
        p = make_producer(cfg.kafka)  # librdkafka buffers and retries through the outage
        for i in range(0, len(events), 160):
            for ev in events[i : i + 160]:
                produce(p, cfg.kafka.telemetry_topic, encode(ev), ev.gpu)
            p.poll(0)
            time.sleep(0.3)
        assert p.flush(120) == 0, "telemetry lost by the producer"

    feeder = threading.Thread(target=feed)
    feeder.start()
    outage = 0.0
    try:
        wait_for(lambda: commands(cfg), 60, "the scheduler committed no command")  # it works when the broker goes
        t0 = time.monotonic()
        try:
            stack.kafka_down()
            time.sleep(3)
        finally:
            stack.kafka_up()
            outage = time.monotonic() - t0
        feeder.join()
        want = expected_commands(events, cfg.policy)
        n_want = sum(map(len, want.values()))
        got = wait_for_commands(cfg, n_want)
        alive = sched.poll() is None
    finally:
        exit_s = terminate_all({"scheduler": sched})
    dups = duplicate_ids(got)
    log = (tmp_path / "scheduler.log").read_text(errors="replace")
    print(
        f"\n[broker-restart] outage={outage:.1f}s scheduler alive={alive} aborted transactions="
        f"{log.count('transaction.abort')} commands expected={n_want} got={len(got)} "
        f"duplicates={len(dups)}"
    )
    assert alive, "scheduler died during the broker outage"
    assert exit_s["scheduler"] <= SHUTDOWN_BOUND_S, f"not gone within {SHUTDOWN_BOUND_S}s of SIGTERM: {exit_s}"
    assert not dups
    assert by_gpu(got) == want
