"""How far each assumed constant of the simulator moves its headline: one small cell (ROSE,
static and share-all on one trace), run at each constant's default and at a low and a high
value, one constant at a time. The constants and their sources: docs/simulator.md
"Constants".

    python -m rose.sim.sweep --trace ../shared/traces/azure_llm2023_conv.csv --duration 120 \
        --out docs/paper-check/assumptions.json

A module constant is swept by setting it for the run and restoring it after (this process
only); the others through `SimConfig`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import orjson

from rose.sim import models, requests, runs
from rose.sim.engine import simulate
from rose.sim.models import EpisodeModel
from rose.sim.sim_config import SimConfig
from rose.sim.traces import load_trace


@contextmanager
def _module_value(module, name: str, value) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


@contextmanager
def _gpu_field(name: str, value: float) -> Iterator[None]:
    old = dict(models.GPUS)
    for k, g in old.items():
        models.GPUS[k] = replace(g, **{name: value})  # type: ignore[arg-type]
    try:
        yield
    finally:
        models.GPUS.clear()
        models.GPUS.update(old)


def _episode(**kw) -> Callable[[SimConfig], SimConfig]:
    return lambda c: replace(c, episode=replace(c.episode, **kw))


@contextmanager
def _nothing() -> Iterator[None]:
    yield


# (constant, default, low, high, how a value is set): a SimConfig change, or a context that
# sets a module constant
ASSUMPTIONS: tuple[tuple[str, float, float, float, Callable], ...] = (
    ("GpuSpec.bw_efficiency", 0.75, 0.6, 0.9, lambda v: _gpu_field("bw_efficiency", v)),
    ("GpuSpec.prefill_mfu", 0.45, 0.3, 0.6, lambda v: _gpu_field("prefill_mfu", v)),
    ("GpuSpec.decode_mfu", 0.45, 0.3, 0.6, lambda v: _gpu_field("decode_mfu", v)),
    ("EpisodeModel.tool_s", 2.0, 0.5, 8.0, lambda v: _episode(tool_s=v)),
    ("EpisodeModel.gen_tokens", 256, 128, 512, lambda v: _episode(gen_tokens=int(v))),
    ("EpisodeModel.turns", 8, 4, 16, lambda v: _episode(turns=int(v))),
    ("EpisodeModel.episodes_per_step", 256, 128, 512, lambda v: _episode(episodes_per_step=int(v))),
    ("SimConfig.train_gpus (× M)", 1, 0.5, 4, lambda v: lambda c: replace(c, train_gpus=max(1, round(v * c.pool)))),
    ("models.TRAIN_MFU", 0.40, 0.3, 0.55, lambda v: lambda c: replace(c, train_mfu=v)),
    ("models.DISK_BYTES_PER_S (GB/s)", 2.0, 0.5, 8.0, lambda v: _module_value(models, "DISK_BYTES_PER_S", v * 1e9)),
    ("SimConfig.load", 0.7, 0.5, 0.9, lambda v: lambda c: replace(c, load=v)),
    ("requests.PEAK_BIN_S", 60.0, 10.0, 300.0, lambda v: _module_value(requests, "PEAK_BIN_S", v)),
    ("requests.TTFT_SLO_SCALE", 5.0, 3.0, 10.0, lambda v: _module_value(requests, "TTFT_SLO_SCALE", v)),
    ("requests.TPOT_SLO_SCALE", 2.0, 1.5, 4.0, lambda v: _module_value(requests, "TPOT_SLO_SCALE", v)),
    ("runs.SHARE_ALL_MEM_FRAC", 0.5, 0.25, 0.75, lambda v: _module_value(runs, "SHARE_ALL_MEM_FRAC", v)),
)


def headline(r: dict) -> dict:
    """The figures a sweep row reports: ROSE's gain over static, ROSE over share-all, SLOs."""
    p = r["policies"]
    return {
        "rose_gain": p["rose"]["gain_vs_static"],
        "share_all_gain": p["share-all"]["gain_vs_static"],
        "rose_over_share_all": r["rose_vs_share_all"]["throughput_ratio"],
        "slo_rose": p["rose"]["slo_attainment"],
        "slo_static": p["static"]["slo_attainment"],
    }


def run_one(trace, base: SimConfig, setter: Callable, value: float) -> dict:
    """The cell at one value of one constant."""
    how = setter(value)
    if callable(how) and not hasattr(how, "__enter__"):
        cfg, ctx = how(base), _nothing()
    else:
        cfg, ctx = base, how
    with ctx:
        return headline(simulate(trace, cfg))


def sweep(trace, base: SimConfig, only: str = "") -> dict:
    """Every assumption at its default, low and high value (those whose name contains `only`)."""
    rows: list[dict] = []
    ref = headline(simulate(trace, base))
    for name, default, lo, hi, setter in ASSUMPTIONS:
        if only and only not in name:
            continue
        row: dict = {"constant": name, "default": default, "low": lo, "high": hi}
        row["at_low"], row["at_high"] = run_one(trace, base, setter, lo), run_one(trace, base, setter, hi)
        rows.append(row)
        print(name, row["at_low"]["rose_gain"], ref["rose_gain"], row["at_high"]["rose_gain"], file=sys.stderr)
    return {"cell": _cell(base), "at_defaults": ref, "rows": rows}


def _cell(c: SimConfig) -> dict:
    return {
        "gpus": c.n_gpus,
        "dedicated": c.pool,
        "model": c.model,
        "gpu": c.gpu,
        "duration_s": c.duration_s,
        "seed": c.seed,
        "policies": list(c.policies),
    }


def markdown(res: dict) -> str:
    """The sweep as a table: ROSE's gain and ROSE / share-all at each value."""
    ref = res["at_defaults"]
    out = [
        f"Cell: {res['cell']}; at the defaults ROSE's gain {ref['rose_gain']}, ROSE / share-all "
        f"{ref['rose_over_share_all']}.",
        "",
        "| constant | default | low → ROSE gain, ROSE/share-all | high → ROSE gain, ROSE/share-all |",
        "|---|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lo, hi = r["at_low"], r["at_high"]
        out.append(
            f"| {r['constant']} | {r['default']:g} | {r['low']:g} → {lo['rose_gain']}, {lo['rose_over_share_all']} "
            f"| {r['high']:g} → {hi['rose_gain']}, {hi['rose_over_share_all']} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True, type=Path)
    ap.add_argument("--out", type=Path, help="write the JSON here (and the table beside it, .md)")
    ap.add_argument("--gpus", type=int, default=16)
    ap.add_argument("--model-size", default="8B")
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--only", default="", help="only the constants whose name contains this")
    a = ap.parse_args(argv)
    base = SimConfig(
        n_gpus=a.gpus,
        model=a.model_size,
        duration_s=a.duration,
        record_series=False,
        policies=("static", "share-all", "rose"),
        episode=EpisodeModel(),
        workers=1,
    )
    res = sweep(load_trace(a.trace), base, a.only)
    res["command"] = "python -m rose.sim.sweep " + " ".join(argv if argv is not None else sys.argv[1:])
    if a.out:
        a.out.write_bytes(orjson.dumps(res, option=orjson.OPT_INDENT_2) + b"\n")
        a.out.with_suffix(".md").write_text(markdown(res))
    else:
        print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
