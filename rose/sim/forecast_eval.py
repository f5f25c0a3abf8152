"""Which forecast the pool decision should use: each candidate of `rose.policy.pool.FORECASTS`,
at several look-back windows and two reclaim horizons, replayed over the public traces' aggregate
load, scored by how often it would have under-provisioned the pool against how much capacity it
frees. The choice and its reasons: docs/policy.md "Pool decisions".

    python -m rose.sim.forecast_eval --traces ../shared/traces --out docs/paper-check/pool-forecast

The pool: `POOL_REPLICAS` replicas, each of the capacity at which that many replicas carry the
trace's peak bin with the headroom (a pool provisioned for its peak, as a static fleet is). At
each bin a decision keeps `replicas_needed(forecast)` replicas; it under-provisions when the load
of any bin within the following horizon exceeds the kept replicas' capacity. The same functions
as the product compute the forecast and the replicas kept (`rose.policy.pool`).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from rose.policy.pool import PoolConfig, forecast_rps, replicas_needed
from rose.sim.traces import load_trace

POOL_REPLICAS = 8  # a pool of eight replicas (the simulator's 64 serving GPUs at tp 8, or 8 × tp 1)
HEADROOM = PoolConfig().headroom
HORIZONS_S = (PoolConfig().horizon_s, 60.0)  # the default reclaim horizon; a slow (cold, 70B) one
WINDOWS_S = (10.0, 60.0, 300.0, 900.0)
# the decision's headroom swept at the default horizon, over the product's window and the longest:
# does more headroom, or a longer look-back, stop the under-provisioning the default leaves?
HEADROOM_SWEEP = ((300.0, 900.0), (0.5, 1.0, 1.5))
KINDS = ("last", "peak", "peak_trend")
REQUEST_TRACES = (  # (file, bin s): request-level arrivals
    ("azure_llm2023_code.csv", 5.0),
    ("azure_llm2023_conv.csv", 5.0),
    ("mooncake_fast25_synthetic.jsonl", 5.0),
    ("burstgpt1_first400.csv", 60.0),
    ("burstgpt3_first400.csv", 60.0),
)
RATE_TRACES = (  # (file, bin s): rates per window; bins no finer than the data
    ("servegen_m-large_client_windows_day0.csv", 60.0),
    ("servegen_deepseek-r1_client_windows.csv", 60.0),
    ("servegen_mm-image_client_windows.csv", 60.0),
    ("alibaba_genai2026_qps.csv", 60.0),
)


def request_load(path: Path, bin_s: float) -> np.ndarray:
    """Requests/s per bin of a request-level trace."""
    t = load_trace(path).arrival_s
    counts = np.bincount((t // bin_s).astype(np.int64))
    return counts.astype(np.float64) / bin_s


def servegen_load(path: Path, bin_s: float) -> np.ndarray:
    """ServeGen: each client's rate per window, summed over clients, held over the window."""
    rate: dict[float, float] = defaultdict(float)
    with path.open() as f:
        for row in csv.DictReader(f):
            rate[float(row["window_start_s"])] += float(row["rate_rps"])
    starts = sorted(rate)
    width = starts[1] - starts[0] if len(starts) > 1 else bin_s
    end = starts[-1] + width
    times = np.arange(0.0, end, bin_s)
    idx = np.searchsorted(np.array(starts), times, side="right") - 1
    return np.array([rate[starts[i]] for i in idx])


def alibaba_qps_load(path: Path, bin_s: float) -> np.ndarray:
    """Alibaba GenAI qps: per (container, request type) its newest sample, carried forward, summed
    over containers per bin (the trace's README: sum across containers per window)."""
    rows = []
    with path.open() as f:
        for row in csv.DictReader(f):
            rows.append(
                (float(row["timestamp_anon"]), row["container_ip"] + "|" + row["request_type"], float(row["value"]))
            )
    rows.sort()
    t0 = rows[0][0]
    nbins = int((rows[-1][0] - t0) // bin_s) + 1
    per: dict[str, np.ndarray] = {}
    for ts, key, v in rows:
        series = per.setdefault(key, np.full(nbins, np.nan))
        series[int((ts - t0) // bin_s)] = v
    load = np.zeros(nbins)
    for series in per.values():
        carried = 0.0
        for k in range(nbins):
            if not math.isnan(series[k]):
                carried = series[k]
            load[k] += carried
    return load


def evaluate(
    load: np.ndarray, bin_s: float, kind: str, window_s: float, horizon_s: float, headroom: float = HEADROOM
) -> dict:
    """Decisions at every bin once a window of history exists: under-provisioned share, capacity
    freed, and the largest rise (the horizon's peak over the forecast, where the forecast is not 0:
    a headroom below it cannot cover that rise). The pool is provisioned with `HEADROOM` whatever
    `headroom` the decision keeps."""
    cap = float(load.max()) * (1 + HEADROOM) / POOL_REPLICAS
    w = max(1, math.ceil(window_s / bin_s))
    h = max(1, math.ceil(horizon_s / bin_s))
    under = under_idle = freed = n = 0
    rise = 0.0
    lst = load.tolist()
    for k in range(w - 1, len(lst) - h):
        f = forecast_rps(kind, tuple(lst[k - w + 1 : k + 1]), bin_s, horizon_s)
        kept = min(POOL_REPLICAS, replicas_needed(f, cap, headroom))
        future = max(lst[k + 1 : k + 1 + h])
        short = future > kept * cap
        under += short
        under_idle += short and f <= 0
        rise = max(rise, future / f) if f > 0 else rise
        freed += POOL_REPLICAS - kept
        n += 1
    return {
        "decisions": n,
        "under_provisioned": under / n if n else None,
        "under_after_no_load": under_idle / n if n else None,
        "capacity_freed": freed / (n * POOL_REPLICAS) if n else None,
        "largest_rise": rise,
    }


def run(traces: Path) -> dict:
    loads = [(name, b, request_load(traces / name, b)) for name, b in REQUEST_TRACES]
    for name, b in RATE_TRACES:
        reader = alibaba_qps_load if name.startswith("alibaba") else servegen_load
        loads.append((name, b, reader(traces / name, b)))
    out: dict = {
        "pool_replicas": POOL_REPLICAS,
        "headroom": HEADROOM,
        "horizons_s": list(HORIZONS_S),
        "windows_s": list(WINDOWS_S),
        "traces": {},
    }
    for name, b, load in loads:
        cells = []
        for horizon in HORIZONS_S:
            for kind in KINDS:
                for window in WINDOWS_S if kind != "last" else (b,):
                    if window < horizon and kind != "last":
                        continue  # the window is never shorter than the horizon (PoolConfig)
                    r = evaluate(load, b, kind, max(window, b), horizon)
                    cells.append(
                        {"forecast": kind, "window_s": window, "horizon_s": horizon, "headroom": HEADROOM, **r}
                    )
        windows, headrooms = HEADROOM_SWEEP
        for window in windows:
            for headroom in headrooms:
                r = evaluate(load, b, "peak", max(window, b), HORIZONS_S[0], headroom)
                cells.append(
                    {"forecast": "peak", "window_s": window, "horizon_s": HORIZONS_S[0], "headroom": headroom, **r}
                )
        out["traces"][name] = {"bin_s": b, "bins": len(load), "mean_rps": float(load.mean()), "cells": cells}
    return out


def markdown(res: dict) -> str:
    lines = [
        "# Pool forecast: under-provisioning against capacity freed",
        "",
        f"`python -m rose.sim.forecast_eval` (a pool of {res['pool_replicas']} replicas sized for the trace's "
        f"peak bin with headroom {res['headroom']}; a decision at every bin, keeping the replicas its "
        "forecast needs with the decision's headroom; under = the load of a bin within the horizon exceeds "
        "the kept replicas' capacity (after no load: of those, the decisions whose forecast was 0); "
        "freed = replicas lent / replicas; largest rise = the horizon's peak over a forecast that was not 0).",
        "",
        "| trace | bin s | horizon s | forecast | window s | headroom | under | after no load | freed | largest rise |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, t in res["traces"].items():
        for c in t["cells"]:
            u, ui, fr = c["under_provisioned"], c["under_after_no_load"], c["capacity_freed"]
            us, uis = ("n/a" if x is None else f"{x:.4f}" for x in (u, ui))
            fs = "n/a" if fr is None else f"{fr:.3f}"
            lines.append(
                f"| {name} | {t['bin_s']:g} | {c['horizon_s']:g} | {c['forecast']} | {c['window_s']:g} "
                f"| {c['headroom']:g} | {us} | {uis} | {fs} | ×{c['largest_rise']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rose.sim.forecast_eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=Path, default=Path("../shared/traces"))
    ap.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    a = ap.parse_args(argv)
    res = run(a.traces)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
        a.out.with_suffix(".md").write_text(markdown(res))
    else:
        print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
