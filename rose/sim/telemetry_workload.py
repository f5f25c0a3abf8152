"""Synthetic telemetry workloads for scheduler tests, benchmarks and soak runs: per-GPU sequences that cross
the grant and revoke thresholds, so the policy grants, renews and revokes repeatedly."""

from __future__ import annotations

import random
import time

from rose.config import GiB
from rose.contract.events import Latency, Telemetry
from rose.policy.core import Batch, SchedulingCore

MEM_LOW, MEM_HIGH = 0.35, 0.55  # serving memory stays in this fraction of total
MEM_STEP = 0.005  # ... moving at most this fraction of total per event (a KV cache filling and draining)


def workload(
    n_gpus: int, n_events: int, seed: int = 7, t0: float | None = None, period_s: float = 0.5, prefix: str = "load"
) -> list[Telemetry]:
    """Events interleaved across GPUs in time order; each GPU alternates calm phases
    (p99 at 20–50% of SLO) and spikes (p99 at 92–130% of SLO). Serving memory is a bounded
    random walk (reflected at MEM_LOW/MEM_HIGH, steps of at most MEM_STEP of total): a
    redraw each event would look like KV growth of up to 20 % of total in 0.5 s, which the
    policy rightly revokes, so no lease would live long enough to be renewed."""
    rng = random.Random(seed)
    t0 = float(int(time.time())) if t0 is None else t0  # near the record time: the skew check passes
    out = []
    phase = {g: rng.randrange(40) for g in range(n_gpus)}
    mem = {g: rng.uniform(MEM_LOW, MEM_HIGH) for g in range(n_gpus)}
    for i in range(n_events):
        for g in range(n_gpus):
            k = (i + phase[g]) % 60
            frac = rng.uniform(0.2, 0.5) if k < 45 else rng.uniform(0.92, 1.3)
            total = (80 if g % 2 else 141) * GiB  # heterogeneous fleet
            m = mem[g] + rng.uniform(-MEM_STEP, MEM_STEP)
            m = 2 * MEM_LOW - m if m < MEM_LOW else 2 * MEM_HIGH - m if m > MEM_HIGH else m
            mem[g] = m
            used = int(total * m)
            out.append(
                Telemetry(
                    event_id=f"{prefix}-{g}-{i}",
                    ts=t0 + i * period_s,
                    node=f"{prefix}-node-{g // 8}",
                    gpu=f"{prefix}/{g}",
                    pool="serving",
                    gpu_util=rng.uniform(0.2, 0.9),
                    mem_total_bytes=total,
                    mem_used_bytes=used,
                    rollout_mem_bytes=0,
                    latency_ms=Latency(ttft_p99=400.0 * frac, tpot_p99=50.0 * frac * rng.uniform(0.9, 1.0)),
                    slo_ms=Latency(ttft_p99=400.0, tpot_p99=50.0),
                    rps=rng.uniform(1, 20),
                    queue_depth=rng.randrange(5),
                )
            )
    return out


def expected_commands(events: list[Telemetry], policy) -> dict[str, list[dict]]:
    """What the pure scheduling core decides, per GPU, in order: the reference for exactly-once."""
    out: dict[str, list[dict]] = {}
    for c in SchedulingCore(policy).apply(Batch(telemetry=events)).commands:
        out.setdefault(c.gpu, []).append(c.to_dict())
    return out
