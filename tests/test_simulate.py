"""`rose simulate`: every trace format feeds it, its invariants hold every window, it is
deterministic, and the done-when claim through the CLI. (The exactness of its deferred policy
calls is tested beside the policy, tests/test_lease_policy.py.)"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import orjson
import pytest

from rose.config import GiB
from rose.obs.stats import t_975
from rose.sim.engine import POLICIES, SimConfig, _Forked, auto_workers, calibration, simulate, simulate_seeds
from rose.sim.ledger import Ledger
from rose.sim.models import GPUS, MODELS, EpisodeModel, deployed
from rose.sim.report import SLO_TOLERANCE, markdown, validity
from rose.sim.requests import capacity_bound, kv_costs_s, request_costs_s, roofline_costs_s
from rose.sim.rollout_model import RolloutModel
from rose.sim.serving_model import ServingSim
from rose.sim.traces import Trace, load_trace
from tests.conftest import REPO

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


@pytest.mark.parametrize("model,gpus,rollout_tp", [("7B", 12, 0), ("70B", 12, 0), ("70B", 16, 8)])
def test_invariants_hold_every_window(traces_dir, model, gpus, rollout_tp):
    """check_invariants asserts, after every window: memory used ≤ total, no negative serving
    state or work, leases within max_compute_share and within the free memory (after margin) of
    the telemetry that granted them, and produced = completed + in flight + parked + recomputed."""
    tr = load_trace(traces_dir / "azure_llm2023_code.csv")
    cfg = SimConfig(
        n_gpus=gpus, model=model, rollout_tp=rollout_tp, duration_s=400, check_invariants=True, record_series=False
    )
    r = simulate(tr, cfg)
    for p, res in r["policies"].items():
        w = res["work"]
        assert w["completed"] == w["consumed"] + w["buffered"], p
        assert w["produced"] == pytest.approx(w["completed"] + w["in_flight"] + w["parked"] + w["recomputed"]), p
        assert res["min_free_mem_bytes"] >= 0, p
    rose, fleet = r["policies"]["rose"], r["fleet"]
    if model == "7B":
        assert fleet["tensor_parallel"] == fleet["lease_group_size"] == 1
        assert rose["grants"] > 0 and rose["revokes"] > 0  # the run exercised revokes mid-episode
    else:  # served over TP 4 replicas; rollout on gang leases of its own TP (check_invariants: all or none)
        assert fleet["tensor_parallel"] == 4
        assert fleet["rollout_tensor_parallel"] == fleet["lease_group_size"] == (rollout_tp or 4)
        assert rose["grants"] % fleet["lease_group_size"] == 0
        assert rollout_tp == 0 or rose["grants"] > 0  # a quarter of the 70B beside serving's quarter rarely fits
    assert rose["leases_unusable"] == 0  # no grant is smaller than what the rollout worker needs


def test_rollout_batch_holds_current_context_not_maximum():
    """Paged KV: an episode holds its current context, so a replica fits B episodes when B - 1
    sit at the mean context and one at its end; more than reserving the maximum for each."""
    gpu = GPUS["H100"]
    sim = ServingSim(gpu, MODELS["7B"])
    ep = EpisodeModel(batch=10_000)  # no cap on the batch
    ro = RolloutModel(sim, ep, 2 * GiB)
    assert ro.kv_episode == ep.ctx_mean * sim.kv and ep.ctx_mean < ep.ctx_max
    for b in (1, 5, 40):
        mem = ro.weights + ro.reserve + (b - 1) * ep.ctx_mean * sim.kv + ep.ctx_max * sim.kv
        assert ro.replica_batch(mem) == b and ro.replica_batch(mem - 1) == b - 1
    mem = 30 * GiB
    assert ro.replica_batch(mem) > (mem - ro.weights - ro.reserve) // (ep.ctx_max * sim.kv)
    assert ro.replica_batch(ro.weights + ro.reserve + ep.ctx_max * sim.kv - 1) == 0  # too small for one
    assert ro.replica_batch(ro.min_lease_bytes) == 1 and ro.replica_batch(ro.min_lease_bytes - 1) == 0


def test_rollout_tp_differs_from_serving_tp():
    """The RL policy sharded over 8 GPUs beside a 70B served over TP 4: an eighth of the weights
    per GPU, and per-GPU batch and rate are the replica's over 8."""
    gpu = GPUS["H100"]
    m = deployed(MODELS["70B"], gpu)
    sim = ServingSim(gpu, m, m.tp)
    four, eight = RolloutModel(sim, EpisodeModel(), 2 * GiB), RolloutModel(sim, EpisodeModel(), 2 * GiB, tp=8)
    assert (four.tp, eight.tp) == (4, 8) and eight.weights == m.weight_bytes // 8
    mem = 35 * GiB  # a lease: too small beside a quarter of the weights, enough beside an eighth
    assert four.batch_for(mem) == 0 < eight.batch_for(mem) == eight.replica_batch(mem) / 8
    b = eight.replica_batch(mem)  # a memory-bound lease: its contexts overflow the KV room at times
    p = float(eight.overflow(mem, b))
    assert 0.01 < p < 0.99
    dur = eight.dur_by_batch[b]  # each turn pays the recompute it expects: p × one context's re-prefill
    slow = dur / (dur + eight.ep.turns * p * eight.refill_s)
    assert eight.rate(mem) == pytest.approx(eight.rate_by_batch[b] * slow) and slow < 1.0
    assert float(eight.overflow(GPUS["H100"].mem_bytes, 8)) < 1e-6  # 8 episodes on a whole GPU: no recompute
    assert eight.rate_by_batch[8] == pytest.approx(eight._rate(8) / 8)


def _synthetic(prompt: int, output: int, n: int = 400, span: float = 600.0) -> Trace:
    return Trace(
        "synthetic", "azure", np.linspace(0.0, span, n), np.full(n, prompt, np.int32), np.full(n, output, np.int32)
    )


def test_long_context_trace_is_provisioned_by_kv_memory():
    """A GPU's request rate is set by the roofline or by KV memory, whichever binds first: a
    long-context trace is not provisioned beyond what the KV cache holds (Little's law)."""
    gpu = GPUS["H100"]
    m = deployed(MODELS["70B"], gpu)
    sim = ServingSim(gpu, m, m.tp)
    long, short = _synthetic(100_000, 4000), _synthetic(2000, 200)
    assert capacity_bound(sim, long.prompt_tokens, long.output_tokens) == "kv"
    assert capacity_bound(sim, short.prompt_tokens, short.output_tokens) == "roofline"
    prompt, out = long.prompt_tokens.astype(float), long.output_tokens.astype(float)
    cost = request_costs_s(sim, prompt, out).mean()  # GPU-seconds: a replica's seconds for its 4 GPUs
    assert cost == pytest.approx(m.tp * kv_costs_s(sim, prompt, out).mean())
    assert cost > m.tp * roofline_costs_s(sim, prompt, out).mean()
    # at the full rate (load 1) a replica's decoding requests hold exactly its KV capacity
    rate = m.tp / cost  # requests/s of a replica
    tokens_steps = (out * (prompt + out / 2)).mean()  # context held per request, summed over its steps
    cap = sim.kv_capacity_tokens()
    step = sim.step_time(cap * out.mean() / tokens_steps, cap)[0]
    assert rate * tokens_steps * step == pytest.approx(cap[0])  # Little's law
    r = simulate(long, SimConfig(n_gpus=8, model="70B", duration_s=120, check_invariants=True, record_series=False))
    assert r["config"]["capacity_bound"] == "kv" and r["fleet"]["tensor_parallel"] == 4


def test_run_with_an_overloaded_static_baseline_is_flagged_invalid(traces_dir):
    assert validity({"static": {"slo_attainment": 0.97}}) == {"valid": True}
    bad = validity({"static": {"slo_attainment": 0.9}, "rose": {"slo_attainment": 0.92}})
    assert bad["valid"] is False and "0.90000 < 0.95" in bad["invalid_reason"]
    assert validity({"rose": {"slo_attainment": 1.0}})["valid"] is None
    # the code trace's busiest minutes at the full roofline (load 1) overload serving alone
    tr = load_trace(traces_dir / "azure_llm2023_code.csv")
    r = simulate(tr, SimConfig(n_gpus=4, duration_s=300, load=1.0, policies=("static", "rose"), record_series=False))
    assert r["policies"]["static"]["slo_attainment"] < 0.95
    assert r["valid"] is False and "serving is overloaded" in r["invalid_reason"]
    r["wall_s"] = 0.0
    assert "Not a valid comparison: static baseline SLO attainment" in markdown(r)


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


def test_training_bounds_throughput_when_it_is_slower_than_rollout():
    """The trainer consumes completed episodes at most at episodes_per_step / train_step_s a
    second, beside rollout; a free trainer takes everything; the step time is 6 N × tokens over
    the trainer's GPUs at the MFU."""
    from rose.sim.models import TRAIN_MFU, train_step_s

    ep = EpisodeModel()
    gpu, m = GPUS["H100"], MODELS["8B"]
    assert train_step_s(m, ep, gpu, 8) == pytest.approx(
        6 * m.flop_params * ep.episodes_per_step * ep.ctx_max / (8 * gpu.bf16_flops * TRAIN_MFU)
    )
    assert train_step_s(m, ep, gpu, 16) == pytest.approx(train_step_s(m, ep, gpu, 8) / 2)
    slow, free = Ledger(ep, train_step_s=ep.episodes_per_step / 2.0), Ledger(ep)  # 2 episodes/s
    for led in (slow, free):
        w = np.zeros(1)
        for _ in range(100):  # rollout completes 10 episodes/s for 100 s
            led.progress(w, np.array([0.0]), np.array([10.0]))
            led.train(1.0)
    assert free.trained == free.completed == 1000 and free.steps() == 1000 // ep.episodes_per_step
    assert slow.trained == pytest.approx(200.0) and slow.completed == 1000 and slow.steps() == 0


def test_a_revoke_charges_the_re_prefill_of_every_continuation():
    """The worker that resumes a continuation re-prefills its context: `reprefill_units` of work
    per episode carried (the batch, or 2 w while the pipeline fills), never more than the slot held."""
    ep = EpisodeModel(turns=8)
    led = Ledger(ep, reprefill_units=0.1)
    one_step = 1 / (ep.turns * ep.gen_tokens)
    lease = np.array([4.5, 1.0])
    led.park(lease, np.array([8, 8]))  # a full pipeline: 8 episodes; a filling one: 2 × 1.0 = 2
    lost = 8 * one_step + 8 * 0.1 + 8 * one_step + 2 * 0.1
    assert led.recomputed == pytest.approx(lost) and led.parked == pytest.approx(5.5 - lost)
    tiny = Ledger(ep, reprefill_units=10.0)
    w = np.array([0.3])
    tiny.park(w, np.array([8]))
    assert tiny.recomputed == pytest.approx(0.3) and tiny.parked == 0.0


def test_deterministic_for_a_seed(traces_dir):
    tr = load_trace(traces_dir / "azure_llm2023_conv.csv")
    cfg = SimConfig(n_gpus=6, duration_s=120, seed=7)
    a, b = simulate(tr, cfg), simulate(tr, cfg)
    a.pop("wall_s"), b.pop("wall_s")
    assert orjson.dumps(a) == orjson.dumps(b)
    c = simulate(tr, SimConfig(n_gpus=6, duration_s=120, seed=8))
    c.pop("wall_s")
    assert orjson.dumps(a) != orjson.dumps(c)


def test_rose_in_a_second_process_gives_the_same_result(traces_dir):
    """`workers=2` runs ROSE in a forked child beside the other policies: the result is the one
    process's, byte for byte (series included), and large runs choose it by themselves."""
    tr = load_trace(traces_dir / "azure_llm2023_code.csv")
    cfg = SimConfig(n_gpus=8, duration_s=120, seed=2, rollout_tp=2, workers=1)
    one, two = simulate(tr, cfg), simulate(tr, replace(cfg, workers=2))
    one.pop("wall_s"), two.pop("wall_s")
    assert orjson.dumps(one) == orjson.dumps(two)
    assert two["policies"]["rose"]["decide_calls"] > 0 and list(two["series"]) == list(POLICIES)
    assert auto_workers(1000, 7200, POLICIES) == min(2, len(os.sched_getaffinity(0)))
    assert auto_workers(1000, 7200, ("rose",)) == auto_workers(64, 1200, POLICIES) == 1
    with pytest.raises(ValueError, match="workers"):
        simulate(tr, replace(cfg, workers=-1))


def test_the_second_process_hands_back_its_error():
    def boom():
        raise AssertionError("work ledger: produced 1 != 2")

    with pytest.raises(AssertionError, match="work ledger"):
        _Forked(boom).result()
    _Forked(lambda: time.sleep(30)).stop()  # returns at once


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
    """Under the pessimistic CPU-measured interference as the linear sweep (alpha 3.157): at
    alpha 0.3 share-all keeps this trace's SLO too (docs/paper-check.md)."""
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
        "--interference-alpha",
        "3.157",
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
    # ROSE takes compute back under interference: latency pauses (throttles) a lease, memory
    # revokes it; with the profile as the policy's prior its leases are paused, not revoked
    assert pol["rose"]["revokes"] + pol["rose"]["throttles"] > 0 and out["wall_s"] > 0 and "series" not in out
    assert out["interference_profile"] == {"source": "linear alpha=3.157 (sweep)", "mechanism": "linear"}
    for p in pol.values():
        assert {"slo_attainment", "gain_vs_static", "harvest_per_serving_gpu", "lease_start_s"} <= set(p)
    assert set(out["rose_vs_share_all"]) >= {"throughput_ratio", "throughput_ratio_ci95", "slo_difference"}
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
        (["--tp", "3"], "tensor parallel 3"),
        (["--model-size", "70B", "--gpus", "6"], "replicas of tp=4"),
        (["--model-size", "7B", "--rollout-tp", "8"], "does not split"),
        (["--lease-start-s", "-1"], "--lease-start-s"),
        (["--resume-s", "nan"], "--resume-s"),
        (["--elastic-provision-s", "-5"], "--elastic-provision-s"),
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


def test_interference_is_capped_at_the_time_slicing_bound():
    """1 + alpha × share, never above 1 / (1 - share): rollout holding a share of the GPU's
    time leaves serving the rest of it."""
    from rose.sim.models import gpu_spec, model_size
    from rose.sim.serving_model import ServingSim

    for alpha, share, want in ((0.3, 0.5, 1.15), (3.157, 0.5, 2.0), (3.157, 0.2, 1.25), (1.0, 0.3, 1.3)):
        sim = ServingSim(gpu_spec("H100"), model_size("7B"), 1, alpha=alpha)
        sim.set_rollout(0, share, True, 0)
        mean, p99 = sim.interference()
        assert float(mean[0]) == pytest.approx(want) and float(p99[0]) == pytest.approx(want), (alpha, share)
    sim.set_rollout(0, 1.0, True, 0)
    assert all(np.isfinite(r).all() for r in sim.interference())


def test_calibration_from_a_gpu_interference_result():
    c = calibration(
        {"alpha_per_share": 0.21, "unprotected_p99_over_alone": 3.0, "device": "cuda", "gpu_name": "H200"}, None
    )
    assert c["alpha"] == pytest.approx(0.21) and "H200" in c["alpha_source"]  # the fit, not the unprotected phase
    with pytest.raises(ValueError, match="alpha_per_share"):
        calibration({"alpha_per_share": -1}, None)


def test_gain_is_made_of_harvest_per_serving_gpu(traces_dir):
    """harvest_per_serving_gpu is the rollout work done on serving GPUs in dedicated-GPU
    equivalents per serving GPU, so gain ≈ 1 + (G / M) × harvest (the pipeline fill and work
    in flight at the end make the difference); policies without leases harvest nothing. The
    identity is of rollout: training is left free here (with the trainer on 2 GPUs it, not
    rollout, would bound every policy's throughput)."""
    tr = load_trace(traces_dir / "azure_llm2023_conv.csv")
    r = simulate(tr, SimConfig(n_gpus=16, dedicated=2, duration_s=900, record_series=False, train_step_s=0.0))
    pol, fleet = r["policies"], r["fleet"]
    assert fleet["serving_gpus"] == 16 and fleet["dedicated_gpus"] == 2
    assert pol["static"]["harvest_per_serving_gpu"] == pol["elastic"]["harvest_per_serving_gpu"] == 0.0
    for p in ("share-all", "rose"):
        h = pol[p]["harvest_per_serving_gpu"]
        assert h > 0 and pol[p]["gain_from_harvest"] == pytest.approx(1 + 8 * h, abs=1e-3)
        assert pol[p]["gain_vs_static"] == pytest.approx(pol[p]["gain_from_harvest"], rel=0.1), p


def test_elastic_cap_is_a_parameter(traces_dir):
    tr = load_trace(traces_dir / "azure_llm2023_code.csv")
    cfg = SimConfig(n_gpus=32, duration_s=900, policies=("elastic",), record_series=False)
    low = simulate(tr, cfg)["policies"]["elastic"]
    high = simulate(tr, replace(cfg, elastic_cap_frac=1.0))["policies"]["elastic"]
    assert (low["external_gpu_cap"], high["external_gpu_cap"]) == (1, 4)
    # more external GPUs complete more rollout; the trainer (on the dedicated pool's 4 GPUs) may
    # bound what either trains
    assert high["external_gpu_hours"] > low["external_gpu_hours"]
    assert high["rollout_episodes"] > low["rollout_episodes"] and high["episodes"] >= low["episodes"]


def test_seeds_give_means_with_student_t_intervals(traces_dir):
    tr = load_trace(traces_dir / "burstgpt1_first400.csv")
    cfg = SimConfig(n_gpus=6, duration_s=120, seed=3, record_series=False)
    r = simulate_seeds(tr, cfg, 3)
    assert r["config"]["seeds"] == [3, 4, 5] and len(r["per_seed"]) == 3
    rose = r["policies"]["rose"]
    per = [s["policies"]["rose"]["slo_attainment"] for s in r["per_seed"]]
    assert rose["slo_attainment"] == pytest.approx(sum(per) / 3, abs=1e-6)
    lo, hi = rose["ci95"]["slo_attainment"]
    assert lo <= rose["slo_attainment"] <= hi
    half = t_975(2) * statistics.stdev(per) / 3**0.5
    assert hi - lo == pytest.approx(2 * half, abs=2e-6)
    assert r["policies"]["static"]["ci95"]["gain_vs_static"] == [1.0, 1.0]  # static is its own baseline
    one = simulate_seeds(tr, cfg, 1)
    assert "per_seed" not in one and one["config"]["seed"] == 3


def test_cli_seeds_and_harvest(traces_dir):
    p = _rose(
        "simulate", "--trace", str(traces_dir / "burstgpt1_first400.csv"), "--gpus", "4", "--duration", "60",
        "--seeds", "2",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "±" in p.stdout and "1 + (G/M) × harvest" in p.stdout
    bad = _rose("simulate", "--trace", str(traces_dir / "burstgpt1_first400.csv"), "--seeds", "0")
    assert bad.returncode == 2 and "--seeds" in bad.stderr


def test_paper_check_writes_targets_sweeps_and_the_doc_block(traces_dir, tmp_path):
    """A small paper check through the CLI: every table, a pass/miss per target with what holds a
    miss back, and --doc rewrites only the generated block of a document."""
    from rose.sim.paper_tables import BEGIN, END

    doc = tmp_path / "doc.md"
    doc.write_text(f"# Title\n\nBefore.\n\n{BEGIN}\nOLD-BLOCK\n{END}\n\nAfter.\n")
    p = _rose(
        "paper-check", "--traces", str(traces_dir), "--trace-names", "burstgpt1_first400.csv,azure_llm2023_conv.csv",
        "--gpus", "4", "--gm", "2", "--duration", "60", "--seeds", "2", "--models", "7B,7B@H200/tp2",
        "--alphas", "0.1,1.0", "--gm-sweep", "1,2", "--elastic-caps", "0.25,1.0",
        "--doc", str(doc), "--json", str(tmp_path / "pc.json"),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    text = doc.read_text()
    assert text.startswith("# Title\n\nBefore.\n\n" + BEGIN) and text.endswith(END + "\n\nAfter.\n")
    assert "OLD-BLOCK" not in text
    for heading in (
        "### Targets",
        "### Every policy",
        "### Interference",
        "### What the gain is made of",
        "### The elastic",
        "### Both lease kinds and share-all's work (R1, R2)",
    ):
        assert heading in text, heading
    # the main runs on the measured default profile; the sweep: each measured mechanism, then the
    # linear model's alphas as labelled rows
    # the default profile: one mechanism's runs (8B real decode steps), no other mechanism in its file
    assert (
        "Interference profile: `separate_process` (measured), source: rose.bench.interference_profile on NVIDIA H200"
        in text
    )
    assert "| separate_process (measured, main runs) |" in text and "| same_process_priority (measured) |" not in text
    assert "| linear alpha 3.157 (model, not measured) |" in text
    assert "| linear alpha 0.1 (model, not measured) |" in text
    gpu_alpha = orjson.loads((REPO / "docs" / "measured" / "h200" / "interference.json").read_bytes())
    assert f"| linear alpha {round(gpu_alpha['alpha_per_share'], 4):g} (model, not measured) |" in text
    assert "a GPU bench's fit, NVIDIA H200" in text
    assert "| azure_llm2023_conv | 7B@H200/tp2 |" in text  # a model cell on another GPU, at its own tp
    rec = orjson.loads((tmp_path / "pc.json").read_bytes())
    kinds = {r["kind"] for r in rec["runs"]}
    assert kinds == {"main", "profile", "gm", "cap", "provision"}
    assert "### The elastic baseline's provisioning delay (an assumption)" in text
    assert "| 60 s | 180 s | 600 s |" in text
    assert {r["result"]["interference_profile"]["mechanism"] for r in rec["runs"] if r["kind"] != "profile"} == {
        "separate_process"
    }
    assert sum(r["kind"] == "main" for r in rec["runs"]) == 2 * 2 * 2  # traces × model cells × seeds
    cells = {(r["model"], r["result"]["fleet"]["gpu"], r["result"]["fleet"]["tensor_parallel"]) for r in rec["runs"]}
    assert cells == {("7B", "H100", 1), ("7B@H200/tp2", "H200", 2)}
    t = rec["targets"]
    assert {r["target"] for r in t} >= {"ROSE ≥ 1.5× static", "SLO ROSE ≥ static − 0.002", "SLO static ≥ 0.95"}
    assert all(r["met"] or r["held_back_by"] for r in t)
    # R1 and R2 from the main runs, which run rose-coresident and carry the trough figures
    assert {r["target"] for r in t} >= {"R1: SLO rose ≥ static − 0.002, reclaims_late 0"}
    assert any(r["target"].startswith("R2: ") for r in t)
    main = [r["result"] for r in rec["runs"] if r["kind"] == "main"]
    assert all("rose-coresident" in r["policies"] and "trough" in r for r in main)
    again = _rose("paper-check", "--from-json", str(tmp_path / "pc.json"), "--out", str(tmp_path / "again.md"))
    assert again.returncode == 0, again.stderr  # the tables again from the record, nothing run
    assert (tmp_path / "again.md").read_text().strip() == text[text.index(BEGIN) : text.index(END) + len(END)]


def test_the_assumptions_sweep_sets_one_constant_per_run_and_restores_it(traces_dir):
    """`python -m rose.sim.sweep`: a module constant is set for its runs only (restored after),
    only the constants asked for run, and less memory for share-all never raises its gain."""
    from rose.sim import models, runs
    from rose.sim.sweep import ASSUMPTIONS, markdown, sweep

    tr = load_trace(traces_dir / "azure_llm2023_conv.csv")
    base = SimConfig(n_gpus=8, duration_s=60, record_series=False, policies=("static", "share-all", "rose"))
    res = sweep(tr, base, only="SHARE_ALL_MEM_FRAC")
    assert runs.SHARE_ALL_MEM_FRAC == 0.5 and [r["constant"] for r in res["rows"]] == ["runs.SHARE_ALL_MEM_FRAC"]
    row = res["rows"][0]
    assert row["at_low"]["share_all_gain"] <= res["at_defaults"]["share_all_gain"]
    assert "runs.SHARE_ALL_MEM_FRAC | 0.5 | 0.25 →" in markdown(res)
    assert models.DISK_BYTES_PER_S == 2.0e9 and len({a[0] for a in ASSUMPTIONS}) == len(ASSUMPTIONS)
