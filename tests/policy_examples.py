"""The lease policy's test vocabulary: one GPU's telemetry as fractions of its SLO (`tel`),
calm sequences that earn a lease (`steady`), and `run`, which folds `decide` over a sequence.
Used by tests/test_lease_policy.py (properties) and tests/test_lease_policy_examples.py."""

from __future__ import annotations

import orjson

from rose.config import GiB, PolicyConfig
from rose.contract.events import Latency, Telemetry
from rose.policy.core import Batch, SchedulingCore
from rose.policy.lease_policy import Decision, GpuView, decide

CFG = PolicyConfig()
SLO = Latency(ttft_p99=1000.0, tpot_p99=100.0)


def tel(
    i: int,
    ts: float,
    ttft_frac: float = 0.2,
    tpot_frac: float = 0.2,
    total_gib: float = 80,
    serving_gib: float = 30,
    rollout_gib: float = 0,
    util: float = 0.4,
    gpu: str = "n/0",
    event_id: str | None = None,
) -> Telemetry:
    total = int(total_gib * GiB)
    rollout = int(rollout_gib * GiB)
    return Telemetry(
        event_id=event_id or f"{gpu}-e{i}",
        ts=ts,
        node=gpu.split("/")[0],
        gpu=gpu,
        pool="serving",
        gpu_util=util,
        mem_total_bytes=total,
        mem_used_bytes=int(serving_gib * GiB) + rollout,
        rollout_mem_bytes=rollout,
        latency_ms=Latency(SLO.ttft_p99 * ttft_frac, SLO.tpot_p99 * tpot_frac),
        slo_ms=SLO,
        rps=2.0,
        queue_depth=0,
    )


def run(events, cfg=CFG, view=None, roundtrip=False) -> list[Decision]:
    out = []
    for e in events:
        d = decide(view, e, cfg)
        out.append(d)
        view = GpuView.from_dict(orjson.loads(orjson.dumps(d.view.to_dict()))) if roundtrip else d.view
    return out


def command_bytes(decisions) -> bytes:
    return b"\n".join(orjson.dumps(c.to_dict()) for d in decisions for c in d.commands)


def steady(n, start=0, t0=100.0, **kw):
    return [tel(start + i, t0 + 0.5 * (start + i), **kw) for i in range(n)]


def lease_state_record(gpu: str, epoch: int, state: str, ts: float, command_id: str) -> dict:
    """An executor's rose.lease_state.v1 record for lease `{gpu}#{epoch}`."""
    return {
        "schema": "rose.lease_state.v1",
        "gpu": gpu,
        "lease_id": f"{gpu}#{epoch}",
        "epoch": epoch,
        "state": state,
        "ts": ts,
        "rollout_mem_bytes": 0,
        "command_id": command_id,
    }


def core_decide(core: SchedulingCore, event: Telemetry) -> Decision:
    """One telemetry event through the core's one entry (`SchedulingCore.apply`)."""
    return core.apply(Batch(telemetry=(event,))).decisions[0]
