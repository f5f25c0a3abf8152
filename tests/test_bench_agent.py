"""`rose bench agent` counts as published only what the broker acknowledged: a buffer far
smaller than the run evicts events, and those are reported as dropped, never as published.
Planted bug it catches: counting every offered event (or evicted ones) in `events`."""

import dataclasses

import pytest

pytestmark = pytest.mark.stack


def test_agent_bench_counts_only_acknowledged_events(cfg):
    from rose.bench import agent

    small = dataclasses.replace(cfg, telemetry=dataclasses.replace(cfg.telemetry, buffer_max=2_000))
    out = agent.run(small, quick=True)
    assert out["kafka"] is True
    assert out["dropped"] > 0, out  # 5,000 GPUs a window against a 2,000-event buffer
    assert out["events"] + out["dropped"] + out["undelivered_after_flush"] == out["events_offered"], out
    assert out["events"] < out["events_offered"], out
