"""The paper check's two lease-kind requirements, from the main runs (docs/paper-check.md
"Targets"): R1, `rose` (both lease kinds) beside `rose-coresident` where the trace has a trough
at 7B/8B, and beside static where `rose-coresident` cannot gain at 70B; R2, `rose-coresident`'s
work beside share-all's where share-all keeps the SLO rule, else `rose` keeping it. RL throughput
is bounded by the trainer in the latest runs, so each compares work, the rollout done on serving
GPUs (`harvest_per_serving_gpu`, in dedicated-GPU equivalents per serving GPU), beside it.
"""

from __future__ import annotations

import math
import statistics

from rose.obs.stats import mean_ci95
from rose.sim.paper_results import (
    SLO_GAP,
    Results,
    _held_back,
    _is_small,
    _mean_trainer_bound,
    _row,
    _slo_why,
    _trainer_constants,
    figures,
    targets,
    trace_name,
    versus,
)

CORESIDENT = "rose-coresident"
R1_GAIN = 1.2  # R1: `rose` over `rose-coresident` (a trough), over static at 70B
R2_SHARE = 0.9  # R2: `rose-coresident`'s work over share-all's where share-all keeps the SLO rule
# a trough: the pool's forecast spares at least one replica on average over the run, the least a
# replica lease lends (rose.sim.paper_plan.spare_replicas)
TROUGH_REPLICAS = 1.0


def ran(rs: list[dict], *policies: str) -> bool:
    """Whether every run of `rs` ran each of `policies` (a record from before they were main runs
    did not)."""
    return bool(rs) and all(set(policies) <= r["policies"].keys() for r in rs)


def work_ratio(rs: list[dict], a: str, b: str) -> list[float]:
    """Per seed: policy a's work on serving GPUs over policy b's (NaN where b did none)."""
    out = []
    for r in rs:
        x, y = (r["policies"][p]["harvest_per_serving_gpu"] for p in (a, b))
        out.append(x / y if y > 0 else math.nan)
    return out


def rl_ratio(rs: list[dict], a: str, b: str) -> list[float]:
    """Per seed: policy a's RL throughput (episodes trained) over policy b's."""
    return [r["policies"][a]["episodes"] / max(1e-9, r["policies"][b]["episodes"]) for r in rs]


def work_gain(rs: list[dict], policy: str, gm: int) -> list[float]:
    """Per seed: the gain over static the policy's work would give a trainer that keeps up,
    ``1 + (G/M) × harvest`` (docs/simulator.md "What the gain is made of")."""
    return [1.0 + gm * h for h in figures(rs, policy, "harvest_per_serving_gpu")]


def late(rs: list[dict]) -> int:
    """`rose`'s reclaims during which its pool's load exceeded what its serving replicas carry."""
    return sum(int(r["policies"]["rose"].get("reclaims_late") or 0) for r in rs)


def trough(rs: list[dict]) -> dict | None:
    """The main runs' trough figures, mean over the seeds (each plays its own copies of the
    trace); None in a record without them."""
    trs = [r["trough"] for r in rs if r.get("trough")]
    if not trs or len(trs) < len(rs):
        return None
    return {
        "replicas": trs[0]["replicas"],
        **{k: statistics.fmean(x[k] for x in trs) for k in ("mean_spare_replicas", "bins_with_spare")},
    }


def has_trough(tr: dict | None) -> bool:
    return tr is not None and tr["mean_spare_replicas"] >= TROUGH_REPLICAS


def trough_text(tr: dict | None) -> str:
    if tr is None:
        return "–"
    return f"{tr['mean_spare_replicas']:.1f} of {tr['replicas']} replicas (one or more in {tr['bins_with_spare']:.0%} of bins)"


def interval_text(xs: list[float], nd: int = 3) -> str:
    """The mean of `xs` with its 95 % interval over the seeds in brackets."""
    if not xs or any(math.isnan(x) for x in xs):
        return "–"
    m, ci = mean_ci95(xs)
    if m is None:
        return "–"
    return f"{m:.{nd}f}" if ci is None else f"{m:.{nd}f} [{ci[0]:.{nd}f}, {ci[1]:.{nd}f}]"


def all_targets(res: Results) -> list[dict]:
    """Every target of the check: rose.sim.paper_results.targets with R1 and R2 in each cell."""
    return targets(res, kinds_targets)


def kinds_targets(res: Results, t: str, m: str) -> list[dict]:
    """R1 and R2 in one cell, where its main runs ran `rose-coresident` beside the others."""
    rs = res.main(t, m)
    if not ran(rs, "rose", CORESIDENT, "share-all"):
        return []
    cell = f"{trace_name(t)} {m}"
    rows = [_slo_late_row(res, t, m, cell)]
    if _is_small(m):
        rows += _r1_small(res, t, m, cell) + _r2(res, t, m, cell)
    elif statistics.fmean(work_gain(rs, CORESIDENT, res.cc.gm)) < R1_GAIN:
        rows += _r1_large(res, t, m, cell)
    return rows


def _slo_late_row(res: Results, t: str, m: str, cell: str) -> dict:
    """R1's serving side: `rose` keeps the SLO rule and reclaims nothing late."""
    n = late(res.main(t, m))
    row = _row(f"R1: SLO rose ≥ static − {SLO_GAP:g}, reclaims_late 0", cell, res.slo_gap(t, m, "rose"),
               -SLO_GAP, 5, _slo_why(res, t, m))  # fmt: skip
    row["text"] += f"; {n} late"
    if n:
        why = (
            f"{n} late reclaim{'s' if n != 1 else ''} over the seeds: the pool's forecast (PoolConfig.forecast, window_s) and "
            "headroom (PoolConfig.headroom) against the load's rise within a reclaim (reclaim_to_serving_s)"
        )
        row.update(met=False, held_back_by="; ".join(x for x in (row["held_back_by"], why) if x))
    return row


def _na(target: str, cell: str, goal: float, why: str) -> dict:
    """A row that does not apply to the cell, saying why (`met` None: neither pass nor miss)."""
    return {"target": target, "cell": cell, "mean": None, "ci95_half": None, "goal": f"≥ {goal:g}",
            "met": None, "held_back_by": why, "text": "–"}  # fmt: skip


def _r1_small(res: Results, t: str, m: str, cell: str) -> list[dict]:
    rs = res.main(t, m)
    tr = trough(rs)
    work_t = f"R1: rose / rose-coresident work ≥ {R1_GAIN:g}× where the trace has a trough"
    rl_t = f"R1: rose / rose-coresident RL throughput ≥ {R1_GAIN:g}× where the trace has a trough"
    if not has_trough(tr):
        why = (
            "no trace figures in the record"
            if tr is None
            else f"no trough: the pool's forecast spares {trough_text(tr)} on average, fewer than "
            f"{TROUGH_REPLICAS:g} (PoolConfig.forecast, window_s, headroom at the busiest minute's provisioning)"
        )
        return [_na(work_t, cell, R1_GAIN, why), _na(rl_t, cell, R1_GAIN, why)]
    work = work_ratio(rs, "rose", CORESIDENT)
    co = statistics.fmean(figures(rs, CORESIDENT, "harvest_per_serving_gpu"))
    return [
        _row(work_t, cell, work, R1_GAIN, 3, _replica_why(res, t, m, co, R1_GAIN * co)),
        _row(rl_t, cell, rl_ratio(rs, "rose", CORESIDENT), R1_GAIN, 3, _rl_why(res, t, m, work, CORESIDENT)),
    ]


def _r1_large(res: Results, t: str, m: str, cell: str) -> list[dict]:
    """At 70B, where `rose-coresident`'s work would not give R1_GAIN over static: `rose`'s."""
    rs, gm = res.main(t, m), res.cc.gm
    co = statistics.fmean(work_gain(rs, CORESIDENT, gm))
    where = f"where rose-coresident cannot (×{co:.3f})"
    work = work_gain(rs, "rose", gm)
    need = (R1_GAIN - 1.0) / gm
    h = statistics.fmean(figures(rs, CORESIDENT, "harvest_per_serving_gpu"))
    return [
        _row(f"R1: rose's work gain 1 + (G/M) × harvest ≥ {R1_GAIN:g}× static {where}", cell, work, R1_GAIN, 3,
             _replica_why(res, t, m, h, need)),
        _row(f"R1: rose ≥ {R1_GAIN:g}× static (RL throughput) {where}", cell, figures(rs, "rose", "gain_vs_static"),
             R1_GAIN, 3, _rl_why(res, t, m, work, "static")),
    ]  # fmt: skip


def _replica_why(res: Results, t: str, m: str, co: float, need: float) -> str:
    """What bounds the work replica leases add to rose-coresident's harvest `co` against the
    harvest `need`ed: the trough (the pool's spare replicas, at most one dedicated GPU's work per
    lent GPU), else how much of it `rose` lent and what cost the lends."""
    rs = res.main(t, m)
    tr = trough(rs)
    if tr is None:
        return "no trough figures in the record"
    fleet = rs[0]["fleet"]
    spare_h = tr["mean_spare_replicas"] * fleet["tensor_parallel"] / fleet["serving_gpus"]  # per serving GPU
    ceiling = co + spare_h
    pool = (
        f"the pool's forecast spares {trough_text(tr)} on average, {spare_h:.4f} of a GPU per serving GPU "
        "(PoolConfig.forecast, window_s, headroom; a replica is provisioned for the busiest minute at SimConfig.load)"
    )
    if ceiling < need:
        return (
            f"the trough holds it back: {pool}; beside rose-coresident's harvest {co:.4f}, at most {ceiling:.4f} "
            f"against {need:.4f} needed"
        )
    p = rs[0]["policies"]["rose"]
    used = statistics.fmean(figures(rs, "rose", "replica_lease_hours"))
    hours = rs[0]["config"]["duration_s"] / 3600.0
    avail = tr["mean_spare_replicas"] * fleet["tensor_parallel"] * hours
    rep = ""
    if ran(rs, "rose-replica"):
        rep = f"; rose-replica alone harvests {statistics.fmean(figures(rs, 'rose-replica', 'harvest_per_serving_gpu')):.4f}"
    return (
        f"the lends, not the trough: {pool}; rose held {used:.2f} of {avail:.2f} spare replica GPU-h "
        f"({p.get('replica_grants', 0)} lends, {p.get('drain_timeouts', 0)} drain timeouts (DRAIN_TIMEOUT_S), "
        f"{p.get('replica_grants_rejected', 0)} grants rejected in the first seed; the pool's no-lend-without-a-window rule, "
        f"PoolConfig.window_s){rep}"
    )


def _rl_why(res: Results, t: str, m: str, work: list[float], over: str) -> str:
    """An RL throughput row: the trainer where `rose` sits at its bound, else the work."""
    rs = res.main(t, m)
    w = f"rose's work ×{statistics.fmean(work):.3f} of {over}'s"
    if (bound := _mean_trainer_bound(rs)) is None:
        return f"the work: {w} (the work row)"
    return (
        f"the trainer holds it back ({_trainer_constants(rs[0])}): at most ×{bound:.3f} of static's episodes "
        f"for every policy, whatever the rollout; {w}"
    )


def _r2(res: Results, t: str, m: str, cell: str) -> list[dict]:
    rs = res.main(t, m)
    if res.keeps(t, m, "share-all"):
        g = versus(rs).get("gap") or {}
        why = (
            f"rose-coresident's co-resident leases, by rose's gap split to share-all (the same policy on "
            f"the GPUs it keeps): {_held_back(g)}"
        )
        return [_row(f"R2: rose-coresident / share-all work ≥ {R2_SHARE:g} where share-all keeps the SLO rule",
                     cell, work_ratio(rs, CORESIDENT, "share-all"), R2_SHARE, 3, why)]  # fmt: skip
    return [_row(f"R2: SLO rose ≥ static − {SLO_GAP:g} where share-all breaks it", cell, res.slo_gap(t, m, "rose"),
                 -SLO_GAP, 5, _slo_why(res, t, m))]  # fmt: skip


KINDS_HEAD = (
    "trough: mean spare replicas | rose / rose-coresident work [95 %] | rose / rose-coresident RL [95 %] | "
    "rose-coresident / share-all work [95 %] | harvest rose / rose-coresident / share-all | "
    "SLO share-all − (static − 0.002) | SLO rose − (static − 0.002) | rose reclaims_late"
)


def kinds_table(res: Results) -> list[str]:
    """R1 and R2's figures per cell of the main runs ('–' where a run lacks a policy)."""
    lines = [
        "",
        "### Both lease kinds and share-all's work (R1, R2), the main runs",
        "",
        f"| trace | model | {KINDS_HEAD} |",
        "|---|---|" + "---:|" * 8,
    ]
    for t in res.cc.traces:
        for m in res.cc.models:
            rs = res.main(t, m)
            lines.append(f"| {trace_name(t)} | {m} | " + " | ".join(_kinds_cells(res, t, m, rs)) + " |")
    lines += [
        "",
        "Work: rollout done on serving GPUs (`harvest_per_serving_gpu`, dedicated-GPU equivalents per serving "
        "GPU), which the trainer does not bound; RL: episodes trained. The SLO columns: the policy's attainment "
        f"minus static's − {SLO_GAP:g}, mean over the seeds (≥ 0: it keeps the SLO rule). The trough: the "
        "replicas the pool's forecast would spare, mean over the run's bins (`rose.sim.paper_plan.spare_replicas`).",
    ]
    return lines


def _kinds_cells(res: Results, t: str, m: str, rs: list[dict]) -> list[str]:
    if not ran(rs, "rose", CORESIDENT, "share-all"):
        return [trough_text(trough(rs)), *["–"] * 7]
    harvest = " / ".join(
        f"{statistics.fmean(figures(rs, p, 'harvest_per_serving_gpu')):.4f}" for p in ("rose", CORESIDENT, "share-all")
    )
    margin = [f"{statistics.fmean(res.slo_gap(t, m, p)) + SLO_GAP:+.5f}" for p in ("share-all", "rose")]
    return [
        trough_text(trough(rs)),
        interval_text(work_ratio(rs, "rose", CORESIDENT)),
        interval_text(rl_ratio(rs, "rose", CORESIDENT)),
        interval_text(work_ratio(rs, CORESIDENT, "share-all")),
        harvest,
        *margin,
        str(late(rs)),
    ]
