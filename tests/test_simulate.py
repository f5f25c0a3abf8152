"""`rose simulate`: every trace format feeds it, its invariants hold every window, it is
deterministic, the deferred policy calls are exact, and the done-when claim through the CLI."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rose.config import PolicyConfig
from rose.contract.events import Latency, Telemetry
from rose.policy.lease_policy import GpuView, decide
from rose.sim.simulate import (POLICIES, SLO_TOLERANCE, EpisodeModel, Ledger, SimConfig, calibration,
                           simulate)
from rose.sim.traces import load_trace

TRACES = ["azure_llm2023_code.csv", "azure_llm2023_conv.csv", "burstgpt1_first400.csv",
          "burstgpt3_first400.csv", "mooncake_fast25_synthetic.jsonl"]


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


def test_revoke_mid_episode_parks_work_and_resumes_it_once():
    ep = EpisodeModel(turns=8)
    led = Ledger(ep)
    lease = np.zeros(1)
    pool = np.zeros(1)
    led.progress(lease, np.array([4.0]), np.array([5.5]))  # 8 episodes in flight, 1.5 past the fill
    assert led.completed == 1 and lease[0] == pytest.approx(4.5)
    led.park(lease, np.array([8]))  # revoke: each of the 8 episodes loses half a turn = 1/16
    assert lease[0] == 0.0
    assert led.recomputed == pytest.approx(8 / 16) and led.parked == pytest.approx(4.0)
    pool[0] += led.unpark()  # the dedicated pool resumes the continuations
    assert led.parked == 0.0 and pool[0] == pytest.approx(4.0)
    led.progress(pool, np.array([4.0]), np.array([3.0]))
    assert led.completed == 1 + 3  # resumed work counts once: 4 + 3 - fill 4 = 3 more episodes
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


_SLO = Latency(1000.0, 100.0)


@settings(max_examples=60, deadline=None)
@given(
    events=st.lists(st.tuples(st.floats(0.31, 3.0), st.floats(0.0, 3.0), st.integers(20, 70),
                              st.floats(0.0, 1.0)), min_size=1, max_size=8),
    cooldown=st.floats(0.0, 50.0), revokes=st.integers(0, 4), epoch=st.integers(0, 5),
    prev=st.one_of(st.none(), st.tuples(st.floats(1.0, 900.0), st.floats(1.0, 90.0), st.integers(20, 70))),
    expired_lease=st.booleans(),
)
def test_deferred_policy_calls_are_exact(events, cooldown, revokes, epoch, prev, expired_lease):
    """The simulator's shortcut: for a GPU without a lease, a run of events whose headroom is below
    the grant threshold leaves `decide` exactly where its last two events alone leave it."""
    cfg = PolicyConfig()
    view = GpuView("sim/0", epoch=epoch, cooldown_until=cooldown, revokes_in_row=revokes)
    if prev is not None:
        view = GpuView("sim/0", last_ts=1.0, last_event_id="x", streak=2, epoch=epoch, cooldown_until=cooldown,
                       revokes_in_row=revokes, prev_ttft_p99=prev[0], prev_tpot_p99=prev[1],
                       prev_serving_mem=prev[2] << 30,
                       **({"lease_id": f"sim/0#{epoch}", "lease_expires_at": 1.5, "lease_mem_bytes": 4 << 30}
                          if expired_lease else {}))
    evs = []
    for i, (ratio, other, used_gib, util) in enumerate(events):  # ratio > 0.3: below grant headroom
        ttft = 1000.0 * min(ratio, 0.99) if i % 2 else 1000.0 * other / 3
        tpot = 100.0 * other / 3 if i % 2 else 100.0 * min(ratio, 0.99)
        if 1.0 - max(ttft / 1000.0, tpot / 100.0) >= cfg.grant_headroom:
            tpot = 100.0 * 0.8
        evs.append(Telemetry(f"e{i}", 2.0 + 0.5 * i, "n", "sim/0", "serving", util, 80 << 30, used_gib << 30, 0,
                             Latency(ttft, tpot), _SLO, 1.0, 0))
    folded = view
    for e in evs:
        folded = decide(folded, e, cfg).view
    last_two = view
    for e in evs[-2:]:
        last_two = decide(last_two, e, cfg).view
    assert last_two == folded


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
    p = _rose("simulate", "--trace", str(traces_dir / "azure_llm2023_code.csv"), "--gpus", "64", "--policy", "all",
              "--duration", "600", "--json", "--report", str(tmp_path / "rep"))
    assert p.returncode == 0, p.stderr
    out = orjson.loads(p.stdout)
    pol = out["policies"]
    assert list(pol) == ["static", "elastic", "share-all", "rose"]
    for res in pol.values():
        for key in ("episodes_per_hour", "rl_steps_per_hour", "gain_vs_static", "slo_attainment", "revokes",
                    "weight_sync_bytes"):
            assert key in res
    assert pol["rose"]["slo_attainment"] >= pol["static"]["slo_attainment"] - SLO_TOLERANCE
    assert pol["share-all"]["slo_attainment"] < pol["static"]["slo_attainment"] - SLO_TOLERANCE
    assert pol["rose"]["revokes"] > 0 and out["wall_s"] > 0 and "series" not in out
    rep = tmp_path / "rep"
    for f in ("report.json", "report.md", "serving_p99_vs_slo.png", "throughput.png", "leased_gpus.png"):
        assert (rep / f).stat().st_size > 0, f
    assert "| rose |" in (rep / "report.md").read_text()


@pytest.mark.parametrize("args,msg", [
    (["--policy", "fastest"], "--policy"),
    (["--gpus", "0"], "--gpus"),
    (["--model-size", "3B"], "unknown model size"),
    (["--load", "2"], "--load"),
])
def test_cli_bad_input_is_one_line(traces_dir, args, msg):
    p = _rose("simulate", "--trace", str(traces_dir / "burstgpt1_first400.csv"), "--duration", "10", *args)
    assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_cli_bad_trace(tmp_path):
    bad = tmp_path / "t.csv"
    bad.write_text("a,b\n1,2\n")
    p = _rose("simulate", "--trace", str(bad))
    assert p.returncode == 2 and "--trace" in p.stderr and "Traceback" not in p.stderr
