"""`rose_vs_share_all.gap` (rose.sim.report.share_all_gap): share-all's rollout work on serving
GPUs split into ROSE's own part and the causes of the rest (no lease, lease start, paused, the
share cap), one cause per GPU-window, adding up with the residual to 1; the accounting changes
no other figure."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rose.config import PolicyConfig
from rose.sim.engine import SimConfig, simulate
from rose.sim.interference import InterferenceProfile, ProfilePoint, default_profile
from rose.sim.report import GAP_TOLERANCE, across_seeds
from rose.sim.rose_run import GAP_CAUSES, NO_LEASE_WHY, no_lease_why
from rose.sim.traces import load_trace

PARTS = ("rose", *GAP_CAUSES)


def _run(traces_dir, **kw) -> dict:
    """A short real-trace run (16 GPUs, 300 s), as tests/test_interference_profile.py's."""
    tr = load_trace(traces_dir / "azure_llm2023_conv.csv")
    cfg = SimConfig(
        n_gpus=16,
        dedicated=2,
        duration_s=300,
        record_series=False,
        policies=("static", "share-all", "rose"),
        check_invariants=True,
    )
    return simulate(tr, replace(cfg, **kw))


def _closes(r: dict) -> dict:
    """The gap of run `r`, checked: parts >= 0, adding up to 1 and to the episode gap."""
    g = r["rose_vs_share_all"]["gap"]
    assert all(g[k] >= 0 for k in PARTS)
    assert all(v >= 0 for k in ("no_lease_by_reason", "paused_by") for v in g[k].values())
    total = g["rose"] + sum(g[k] for k in GAP_CAUSES) - 2 * g["above_share_all"] + g["residual"]
    assert total == pytest.approx(1.0, abs=1e-5) and abs(g["residual"]) <= g["tolerance"] == GAP_TOLERANCE
    assert sum(g["no_lease_by_reason"].values()) == pytest.approx(g["no_lease"], abs=1e-5)
    assert sum(g["paused_by"].values()) == pytest.approx(g["paused"], abs=1e-5)
    pol = r["policies"]
    episodes_gap = (pol["share-all"]["rollout_episodes"] - pol["rose"]["rollout_episodes"]) / g[
        "share_all_harvested_episodes"
    ]
    causes = sum(g[k] for k in GAP_CAUSES) - 2 * g["above_share_all"]
    assert episodes_gap == pytest.approx(causes + g["unfinished"] + g["residual"], abs=1e-4)
    return g


def test_gap_parts_are_non_negative_and_add_up(traces_dir):
    r = _run(traces_dir)
    g = _closes(r)
    assert g["share_all_harvested_episodes"] > 0 and 0 < g["rose"] < 1
    assert g["no_lease"] + g["share_cap"] > 0  # ROSE harvests less here (the measured profile)
    two = across_seeds([r, _run(traces_dir, seed=1)])["rose_vs_share_all"]["gap"]
    assert len(two["per_seed"]) == 2 and two["per_seed"][0] == g
    assert two["no_lease"] == pytest.approx((g["no_lease"] + two["per_seed"][1]["no_lease"]) / 2, abs=1e-6)


def test_no_rollout_progress_means_every_part_is_zero(traces_dir):
    flat = InterferenceProfile("test", "test", tuple(ProfilePoint(s, 1.2, 1.1, 0.0) for s in (0.25, 0.5, 1.0)))
    g = _run(traces_dir, interference=flat)["rose_vs_share_all"]["gap"]
    assert g["share_all_harvested_episodes"] == 0.0
    assert all(g[k] == 0.0 for k in (*PARTS, "residual", "unfinished"))
    assert all(v == 0.0 for k in ("no_lease_by_reason", "paused_by") for v in g[k].values())


def test_a_grant_threshold_never_met_leaves_no_lease_dominant(traces_dir):
    g = _closes(_run(traces_dir, policy=PolicyConfig(grant_headroom=0.99)))
    assert g["no_lease"] > 0.95 and g["no_lease"] > 10 * (g["lease_start"] + g["paused"] + g["share_cap"])
    assert g["no_lease_by_reason"]["below_threshold"] > 0.9 * g["no_lease"]


def test_a_lease_start_costs_rose_and_share_all_what_its_windows_would_have_done(traces_dir):
    """Starting rollout costs ROSE every lease and share-all once: with a 20 s start (warm or
    cold) ROSE harvests less than with starts under a second (the sourced wake-up, and cold
    starts set to 1 s) and the gap's `lease_start` part grows; with a start longer than the run
    neither harvests anything. The gap still adds up."""
    gpu_bound = default_profile()  # the H200's GEMM profile: leases come and go, so starts weigh
    base = _run(traces_dir, cold_start_s=1.0, interference=gpu_bound)
    slow = _run(traces_dir, lease_start_s=20.0, cold_start_s=20.0, interference=gpu_bound)
    g0, g1 = _closes(base), _closes(slow)
    assert 0 < base["config"]["costs"]["lease_start_s"] < 1.0 and slow["config"]["costs"]["lease_start_s"] == 20.0
    for p in ("rose", "share-all"):
        assert slow["policies"][p]["harvest_per_serving_gpu"] < base["policies"][p]["harvest_per_serving_gpu"]
        assert slow["policies"][p]["lease_start_s"] >= 20.0
    assert g1["lease_start"] > 2 * g0["lease_start"] > 0  # fewer starts where leases hold longer, each 20 s
    never = _run(traces_dir, lease_start_s=400.0, cold_start_s=400.0)
    for p in ("rose", "share-all"):
        assert never["policies"][p]["harvest_per_serving_gpu"] == 0.0 and never["policies"][p]["lease_start_s"] is None


def test_the_default_lease_start_is_a_wake_up_of_the_weights_shard(traces_dir):
    """The sourced default: vLLM's smallest level-1 wake-up plus the weight shard over the measured
    host -> device copy rate; it grows with the model and shrinks with tensor parallelism."""
    from rose.sim.models import WAKE_FLOOR_S, deployed, gpu_spec, model_size, wake_s

    r = _run(traces_dir)
    gpu = gpu_spec("H100")
    shard = r["config"]["rollout"]["policy_weight_bytes_per_gpu"]
    assert r["config"]["costs"]["lease_start_s"] == pytest.approx(WAKE_FLOOR_S + shard / gpu.h2d_bytes_per_s, abs=1e-4)
    assert r["config"]["costs"]["lease_start_source"].startswith("0.1 s (vLLM sleep-mode blog")
    big = deployed(model_size("70B"), gpu, 4, 0).weight_bytes_per_gpu
    assert wake_s(shard, gpu) < wake_s(big, gpu) < wake_s(4 * big, gpu)


def test_a_resume_cost_is_counted_as_paused(traces_dir):
    """A resume after a throttle or a guard pause costs its worker `resume_s` of decoding, which
    the gap books under `paused` (not under the lease's start)."""
    prof = default_profile()  # the H200's GEMM profile, under which leases are throttled and resumed
    quick, slow = _run(traces_dir, resume_s=0.0, interference=prof), _run(traces_dir, resume_s=5.0, interference=prof)
    g0, g1 = _closes(quick), _closes(slow)
    if quick["policies"]["rose"]["throttles"] + quick["policies"]["rose"]["guard_pauses"] == 0:
        pytest.fail("the run resumed no lease: the test needs one that does")
    assert g1["paused"] > g0["paused"]
    assert slow["policies"]["rose"]["harvest_per_serving_gpu"] <= quick["policies"]["rose"]["harvest_per_serving_gpu"]


def test_elastic_pays_its_provisioning_delay(traces_dir):
    fast = _run(traces_dir, policies=("static", "elastic"), elastic_provision_s=10.0)
    slow = _run(traces_dir, policies=("static", "elastic"), elastic_provision_s=600.0)
    assert slow["policies"]["elastic"]["external_gpu_hours"] == 0.0  # none arrives within the run
    assert fast["policies"]["elastic"]["external_gpu_hours"] > 0.0
    assert slow["config"]["costs"]["elastic_provision_s"] == 600.0


@pytest.mark.parametrize(
    ("reason", "why"),
    [
        ("headroom 0.12 < 0.30 on ttft_p99", "below_threshold"),
        ("headroom streak 1 < 3", "below_threshold"),
        ("no grant: headroom 0.01 < 0.10 on tpot_p99", "below_threshold"),
        ("serving load 0.95 leaves no compute share", "below_threshold"),
        ("cooldown until 120.000", "cooldown"),
        ("no grant: free memory 1.0 GiB < margin 2.0 GiB", "memory"),
        ("free memory after margin 1.0 GiB < minimum lease 9.0 GiB", "memory"),
        ("ignored", "other"),
    ],
)
def test_no_lease_reasons(reason, why):
    assert NO_LEASE_WHY[no_lease_why(reason)] == why


def test_a_lease_that_finds_no_warm_worker_on_its_node_starts_cold(traces_dir):
    """Each node's executor keeps `warm_workers` ready warm workers; a lease takes one (its start
    is the wake-up) and the node launches a replacement, ready `warm_build_s` later; a lease
    that finds none ready starts cold (`cold_start_s`, sourced per model size). With no warm
    pool every start is cold and the lease-start part of the gap is larger than with one warm
    worker a node; with one, the leases granted beyond the pool in a burst start cold."""
    from rose.sim.models import cold_start_s, gpu_spec, wake_s, warm_build_s

    one, none = _run(traces_dir), _run(traces_dir, warm_workers=0)
    costs = one["config"]["costs"]
    shard = one["config"]["rollout"]["policy_weight_bytes_per_gpu"]
    assert costs["cold_start_s"] == pytest.approx(cold_start_s(shard, gpu_spec("H100")), abs=1e-4)
    assert costs["cold_start_s"] == pytest.approx(warm_build_s(shard) + wake_s(shard, gpu_spec("H100")), abs=1e-4)
    assert costs["warm_workers_per_node"] == 1 and none["config"]["costs"]["warm_workers_per_node"] == 0
    r1, r0 = one["policies"]["rose"], none["policies"]["rose"]
    assert r1["warm_starts"] + r1["cold_starts"] == r1["grants"] > 2  # one worker a lease (group size 1)
    assert 0 < r1["warm_starts"] <= r1["grants"] and r1["cold_starts"] > 0  # 16 GPUs, 2 nodes: 2 warm workers
    assert r0["warm_starts"] == 0 and r0["cold_starts"] == r0["grants"]
    assert _closes(none)["lease_start"] > _closes(one)["lease_start"]
