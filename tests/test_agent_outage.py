"""Broker outage: the real Kafka stops mid-run and comes back; the agent neither crashes
nor blocks, buffers, and delivers. Kafka is always restarted (other tests share it)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.test_agent import agent_env, telemetry_by_gpu


@pytest.mark.stack
def test_agent_survives_broker_outage(cfg, stack, traces_dir):
    duration = 14
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rose",
            "agent",
            "--simulate",
            str(traces_dir / "azure_llm2023_conv.csv"),
            "--gpus",
            "8",
            "--duration",
            str(duration),
        ],
        env=agent_env(cfg),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(3.0)
        try:
            stack.kafka_down()
            time.sleep(5.0)
            assert proc.poll() is None, "the agent died while Kafka was down"
        finally:
            stack.kafka_up()
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    # it kept its pace: done about when the duration ends, plus the flush
    assert time.monotonic() - t0 < duration + 25
    summary = json.loads(err.strip().splitlines()[-1])["agent"]
    by_gpu = telemetry_by_gpu(cfg)
    per_gpu = duration / cfg.telemetry.period_s
    assert len(by_gpu) == 8
    for gpu, evs in by_gpu.items():
        ts = [e.ts for e in evs]
        assert ts == sorted(ts)
        # buffered during the outage and delivered after it (nothing dropped: the buffer is large)
        assert len(evs) >= per_gpu - 1 - summary["dropped"] / 8, (gpu, len(evs), summary)
        assert ts[-1] - ts[0] >= duration - 1.5  # resumed: events from after the outage arrived
