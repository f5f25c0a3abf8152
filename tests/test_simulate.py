"""`rose simulate`: every trace format feeds it, its invariants hold every window, it is
deterministic, and the done-when claim through the CLI. (The exactness of its deferred policy
calls is tested beside the policy, tests/test_lease_policy.py.)"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import orjson
import pytest

from rose.sim.engine import POLICIES, SimConfig, calibration, simulate
from rose.sim.ledger import Ledger
from rose.sim.models import EpisodeModel
from rose.sim.report import SLO_TOLERANCE
from rose.sim.traces import load_trace

TRACES = [
    "azure_llm2023_code.csv",
    "azure_llm2023_conv.csv",
    "burstgpt1_first400.csv",
    "burstgpt3_first400.csv",
    "mooncake_fast25_synthetic.jsonl",
]


@pytest.mark.parametrize("name", TRACES)
def test_every_trace_format_feeds_every_policy(traces_dir, name):
    tr = load_trace(traces_dir / name)
    r = simulate(tr, SimConfig(n_gpus=4, duration_s=90, check_invariants=True, record_series=False))
    assert set(r["policies"]) == set(POLICIES)
    assert r["config"]["trace_format"] == tr.fmt and r["config"]["rps_per_gpu"] > 0
    for p, res in r["policies"].items():
        assert 0.0 <= res["slo_attainment"] <= 1.0, p
        assert res["episodes"] >= 0 and res["weight_sync_bytes"] > 0, p
    assert r["policies"]["static"]["episodes"] > 0
    assert r["policies"]["static"]["gain_vs_static"] == 1.0


@pytest.mark.parametrize("model", ["7B", "70B"])
def test_invariants_hold_every_window(traces_dir, model):
    """check_invariants asserts, after every window: memory used ≤ total, no negative serving
    state or work, leases within max_compute_share and within the free memory (after margin) of
    the telemetry that granted them, and produced = completed + in flight + parked + recomputed."""
    tr = load_trace(traces_dir / "azure_llm2023_code.csv")
    r = simulate(tr, SimConfig(n_gpus=12, model=model, duration_s=400, check_invariants=True, record_series=False))
    for p, res in r["policies"].items():
        w = res["work"]
        assert w["completed"] == w["consumed"] + w["buffered"], p
        assert w["produced"] == pytest.approx(w["completed"] + w["in_flight"] + w["parked"] + w["recomputed"]), p
        assert res["min_free_mem_bytes"] >= 0, p
    rose = r["policies"]["rose"]
    if model == "7B":
        assert rose["grants"] > 0 and rose["revokes"] > 0  # the run exercised revokes mid-episode
    else:  # TP 2: gang leases of two GPUs (check_invariants: all or none, every window)
        assert r["fleet"]["tensor_parallel"] == r["fleet"]["lease_group_size"] == 2
        assert rose["grants"] > 0 and rose["grants"] % 2 == 0


def test_revoke_mid_episode_parks_work_and_resumes_it_once():
    ep = EpisodeModel(turns=8)
    led = Ledger(ep)
    lease = np.zeros(1)
    pool = np.zeros(1)
    led.progress(lease, np.array([4.0]), np.array([5.5]))  # 8 episodes in flight, 1.5 past the fill
    assert led.completed == 1 and lease[0] == pytest.approx(4.5)
    led.park(lease, np.array([8]))  # revoke: each of the 8 episodes loses one decode step
    assert lease[0] == 0.0
    one_step = 1 / (ep.turns * ep.gen_tokens)  # of an episode's generated tokens
    assert led.recomputed == pytest.approx(8 * one_step) and led.parked == pytest.approx(4.5 - 8 * one_step)
    pool[0] += led.unpark()  # the dedicated pool resumes the continuations
    assert led.parked == 0.0 and pool[0] == pytest.approx(4.5 - 8 * one_step)
    led.progress(pool, np.array([4.0]), np.array([3.0]))
    assert led.completed == 1 + 3  # resumed work counts once: 4.47 + 3 - fill 4 = 3 more episodes
    assert led.produced == pytest.approx(led.completed + pool.sum() + led.parked + led.recomputed)


def test_deterministic_for_a_seed(traces_dir):
    tr = load_trace(traces_dir / "azure_llm2023_conv.csv")
    cfg = SimConfig(n_gpus=6, duration_s=120, seed=7)
    a, b = simulate(tr, cfg), simulate(tr, cfg)
    a.pop("wall_s"), b.pop("wall_s")
    assert orjson.dumps(a) == orjson.dumps(b)
    c = simulate(tr, SimConfig(n_gpus=6, duration_s=120, seed=8))
    c.pop("wall_s")
    assert orjson.dumps(a) != orjson.dumps(c)


def test_calibration_from_bench_results():
    c = calibration({"unprotected_p99_over_alone": 1.8, "device": "cuda"}, {"bytes_ratio_per_step": 0.02})
    assert c["alpha"] == pytest.approx(0.8) and c["weight_delta_ratio"] == 0.02
    assert "cuda" in c["alpha_source"]
    with pytest.raises(ValueError, match="unprotected_p99_over_alone"):
        calibration({"p99": 3}, None)
    with pytest.raises(ValueError, match="bytes_ratio_per_step"):
        calibration(None, {"bytes_ratio_per_step": 2.0})


def _rose(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rose", *args], capture_output=True, text=True, timeout=300)


def test_done_when_cli_all_policies_rose_keeps_slo_share_all_does_not(traces_dir, tmp_path):
    p = _rose(
        "simulate",
        "--trace",
        str(traces_dir / "azure_llm2023_code.csv"),
        "--gpus",
        "64",
        "--policy",
        "all",
        "--duration",
        "600",
        "--json",
        "--report",
        str(tmp_path / "rep"),
    )
    assert p.returncode == 0, p.stderr
    out = orjson.loads(p.stdout)
    pol = out["policies"]
    assert list(pol) == ["static", "elastic", "share-all", "rose"]
    for res in pol.values():
        for key in (
            "episodes_per_hour",
            "rl_steps_per_hour",
            "gain_vs_static",
            "slo_attainment",
            "revokes",
            "weight_sync_bytes",
        ):
            assert key in res
    assert pol["rose"]["slo_attainment"] >= pol["static"]["slo_attainment"] - SLO_TOLERANCE
    assert pol["share-all"]["slo_attainment"] < pol["static"]["slo_attainment"] - SLO_TOLERANCE
    assert pol["rose"]["revokes"] > 0 and out["wall_s"] > 0 and "series" not in out
    rep = tmp_path / "rep"
    for f in ("report.json", "report.md", "serving_p99_vs_slo.png", "throughput.png", "leased_gpus.png"):
        assert (rep / f).stat().st_size > 0, f
    assert "| rose |" in (rep / "report.md").read_text()


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--policy", "fastest"], "--policy"),
        (["--gpus", "0"], "--gpus"),
        (["--model-size", "3B"], "unknown model size"),
        (["--load", "2"], "--load"),
    ],
)
def test_cli_bad_input_is_one_line(traces_dir, args, msg):
    p = _rose("simulate", "--trace", str(traces_dir / "burstgpt1_first400.csv"), "--duration", "10", *args)
    assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_cli_bad_trace(tmp_path):
    bad = tmp_path / "t.csv"
    bad.write_text("a,b\n1,2\n")
    p = _rose("simulate", "--trace", str(bad))
    assert p.returncode == 2 and "--trace" in p.stderr and "Traceback" not in p.stderr
