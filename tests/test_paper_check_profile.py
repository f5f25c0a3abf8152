"""`rose paper-check` on the measured interference profile: the plan's profile sweep (each
mechanism the default file holds, the linear model's alphas as labelled rows), the ROSE /
share-all targets on crafted results (no simulation), and the profile's label in the tables."""

from __future__ import annotations

from dataclasses import replace

import orjson
import pytest

from rose.sim.interference import default_profile, linear_profile, simulation_profile
from rose.sim.paper_plan import CheckConfig, Job, plan
from rose.sim.paper_results import RATIO_GOAL, Results, targets
from rose.sim.paper_tables import tables
from rose.sim.sim_config import SimConfig

MAIN = "separate_process"
OTHER = "same_process_priority"
SOURCE = "docs/measured/h200/interference.json (NVIDIA H200): separate-process phases"
# a gap split as rose.sim.report.share_all_gap gives it: ROSE does 0.6 of share-all's harvest
GAP = {
    "share_all_harvested_episodes": 100.0,
    "rose": 0.6,
    "no_lease": 0.28,
    "lease_start": 0.02,
    "paused": 0.1,
    "share_cap": 0.0,
    "above_share_all": 0.0,
    "no_lease_by_reason": {"below_threshold": 0.25, "cooldown": 0.03, "memory": 0.0, "other": 0.0},
    "paused_by": {"guard": 0.0, "throttle": 0.1},
    "residual": 0.0,
    "tolerance": 1e-6,
    "unfinished": 0.0,
}


def test_plan_sweeps_every_measured_mechanism_and_the_linear_rows():
    cc = CheckConfig(
        traces=("t.csv",), models=("8B",), gpus=4, gm=2, seeds=2, alphas=(0.1, 0.3, 1.0), gpu_alpha=0.9,
        gm_sweep=(1, 2), elastic_caps=(0.25, 1.0),
    )  # fmt: skip
    jobs = plan(cc)
    default = simulation_profile()  # serving's ratios and rollout's fractions from the same runs
    main = [j for j in jobs if j.kind == "main"]
    assert len(main) == 2 and all(j.sim.profile() == default and j.sim.alpha is None for j in main)
    assert default.mechanism == MAIN and {j.value for j in main} == {MAIN}
    assert "separate_process" in default.source and "8b" in default.source
    swept = {j.value: j for j in jobs if j.kind == "profile"}
    others = dict(default.others)  # the other mechanisms its file holds, each swept
    assert set(swept) == {*others, *(f"linear alpha {a:g}" for a in (0.1, 0.3, 0.9, 1.0, 3.157))}
    for name, points in others.items():
        assert (swept[name].sim.profile().mechanism, swept[name].sim.profile().points) == (name, points)
    for a in (0.1, 0.3, 0.9, 1.0, 3.157):
        assert swept[f"linear alpha {a:g}"].sim.profile() == linear_profile(a)
    assert all(j.sim.policies == ("share-all", "rose") for j in swept.values())
    gm = [j for j in jobs if j.kind == "gm"]
    assert [j.value for j in gm] == [1] and gm[0].sim.profile() == default  # G/M swept on the main profile
    assert gm[0].sim.policies == ("share-all", "rose")
    assert [j.sim.profile() for j in jobs if j.kind == "cap"] == [default]
    # elastic's provisioning delay, an assumption, swept around its default (elastic only)
    prov = [j for j in jobs if j.kind == "provision"]
    assert [j.value for j in prov] == [60.0, 600.0] and [j.sim.elastic_provision_s for j in prov] == [60.0, 600.0]
    assert all(j.sim.policies == ("elastic",) for j in prov)


def _run(mech: str, seed: int, rose_eps: float, sa_eps: float, slo: dict[str, float], source: str = SOURCE) -> dict:
    """A crafted `simulate` result of one seed: what the targets and tables read."""

    def pol(eps: float, p: str, gain: float, harvest: float = 0.0) -> dict:
        return {
            "episodes": eps,
            "gain_vs_static": gain,
            "slo_attainment": slo[p],
            "harvest_per_serving_gpu": harvest,
            "mean_leased_gpus": 10.0,
            "mean_leased_compute": 5.0,
            "leases_unusable": 0,
            "replica_lease_hours": 1.25,
            "coresident_lease_hours": 2.5,
        }

    return {
        "policies": {
            "static": pol(50, "static", 1.0),
            "elastic": pol(60, "static", 1.2),
            "share-all": pol(sa_eps, "share-all", sa_eps / 50, 0.12),
            "rose": pol(rose_eps, "rose", rose_eps / 50, 0.08 + 0.001 * seed),
        },
        "interference_profile": {"mechanism": mech, "source": source},
        "rose_vs_share_all": {"throughput_ratio": rose_eps / sa_eps, "gap": GAP},
        "config": {"rollout": {"policy_weight_bytes_per_gpu": 16 * 2**30}},
        "fleet": {"gpu": "H100"},
        "wall_s": 1.0,
    }


def _results(main_slo: dict[str, float], sweep: dict[str, tuple[float, dict[str, float]]]) -> Results:
    """Three main seeds at ROSE / share-all 0.8 (79, 80 and 81 over 100) and one sweep seed per
    profile key: (ROSE's episodes over share-all's 100, SLO attainments)."""
    cc = CheckConfig(
        traces=("t.csv",), models=("8B",), gpus=16, gm=8, seeds=3, alphas=(0.3,), gm_sweep=(8,),
        elastic_caps=(0.25,),
    )  # fmt: skip
    jobs, runs = [], []
    for s, eps in enumerate((79.0, 80.0, 81.0)):
        jobs.append(Job("main", "t.csv", "8B", MAIN, s, SimConfig()))
        runs.append(_run(MAIN, s, eps, 100.0, main_slo))
    for key, (eps, slo) in sweep.items():
        jobs.append(Job("profile", "t.csv", "8B", key, 0, SimConfig()))
        runs.append(_run(OTHER if key == OTHER else "linear", 0, eps, 100.0, slo, source=f"{key} source"))
    return Results(cc, jobs, runs)


KEEP = {"static": 0.999, "share-all": 0.999, "rose": 0.999}
SA_BREAKS = {"static": 0.999, "share-all": 0.98, "rose": 0.999}


def _target(res: Results, name: str) -> dict:
    rows = [r for r in targets(res) if r["target"].startswith(name)]
    assert len(rows) == 1, [r["target"] for r in targets(res)]
    return rows[0]


@pytest.mark.parametrize(
    "sweep,where",
    [
        ({OTHER: (97.0, KEEP), "linear alpha 3.157": (80.0, KEEP)}, "met with the same_process_priority profile"),
        ({OTHER: (80.0, KEEP), "linear alpha 0.3": (96.0, KEEP)}, "missed at every measured profile; met with linear alpha 0.3 (model, not measured)"),
        ({OTHER: (80.0, KEEP), "linear alpha 0.3": (80.0, KEEP)}, "missed at every measured profile and every linear alpha"),
    ],
)  # fmt: skip
def test_ratio_below_the_goal_where_share_all_keeps_the_rule_is_a_miss_with_its_gap_split(sweep, where):
    row = _target(_results(KEEP, sweep), "ROSE / share-all ≥")
    assert row["goal"] == f"≥ {RATIO_GOAL:g}" and not row["met"]
    assert row["mean"] == pytest.approx(0.8) and row["ci95_half"] > 0  # 95 % interval over the 3 seeds
    why = row["held_back_by"]
    assert why.startswith(where), why
    # the constant behind the largest cause of the split, and the split itself
    assert "the grant threshold policy.grant_headroom holds it back: below the grant threshold 0.250" in why
    assert "62% of the gap" in why  # 0.25 of the 0.4 ROSE does not harvest
    assert "ROSE does 0.600" in why and "paused (throttle) 0.100" in why and "share cap 0.000" in why
    assert "lease start 0.020" in why


def test_share_all_breaking_the_rule_where_rose_keeps_it_meets_the_per_model_target():
    res = _results(SA_BREAKS, {OTHER: (80.0, SA_BREAKS)})
    row = _target(res, "share-all breaks the SLO rule where ROSE keeps it")
    assert row["met"] and row["mean"] == 1 and row["cell"] == "8B"
    assert not [r for r in targets(res) if r["target"].startswith("ROSE / share-all")]  # share-all breaks the rule


def test_share_all_keeping_the_rule_everywhere_misses_the_per_model_target_and_names_the_profile_it_breaks_at():
    res = _results(KEEP, {OTHER: (80.0, KEEP), "linear alpha 3.157": (80.0, SA_BREAKS)})
    row = _target(res, "share-all breaks the SLO rule where ROSE keeps it")
    assert not row["met"] and row["mean"] == 0
    assert "share-all keeps the rule in every cell" in row["held_back_by"]
    assert "met with linear alpha 3.157 (model, not measured)" in row["held_back_by"]


def test_the_tables_render_the_profile_label_and_rose_beside_share_all():
    res = _results(KEEP, {OTHER: (97.0, KEEP), "linear alpha 0.3": (90.0, SA_BREAKS)})
    md = tables(res, "rose paper-check", 60.0)
    assert md.count(f"Interference profile: `{MAIN}` (measured), source: {SOURCE}.") == 4  # every table but the sweep's
    assert f"- {MAIN} (measured, main runs): {SOURCE}" in md
    assert f"- {OTHER} (measured): {OTHER} source" in md
    assert "| t | 8B | linear alpha 0.3 (model, not measured) | 1.800 | 2.000 | 0.900 |" in md
    assert f"| t | 8B | {OTHER} (measured) | 1.940 | 2.000 | 0.970 |" in md
    # the main runs' ratio with its 95 % interval over the seeds, and the gap's main causes
    assert "| t | 8B | 1.600 ± 0.050 | 2.000 ± 0.000 | 0.800 [0.775, 0.825] |" in md
    assert "gap: below threshold / lease start / paused / share cap" in md
    assert "| 0.250 / 0.020 / 0.100 / 0.000 |" in md
    assert "| 10.0 | 1.25 / 2.50 | 0 |" in md  # mean leased GPUs, GPU-hours per lease kind, unusable
    lines = md.splitlines()
    width = 0
    for i, line in enumerate(lines):  # every row and separator has as many cells as its table's header
        if i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            width = line.count("|")
        elif line.startswith("|"):
            assert line.count("|") == width, line


def test_a_profile_file_sets_the_main_runs_and_its_other_mechanisms_are_swept(tmp_path):
    d = default_profile().to_json()
    d["mechanism"], d["points"] = OTHER, d["mechanisms"].pop(OTHER)
    d["mechanisms"][MAIN] = default_profile().to_json()["points"]
    f = tmp_path / "profile.json"
    f.write_bytes(orjson.dumps(d))
    cc = CheckConfig(traces=("t.csv",), models=("8B",), gpus=4, gm=2, seeds=1, alphas=(), gm_sweep=(2,))
    jobs = plan(replace(cc, profile_file=str(f)))
    assert {j.sim.profile().mechanism for j in jobs if j.kind in ("main", "cap")} == {OTHER}
    swept = {j.value: j.sim.profile() for j in jobs if j.kind == "profile"}
    assert set(swept) == {MAIN, "linear alpha 3.157"} and swept[MAIN].points == default_profile().points
    f.write_text("{}")
    with pytest.raises(ValueError, match="schema"):
        replace(cc, profile_file=str(f))
