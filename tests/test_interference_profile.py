"""The interference profile (rose.interference_profile.v1, rose.sim.interference): the reader and
its errors, the lookup (monotone between points, held outside them), the per-step slowdown
distribution, serving's step times in the serving model, GPU time conserved, and what a profile
does to ROSE and share-all in `rose simulate`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rose.config import ConfigError, PolicyConfig, load_config
from rose.contract.events import Latency
from rose.policy.compute_share import compute_share_for, profile_ratio
from rose.sim.engine import SimConfig, calibration, simulate
from rose.sim.interference import (
    DEFAULT_PROFILE_PATH,
    H200_BENCH,
    InterferenceProfile,
    ProfileError,
    ProfilePoint,
    StepMultiplier,
    default_profile,
    linear_profile,
    measured_h200_profile,
    profile_from_json,
    read_profile,
)
from rose.sim.models import gpu_spec, model_size
from rose.sim.serving_model import ServingSim
from rose.sim.traces import load_trace

REPO = Path(__file__).resolve().parent.parent
FAST = settings(max_examples=40, deadline=None)


def flat(p99: float, mean: float, fraction: float, shares=(0.25, 0.5, 1.0)) -> InterferenceProfile:
    return InterferenceProfile("test", "test", tuple(ProfilePoint(s, p99, mean, fraction) for s in shares))


def good() -> dict:
    return {
        "schema": "rose.interference_profile.v1",
        "mechanism": "separate_process",
        "source": "a test",
        "points": [{"share": 0.5, "serving_p99_ratio": 2.0, "serving_mean_ratio": 1.5, "rollout_fraction": 0.3}],
    }


# ---- the default profile ----------------------------------------------------------------


def test_default_profile_is_the_file_generated_from_the_h200_bench():
    """docs/measured/h200/interference-profile.json is what measured_h200_profile derives from
    interference.json (not typed by hand): separate-process serving ratios, same-process
    rollout fractions, labelled so."""
    assert orjson.loads(DEFAULT_PROFILE_PATH.read_bytes()) == measured_h200_profile().to_json()
    p = default_profile()
    bench = orjson.loads(H200_BENCH.read_bytes())["phases"]
    assert p.mechanism == "separate_process" and p.device == "NVIDIA H200"
    assert "separate-process" in p.source and "same-process" in p.source
    assert [pt.share for pt in p.points] == [0.5, 1.0]
    assert p.points[0].serving_p99_ratio == pytest.approx(
        bench["separate_process_share_0.5"]["p99_over_alone"], abs=1e-3
    )
    assert p.points[1].rollout_fraction == bench["low_priority_share_1"]["rollout_over_alone"]
    assert dict(p.others)["same_process_priority"][0].share == 0.25
    from rose.sim.interference import simulation_profile  # the simulator's: one mechanism's runs on both sides

    assert SimConfig().profile() is simulation_profile() and simulation_profile().mechanism == p.mechanism
    assert SimConfig(alpha=0.3).profile().source == "linear alpha=0.3 (sweep)"


def test_linear_profile_is_the_former_model():
    p = linear_profile(0.3)
    assert float(p.serving_p99_ratio(0.5)) == pytest.approx(1.15) and float(p.serving_mean_ratio(0.2)) == pytest.approx(
        1.06
    )
    assert float(p.rollout_fraction(0.37)) == pytest.approx(0.37)
    assert float(linear_profile(3.157).serving_p99_ratio(0.5)) == pytest.approx(2.0)  # the time-slicing cap


# ---- the reader -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change,field",
    [
        ({"schema": "rose.other.v1"}, "schema"),
        ({"mechanism": ""}, "mechanism"),
        ({"source": " "}, "source"),
        ({"points": []}, "points"),
        ({"points": [{"share": 0.0, "serving_p99_ratio": 1, "serving_mean_ratio": 1, "rollout_fraction": 0}]}, "points[0].share"),
        ({"points": [{"share": 0.5, "serving_p99_ratio": "2", "serving_mean_ratio": 1, "rollout_fraction": 0}]}, "points[0].serving_p99_ratio"),
        ({"points": [{"share": 0.5, "serving_p99_ratio": 2, "serving_mean_ratio": -1, "rollout_fraction": 0}]}, "points[0].serving_mean_ratio"),
        ({"points": [{"share": 0.5, "serving_p99_ratio": 2, "serving_mean_ratio": 1, "rollout_fraction": 1.5}]}, "points[0].rollout_fraction"),
        ({"points": [{"share": 0.5, "serving_p99_ratio": 2, "serving_mean_ratio": 1, "rollout_fraction": 0.2}] * 2}, "distinct"),
        ({"mechanisms": {"separate_process_mps": [{"share": 2}]}}, "mechanisms.separate_process_mps[0].share"),
    ],
)  # fmt: skip
def test_reader_rejects_bad_files_naming_the_field(tmp_path, change, field):
    f = tmp_path / "p.json"
    f.write_bytes(orjson.dumps({**good(), **change}))
    with pytest.raises(ProfileError, match=field.replace("[", r"\[").replace("]", r"\]")):
        read_profile(f)
    assert issubclass(ProfileError, ValueError)


def test_reader_round_trips_and_reads_a_bench_result(tmp_path):
    f = tmp_path / "p.json"
    f.write_bytes(orjson.dumps(default_profile().to_json()))
    assert read_profile(f) == default_profile()
    conv = read_profile(H200_BENCH)  # the old bench file, converted
    assert conv.points == measured_h200_profile().points and conv.mechanism == "separate_process"
    only = {**good(), "mechanisms": {"separate_process": good()["points"]}}
    del only["points"]
    assert profile_from_json(only).points[0].serving_p99_ratio == 2.0
    cal = calibration({"unprotected_p99_over_alone": 3.0, "device": "cpu", "_source": "cpu.json"}, None)
    assert float(cal["interference"].serving_p99_ratio(0.1)) == 3.0 and "CPU bench" in cal["interference"].source


def test_cli_reads_a_profile_and_reports_bad_ones_in_one_line(traces_dir, tmp_path):
    f = tmp_path / "p.json"
    f.write_bytes(orjson.dumps({**good(), "points": [{"share": 0.5}]}))
    run = [sys.executable, "-m", "rose", "simulate", "--trace", str(traces_dir / "burstgpt1_first400.csv")]
    bad = subprocess.run([*run, "--interference-profile", str(f)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--interference-profile" in bad.stderr and "serving_p99_ratio" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
    f.write_bytes(orjson.dumps(good()))
    ok = subprocess.run(
        [*run, "--gpus", "4", "--duration", "30", "--json", "--interference-profile", str(f)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert orjson.loads(ok.stdout)["interference_profile"] == {"source": "a test", "mechanism": "separate_process"}


def test_policy_config_reads_a_profile_file_or_pairs(tmp_path):
    f = tmp_path / "p.json"
    f.write_bytes(orjson.dumps(good()))
    assert load_config(env={"ROSE_POLICY__INTERFERENCE_PROFILE": str(f)}).policy.interference_profile == ((0.5, 2.0),)
    toml = tmp_path / "c.toml"
    toml.write_text("[policy]\ninterference_profile = [[0.25, 1.5], [1.0, 2.0]]\n")
    assert load_config(toml, env={}).policy.interference_profile == ((0.25, 1.5), (1.0, 2.0))
    toml.write_text("[policy]\ninterference_profile = [[0.0, 1.5]]\n")
    with pytest.raises(ConfigError, match="policy.interference_profile"):
        load_config(toml, env={})
    assert PolicyConfig().interference_profile == ()  # off unless configured


# ---- the lookup -------------------------------------------------------------------------

points_st = st.lists(
    st.tuples(st.floats(0.01, 1.0), st.floats(1.0, 10.0), st.floats(1.0, 10.0), st.floats(0.0, 1.0)),
    min_size=1,
    max_size=6,
    unique_by=lambda t: round(t[0], 6),
).map(lambda xs: tuple(ProfilePoint(round(s, 6), p, m, f) for s, p, m, f in sorted(xs)))


@FAST
@given(points_st, st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_lookup_is_monotone_between_points_and_held_outside(points, x, y):
    prof = InterferenceProfile("t", "t", points)
    shares = [p.share for p in points]
    for col, at_zero in (("serving_p99_ratio", 1.0), ("serving_mean_ratio", 1.0), ("rollout_fraction", 0.0)):
        look = getattr(prof, col)
        assert float(look(0.0)) == at_zero
        vals = [getattr(p, col) for p in points]
        assert float(look(shares[0] * (0.01 + 0.99 * x))) == pytest.approx(vals[0])  # below: the first
        assert float(look(shares[-1] + (1 - shares[-1]) * y)) == pytest.approx(vals[-1])  # above: the last
        for (s0, v0), (s1, v1) in zip(zip(shares, vals), zip(shares[1:], vals[1:])):
            a, b = sorted((s0 + (s1 - s0) * x, s0 + (s1 - s0) * y))
            va, vb = float(look(a)), float(look(b))
            assert min(v0, v1) - 1e-9 <= va <= max(v0, v1) + 1e-9  # no overshoot
            assert (vb - va) * (v1 - v0) >= -1e-9  # moves the segment's way only
    pairs = tuple((p.share, p.serving_p99_ratio) for p in points)
    for s in (0.0, x, y):  # the policy's copy of the lookup agrees
        assert profile_ratio(pairs, s) == pytest.approx(float(prof.serving_p99_ratio(s)))


# ---- serving's step times ---------------------------------------------------------------


@pytest.mark.parametrize("mean,p99", [(1.11, 1.63), (1.381, 2.424), (1.7076, 1.7044), (1.0, 1.0), (1.004, 1.8), (5, 5)])
def test_step_multiplier_draws_reproduce_the_mean_and_p99(mean, p99):
    x = StepMultiplier(mean, p99).sample(400_000, np.random.default_rng(0))
    assert float(x.mean()) == pytest.approx(mean, rel=0.03)
    assert float(np.quantile(x, 0.99, method="inverted_cdf")) == pytest.approx(p99, rel=0.03)


def _decode_window(profile: InterferenceProfile, share: float) -> tuple[float, float]:
    """One 0.5 s window of a GPU decoding 32 long requests (no arrivals), with rollout at `share`:
    (tokens decoded, TPOT p99 ms)."""
    sim = ServingSim(gpu_spec("H100"), model_size("7B"), 1, profile=profile)
    sim.N[:], sim.R[:], sim.C[:] = 32.0, 32.0 * 1e9, 32.0 * 2000.0  # outputs so long none ends
    sim.set_rollout(0, share, share > 0, 0)
    before = float(sim.R[0])
    st_ = sim.advance(0.5)
    return before - float(sim.R[0]), float(st_.tpot_p99_ms[0])


@pytest.mark.parametrize("share", [0.1, 0.3, 0.5, 0.8, 1.0])
def test_serving_step_times_match_the_profile_points(share):
    """The serving model's steps beside rollout: the mean step (tokens decoded in a window) and
    the p99 step (the window's TPOT p99) over alone are the profile's ratios, within 3 %."""
    prof = default_profile()
    alone_tok, alone_p99 = _decode_window(prof, 0.0)
    tok, p99 = _decode_window(prof, share)
    assert alone_tok / tok == pytest.approx(float(prof.serving_mean_ratio(share)), rel=0.03)
    assert p99 / alone_p99 == pytest.approx(float(prof.serving_p99_ratio(share)), rel=0.03)


@FAST
@given(points_st, st.floats(0.01, 1.0))
def test_gpu_time_is_conserved(points, share):
    """On one GPU: serving's work (tokens decoded over alone) plus rollout's (episodes over its
    solo rate) never exceed what the profile says one GPU does at that share."""
    prof = InterferenceProfile("t", "t", points)
    alone_tok, _ = _decode_window(prof, 0.0)
    tok, _ = _decode_window(prof, share)
    from rose.sim.models import EpisodeModel
    from rose.sim.rollout_model import RolloutModel
    from rose.sim.runs import RunContext

    probe = ServingSim(gpu_spec("H100"), model_size("7B"), 1)
    ro = RolloutModel(probe, EpisodeModel(), probe.engine.runtime_reserve_bytes)
    slo = Latency(1.0, 1.0)
    ctx = RunContext(
        1, 1, EpisodeModel(), PolicyConfig(), probe.gpu, ro, slo, 0.5, 1, 1, 0, 1.0, 1.0, 1.0, 0.01, profile=prof
    )
    mem = probe.gpu.mem_bytes // 2
    rollout_work = float(ctx.rollout_rate(mem, share)) / float(ro.rate(mem))
    bound = 1.0 / float(prof.serving_mean_ratio(share)) + float(prof.rollout_fraction(share))
    assert tok / alone_tok + rollout_work <= bound * (1 + 1e-6)


# ---- the policy's prior -----------------------------------------------------------------


def test_policy_prior_never_grants_a_share_predicted_beyond_the_threshold():
    cfg = PolicyConfig(interference_profile=((0.25, 2.0), (0.5, 3.0)))
    assert compute_share_for(0.3, 0.0, PolicyConfig()) > 0  # without a profile: the online estimate alone
    assert compute_share_for(0.3, 0.0, cfg) == 0.25  # 0.3 × 3 > 0.7, 0.3 × 2 <= 0.7
    assert compute_share_for(0.4, 0.0, cfg) == 0.0  # 0.4 × 2 > 0.7: no grant
    assert compute_share_for(0.1, 0.0, cfg) == 0.5


# ---- what a profile does to a run -------------------------------------------------------


def _run(
    traces_dir,
    profile: InterferenceProfile,
    duration: float = 300,
    policies: tuple[str, ...] = ("static", "share-all", "rose"),
) -> dict:
    tr = load_trace(traces_dir / "azure_llm2023_conv.csv")
    cfg = SimConfig(
        n_gpus=16,
        dedicated=2,
        duration_s=duration,
        record_series=False,
        policies=policies,
        interference=profile,
        check_invariants=True,
    )
    return simulate(tr, cfg)


def test_no_rollout_progress_means_no_harvest(traces_dir):
    """Rollout beside serving makes no progress: nothing is harvested beside serving; `rose`
    harvests only on whole replicas it lends, which the profile does not touch."""
    r = _run(traces_dir, flat(1.2, 1.1, 0.0), policies=("static", "share-all", "rose-coresident", "rose"))
    for p in ("share-all", "rose-coresident"):
        assert r["policies"][p]["harvest_per_serving_gpu"] == 0.0
        assert r["policies"][p]["gain_vs_static"] == 1.0
    rose = r["policies"]["rose"]
    assert rose["harvest_per_serving_gpu"] == 0.0 or rose["replica_lease_hours"] > 0
    # share-all's workers decode once their start (a wake-up) is done; static never rolls out on serving
    start = r["config"]["costs"]["lease_start_s"]
    assert start > 0 and r["policies"]["share-all"]["lease_start_s"] == pytest.approx(start, abs=1e-3)
    assert r["policies"]["static"]["lease_start_s"] is None


def test_five_times_slower_serving_rose_keeps_the_slo_share_all_does_not(traces_dir):
    """Serving 5× slower beside rollout at every share: ROSE's prior grants almost nothing and
    its guard pauses what was granted (the first grants, on GPUs idle while the fleet starts,
    cost a few windows: hence ten minutes), share-all runs serving out of its SLO."""
    r = _run(traces_dir, flat(5.0, 5.0, 0.5), duration=600)
    pol = r["policies"]
    assert pol["rose"]["slo_attainment"] >= pol["static"]["slo_attainment"] - 0.002
    assert pol["share-all"]["slo_attainment"] < pol["static"]["slo_attainment"] - 0.002
    assert r["rose_vs_share_all"]["slo_difference"] > 0 and r["interference_profile"]["source"] == "test"


def test_the_grant_prediction_error_is_realized_minus_predicted_by_nearest_rank():
    """`grant_prediction`: the load a co-resident lease's first window showed minus what the
    grant rule predicted, over every start and over those predicted within 0.3 of the limit."""
    from rose.sim.rose_run import grant_prediction

    pairs = [(0.1, 0.15), (0.2, 0.1), (0.5, 0.6), (0.65, 0.95)]  # (predicted, realized)
    g = grant_prediction(pairs, grant_headroom=0.3)  # limit 0.7: near it from 0.4
    assert g["all"] == {
        "n": 4,
        "q50": pytest.approx(0.05),
        "q90": pytest.approx(0.3),
        "q99": pytest.approx(0.3),
        "max": pytest.approx(0.3),
    }
    assert g["near_limit"]["n"] == 2 and g["near_limit"]["q50"] == pytest.approx(0.1)
    assert grant_prediction([], 0.3)["all"] == {"n": 0, "q50": None, "q90": None, "q99": None, "max": None}
