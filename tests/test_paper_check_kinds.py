"""The paper check's lease-kind requirements on crafted results (no simulation): the main runs
run `rose-coresident` beside the four policies; the trough from the run's
load through the pool's own forecast; R1 (`rose` beside `rose-coresident` where the trace has a
trough, beside static at 70B where `rose-coresident` cannot gain) and R2 (`rose-coresident`'s
work beside share-all's where share-all keeps the SLO rule, else `rose` keeping it), each row
with what holds a miss back, and the table of their figures (docs/paper-check.md)."""

from __future__ import annotations

import numpy as np
import pytest

from rose.policy.pool import PoolConfig, window_bins
from rose.sim.models import EpisodeModel
from rose.sim.paper_kinds import CORESIDENT, R1_GAIN, R2_SHARE, all_targets
from rose.sim.paper_plan import MAIN_POLICIES, CheckConfig, Job, plan, spare_replicas
from rose.sim.paper_results import Results
from rose.sim.paper_tables import tables
from rose.sim.requests import RequestStream
from rose.sim.sim_config import SimConfig
from rose.sim.traces import Trace
from tests.test_paper_check_profile import MAIN
from tests.test_paper_check_trainer import _trainer_run

EP = EpisodeModel()
KEEP = {"static": 0.999, "share-all": 0.999, "rose": 0.999, CORESIDENT: 0.999, "rose-replica": 0.999}
SA_BREAKS = {**KEEP, "share-all": 0.98}
TROUGH = {"replicas": 16, "mean_spare_replicas": 4.0, "bins_with_spare": 0.5}


def test_the_main_runs_run_rose_coresident_beside_the_four_policies():
    cc = CheckConfig(traces=("t.csv",), models=("8B",), gpus=4, gm=2, seeds=2, alphas=(0.3,), gm_sweep=(2,))
    jobs = plan(cc)
    main = [j for j in jobs if j.kind == "main"]
    assert main and all(j.sim.policies == MAIN_POLICIES for j in main)
    assert {"static", "elastic", "share-all", "rose", CORESIDENT} == set(MAIN_POLICIES)
    assert all(CORESIDENT not in j.sim.policies for j in jobs if j.kind != "main")  # the sweeps as before


def _stream(rps: list[tuple[float, float]]) -> RequestStream:
    """One copy of a trace of evenly spaced arrivals: (seconds, requests/s) per stretch."""
    t, t0 = [], 0.0
    for span, rate in rps:
        t += list(t0 + np.arange(0.0, span, 1.0 / rate))
        t0 += span
    a = np.array(t)
    n = len(a)
    tr = Trace("t", "test", a, np.full(n, 100, np.int32), np.full(n, 10, np.int32))
    rate = n / (a[-1] + a[-1] / (n - 1))
    return RequestStream(tr, rate, t0, seed=0)  # the trace's own rate: one copy, kept whole


def test_a_flat_load_spares_replicas_only_after_a_window_of_history():
    pool = PoolConfig()
    s = spare_replicas(_stream([(600.0, 1.0)]), 600.0, 1.25, 8, pool)
    bins = 600.0 / pool.bin_s
    first = window_bins(pool) - 1  # the first bin with a window of history
    # peak 1.2 rps (6 in a 5 s bin) × (1 + 0.3) over 1.25 rps a replica: 2 needed, 6 spare
    assert s["bins_with_spare"] == pytest.approx((bins - first) / bins, abs=1e-4)
    assert s["mean_spare_replicas"] == pytest.approx(6 * (bins - first) / bins, abs=1e-3)
    assert spare_replicas(_stream([(600.0, 1.0)]), 600.0, 1.25, 1, pool)["mean_spare_replicas"] == 0  # never the last


def test_a_busy_load_spares_nothing_and_a_trough_spares_once_the_window_has_passed_the_peak():
    pool = PoolConfig()
    busy = spare_replicas(_stream([(1200.0, 10.0)]), 1200.0, 1.25, 8, pool)
    assert busy["mean_spare_replicas"] == 0 and busy["bins_with_spare"] == 0
    dip = spare_replicas(_stream([(600.0, 10.0), (1200.0, 1.0), (600.0, 10.0)]), 2400.0, 1.25, 8, pool)
    # spare from a window after the fall (900 s) to the rise (1800 s + the copy's offset)
    assert 0.3 < dip["bins_with_spare"] < 0.45 and dip["mean_spare_replicas"] > 1


def _kinds_run(seed: int, model: str, harvest: dict[str, float], slo: dict[str, float], **rose) -> dict:
    """A crafted main run with every main policy: ROSE at the trainer's bound (a step's episodes
    waiting), the work on serving GPUs per policy (`harvest`), the trough figures."""
    r = _trainer_run(seed, 8900.0, float(EP.episodes_per_step), {"train_gpus": 8, "train_mfu": 0.4})
    pols = r["policies"]
    for p in (CORESIDENT, "rose-replica"):
        pols[p] = {**pols["rose"], "replica_lease_hours": 0.0}
    for p, h in harvest.items():
        pols[p].update(harvest_per_serving_gpu=h, slo_attainment=slo[p])
    pols["static"]["slo_attainment"] = slo["static"]
    pols["rose"].update(
        {"replica_lease_hours": 2.0, "reclaims_late": 0, "replica_grants": 12, "drain_timeouts": 0, **rose}
    )
    tp = 4 if model.startswith("70B") else 1
    r["fleet"].update(tensor_parallel=tp, serving_gpus=64)
    r["trough"] = {**TROUGH, "replicas": 64 // tp}
    return r


def _res(model: str, harvest: dict[str, float], slo: dict[str, float] = KEEP, trough: dict | None = TROUGH, **rose):
    cc = CheckConfig(traces=("t.csv",), models=(model,), gpus=64, gm=8, seeds=3, alphas=(0.3,), gm_sweep=(8,))
    jobs = [Job("main", "t.csv", model, MAIN, s, SimConfig()) for s in range(3)]
    runs = [_kinds_run(s, model, {k: v * (1 + 0.01 * s) for k, v in harvest.items()}, slo, **rose) for s in range(3)]
    for r in runs:
        r["trough"] = None if trough is None else {**trough, "replicas": r["trough"]["replicas"]}
    return Results(cc, jobs, runs)


def _row(res: Results, start: str) -> dict:
    rows = [r for r in all_targets(res) if r["target"].startswith(start)]
    assert len(rows) == 1, [r["target"] for r in all_targets(res)]
    return rows[0]


SMALL = {"rose": 0.15, CORESIDENT: 0.10, "rose-replica": 0.06, "share-all": 0.12}


def test_r1_at_8b_compares_work_and_names_the_trainer_for_rl_throughput():
    res = _res("8B", SMALL)
    work = _row(res, "R1: rose / rose-coresident work")
    assert work["met"] and work["mean"] == pytest.approx(1.5) and work["goal"] == f"≥ {R1_GAIN:g}"
    rl = _row(res, "R1: rose / rose-coresident RL throughput")
    assert not rl["met"] and rl["mean"] == pytest.approx(1.0)  # both trained what the trainer took
    assert rl["held_back_by"].startswith("the trainer holds it back (its size and speed, SimConfig.train_gpus 8")
    assert "rose's work ×1.500 of rose-coresident's" in rl["held_back_by"]
    slo = _row(res, "R1: SLO rose")
    assert slo["met"] and slo["text"].endswith("; 0 late")


def test_r1_work_held_back_by_a_shallow_trough_names_the_pools_spare_replicas():
    # 1.5 spare replicas of 64: 0.023 of a GPU per serving GPU beside rose-coresident's 0.202 (the seeds' mean) < 1.2 × 0.202
    res = _res("8B", {**SMALL, "rose": 0.21, CORESIDENT: 0.20}, trough={**TROUGH, "mean_spare_replicas": 1.5})
    work = _row(res, "R1: rose / rose-coresident work")
    assert not work["met"]
    why = work["held_back_by"]
    assert why.startswith("the trough holds it back: the pool's forecast spares 1.5 of 64 replicas"), why
    assert "PoolConfig.forecast, window_s, headroom" in why and "at most 0.2254 against 0.2424 needed" in why


def test_r1_work_below_what_the_trough_allows_names_the_lends():
    work = _row(_res("8B", {**SMALL, "rose": 0.11}), "R1: rose / rose-coresident work")
    assert not work["met"]
    assert work["held_back_by"].startswith("the lends, not the trough: "), work["held_back_by"]
    assert "rose held 2.00 of 4.00 spare replica GPU-h (12 lends" in work["held_back_by"]
    assert "rose-replica alone harvests 0.0606" in work["held_back_by"]


def test_r1_without_a_trough_does_not_apply_and_says_so():
    res = _res("8B", SMALL, trough={**TROUGH, "mean_spare_replicas": 0.4})
    for start in ("R1: rose / rose-coresident work", "R1: rose / rose-coresident RL"):
        row = _row(res, start)
        assert row["met"] is None and row["held_back_by"].startswith("no trough: the pool's forecast spares 0.4 of 64")
    assert "| n/a | no trough" in tables(res, "rose paper-check", 60.0)


def test_late_reclaims_miss_r1s_serving_side():
    row = _row(_res("8B", SMALL, reclaims_late=2), "R1: SLO rose")
    assert not row["met"] and row["text"].endswith("; 6 late")  # 2 in each of 3 seeds
    assert "6 late reclaims over the seeds" in row["held_back_by"]


def test_r1_at_70b_where_rose_coresident_cannot_gain_compares_rose_with_static():
    res = _res("70B", {"rose": 0.05, CORESIDENT: 0.001, "rose-replica": 0.05, "share-all": 0.002})
    work = _row(res, "R1: rose's work gain")
    assert "where rose-coresident cannot (×1.008)" in work["target"]
    assert work["met"] and work["mean"] == pytest.approx(1.404, abs=1e-3)  # 1 + 8 × 0.0505 (mean of seeds)
    rl = _row(res, "R1: rose ≥ 1.2× static (RL throughput)")
    assert not rl["met"] and rl["held_back_by"].startswith("the trainer holds it back")
    # where rose-coresident's work alone gives the gain, R1 asks nothing more of rose at 70B
    res = _res("70B", {"rose": 0.05, CORESIDENT: 0.04, "rose-replica": 0.0, "share-all": 0.05})
    assert not [r for r in all_targets(res) if r["target"].startswith("R1: rose's work gain")]


def test_r2_compares_rose_coresidents_work_with_share_alls_where_share_all_keeps_the_rule():
    row = _row(_res("8B", {**SMALL, CORESIDENT: 0.06}), "R2: rose-coresident / share-all work")
    assert not row["met"] and row["mean"] == pytest.approx(0.5) and row["goal"] == f"≥ {R2_SHARE:g}"
    assert "the grant threshold policy.grant_headroom holds it back" in row["held_back_by"]
    res = _res("8B", SMALL, slo=SA_BREAKS)  # share-all breaks the rule: rose must keep it
    assert not [r for r in all_targets(res) if r["target"].startswith("R2: rose-coresident")]
    assert _row(res, "R2: SLO rose ≥ static − 0.002 where share-all breaks it")["met"]


def test_the_kinds_table_shows_r1_and_r2s_figures_per_cell():
    md = tables(_res("8B", SMALL), "rose paper-check", 60.0)
    assert "### Both lease kinds and share-all's work (R1, R2), the main runs" in md
    assert "Main runs: static, elastic, share-all, rose, rose-coresident, rose-replica." in md  # as they ran
    row = next(line for line in md.splitlines() if line.startswith("| t | 8B | 4.0 of 64 replicas"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[3] == "1.500 [1.500, 1.500]"  # rose / rose-coresident work, every seed the same
    assert cells[4].startswith("1.000")  # RL throughput: the trainer's
    assert cells[5] == "0.833 [0.833, 0.833]"  # rose-coresident / share-all work
    assert cells[6] == "0.1515 / 0.1010 / 0.1212" and cells[7:] == ["+0.00200", "+0.00200", "0"]
    lines = md.splitlines()
    width = 0
    for i, line in enumerate(lines):  # every row has as many cells as its table's header
        if i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            width = line.count("|")
        elif line.startswith("|"):
            assert line.count("|") == width, line


def test_a_record_without_rose_coresident_gives_no_kind_rows_and_dashes():
    res = _res("8B", SMALL)
    for r in res.main("t.csv", "8B"):
        del r["policies"][CORESIDENT]
    assert not [r for r in all_targets(res) if r["target"].startswith(("R1", "R2"))]
    assert "| t | 8B | 4.0 of 64 replicas (one or more in 50% of bins) | – | – |" in tables(
        res, "rose paper-check", 60.0
    )
