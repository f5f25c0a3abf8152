"""A node's telemetry on the wire: one rose.telemetry.v1 record per GPU per window, encoded on
the hot path, and the same window's p99 handed to the executor's local guard."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import orjson

from rose.contract.events import TELEMETRY_SCHEMA, Latency


def telemetry_records(
    *,
    ts: float,
    node: str,
    gpus: list[str],
    pool: str,
    slo: tuple[float, float],
    run_id: str,
    seq: int,
    util,
    mem_total,
    mem_used,
    rollout_mem,
    ttft_ms,
    tpot_ms,
    rps,
    queue,
    kv_cache_usage=None,
    replica: Mapping[str, str] | None = None,
    serving_state: Sequence[str] | None = None,
) -> list[tuple[bytes, bytes]]:
    """(value, key) of one telemetry event per GPU; array-likes hold one entry per GPU
    (`mem_total` may also be one int for all). `kv_cache_usage` (optional) holds each GPU's
    engine KV-cache usage 0..1, None for a GPU whose engine does not report it: the field is
    then left off that event. `replica` (optional, CONTRACT §7) maps a GPU to the serving replica
    it belongs to, and `serving_state` holds each GPU's replica's state; a GPU that is its own
    replica, or whose replica is serving, leaves the field off (the contract's defaults).

    Built as plain dicts and encoded with orjson (not through the dataclass) because this
    runs for every GPU every period; tests check the output with Telemetry.from_dict and the
    JSON Schema."""
    dumps = orjson.dumps
    slo_d = {"ttft_p99": slo[0], "tpot_p99": slo[1]}
    out = []
    totals = [mem_total] * len(gpus) if isinstance(mem_total, int) else mem_total
    for i, g in enumerate(gpus):
        used = int(mem_used[i])
        d = {
            "schema": TELEMETRY_SCHEMA,
            "event_id": f"{run_id}:{g}:{seq}",
            "ts": ts,
            "node": node,
            "gpu": g,
            "pool": pool,
            "gpu_util": min(1.0, max(0.0, float(util[i]))),
            "mem_total_bytes": int(totals[i]),
            "mem_used_bytes": used,
            "rollout_mem_bytes": min(int(rollout_mem[i]), used),
            "latency_ms": {"ttft_p99": float(ttft_ms[i]), "tpot_p99": float(tpot_ms[i])},
            "slo_ms": slo_d,
            "rps": float(rps[i]),
            "queue_depth": int(queue[i]),
        }
        if kv_cache_usage is not None and (kv := kv_cache_usage[i]) is not None:
            d["kv_cache_usage"] = min(1.0, max(0.0, float(kv)))
        if replica is not None and replica.get(g, g) != g:
            d["replica"] = replica[g]
        if serving_state is not None and serving_state[i] != "serving":
            d["serving_state"] = serving_state[i]
        out.append((dumps(d), g.encode()))
    return out


def window_span(name: str, **attrs):
    """The span of one published window; the publisher's `send` span is its child."""
    from rose.obs.tracing import tracer

    return tracer("rose.agent").start_as_current_span(name, attributes=attrs)


def feed_guard(directory: str, gpus: list[str], ts: float, ttft_ms, tpot_ms, slo: tuple[float, float]) -> None:
    """Hand each GPU's newest p99 to the executor's local guard (a file in shared memory per
    GPU, no broker on the path), so a latency collapse pauses rollout before Kafka carries
    the revoke."""
    from rose.executor.guard import LatencySample, write_latency

    slo_l = Latency(*slo)
    for g, a, b in zip(gpus, ttft_ms, tpot_ms):
        write_latency(directory, g, LatencySample(ts, Latency(float(a), float(b)), slo_l))
