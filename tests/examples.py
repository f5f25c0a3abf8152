"""Valid example events for tests (one place, so every test agrees on what valid means)."""

from rose.config import GiB
from rose.contract.events import Command, Latency, LeaseState, Telemetry


def telemetry_example(**over) -> Telemetry:
    base = dict(
        event_id="ev-1",
        ts=1_700_000_000.0,
        node="node-1",
        gpu="node-1/0",
        pool="serving",
        gpu_util=0.4,
        mem_total_bytes=80 * GiB,
        mem_used_bytes=40 * GiB,
        rollout_mem_bytes=0,
        latency_ms=Latency(ttft_p99=200.0, tpot_p99=20.0),
        slo_ms=Latency(ttft_p99=1000.0, tpot_p99=100.0),
        rps=3.5,
        queue_depth=1,
    )
    base.update(over)
    return Telemetry(**base)


def command_example(**over) -> Command:
    base = dict(
        command_id="c-1",
        ts=1_700_000_000.0,
        kind="grant",
        gpu="node-1/0",
        lease_id="node-1/0#1",
        epoch=1,
        mem_bytes=8 * GiB,
        compute_share=0.3,
        expires_at=1_700_000_005.0,
        reason="headroom 0.80 >= 0.30",
        cause_event_id="ev-1",
    )
    base.update(over)
    return Command(**base)


def lease_state_example(**over) -> LeaseState:
    base = dict(
        gpu="node-1/0",
        lease_id="node-1/0#1",
        epoch=1,
        state="active",
        ts=1_700_000_000.1,
        rollout_mem_bytes=4 * GiB,
        command_id="c-1",
    )
    base.update(over)
    return LeaseState(**base)
