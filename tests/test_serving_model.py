"""The serving queueing model: invariants checked with hypothesis, plus the presets."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rose.config import GiB
from rose.sim.models import GPUS, MODELS, EngineConfig, check_tp, deployed, gpu_spec, model_size, serving_tp
from rose.sim.serving_model import ServingSim, spread, windows
from rose.sim.traces import Trace

PERIOD = 0.5
FAST = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)


def requests(n_gpus: int, max_n: int = 60, horizon: float = 5.0):
    """Sorted arrivals with GPU assignment and token counts."""
    row = st.tuples(
        st.floats(0, horizon - 1e-3), st.integers(0, n_gpus - 1), st.integers(1, 20000), st.integers(1, 2000)
    )
    return st.lists(row, max_size=max_n).map(lambda rs: sorted(rs))


def run(rows, n_gpus, model="7B", gpu="H100", n_windows=14, rollout=None, dup=1):
    """Drive a sim of `n_gpus` replicas (tp GPUs each) through windows; `rollout(sim, w)` may
    change leases before window w."""
    tp = deployed(MODELS[model], GPUS[gpu]).tp
    sim = ServingSim(GPUS[gpu], MODELS[model], n_gpus * tp)
    a = np.array([r[0] for r in rows] * dup, dtype=float)
    order = np.argsort(a, kind="stable")
    g = np.array([r[1] for r in rows] * dup, dtype=np.int64)[order]
    p = np.array([r[2] for r in rows] * dup, dtype=float)[order]
    o = np.array([r[3] for r in rows] * dup, dtype=float)[order]
    a = a[order]
    out = []
    for w, (t_end, sl) in enumerate(windows(a, PERIOD, t_end=n_windows * PERIOD)):
        if rollout:
            rollout(sim, w)
        out.append(sim.advance(t_end, g[sl], a[sl], p[sl], o[sl]))
    return out


def stack(stats, name):
    return np.array([getattr(s, name) for s in stats])


# Parameter counts as the model cards / the hub's safetensors metadata state them
CARD_PARAMS = {"7B": 7.61e9, "8B": 8.03e9, "14B": 14.7e9, "32B": 32.5e9, "70B": 70.6e9}


def test_presets_document_their_shapes():
    """The presets are the GQA models' config.json shapes; parameters counted from the shape
    match the model cards; KV bytes per token are 2 (K, V) x layers x KV heads x head_dim x 2 B."""
    shapes = {  # config.json: num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads
        "7B": ("Qwen/Qwen2.5-7B", 28, 3584, 28, 4),
        "8B": ("meta-llama/Llama-3.1-8B", 32, 4096, 32, 8),
        "14B": ("Qwen/Qwen2.5-14B", 48, 5120, 40, 8),
        "32B": ("Qwen/Qwen2.5-32B", 64, 5120, 40, 8),
        "70B": ("meta-llama/Llama-3.1-70B", 80, 8192, 64, 8),
    }
    assert set(MODELS) == set(shapes)
    for name, (repo, layers, hidden, heads, kv_heads) in shapes.items():
        m = MODELS[name]
        assert (m.repo, m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim) == (
            repo,
            layers,
            hidden,
            heads,
            kv_heads,
            128,
        )
        assert m.kv_bytes_per_token == 2 * layers * kv_heads * 128 * 2
        assert m.params == pytest.approx(CARD_PARAMS[name], rel=0.01), name
        assert m.flop_params < m.params
    assert MODELS["7B"].kv_bytes_per_token == 56 * 1024  # 4 KV heads: a ninth of Llama-2-7B's 512 KiB
    assert MODELS["70B"].weight_bytes == int(2 * MODELS["70B"].params)
    assert model_size("14b") is MODELS["14B"] and gpu_spec("h200") is GPUS["H200"]
    with pytest.raises(ValueError, match="unknown model size '3B'"):
        model_size("3B")
    for m in MODELS.values():  # every preset fits both GPUs, at its default TP, with room for a KV cache
        for gpu in GPUS.values():
            sim = ServingSim(gpu, m, deployed(m, gpu).tp)
            assert sim.kv_capacity_tokens()[0] >= m.max_context


def test_default_tp_is_the_fewest_gpus_that_host_the_model():
    h100 = {name: serving_tp(m, GPUS["H100"]) for name, m in MODELS.items()}
    h200 = {name: serving_tp(m, GPUS["H200"]) for name, m in MODELS.items()}
    assert h100 == {"7B": 1, "8B": 1, "14B": 1, "32B": 2, "70B": 4}
    assert h200 == {"7B": 1, "8B": 1, "14B": 1, "32B": 1, "70B": 2}
    # 70B at TP 2 on H100 cannot hold one 128k-token sequence beside its 70 GB weight shard
    m, gpu = MODELS["70B"], GPUS["H100"]
    assert gpu.mem_bytes - m.weight_bytes // 2 - 2 * GiB < m.max_context * m.kv_bytes_per_token_per_gpu(2)
    assert deployed(m, gpu, 8).tp == 8 and deployed(m, gpu).tp == 4
    with pytest.raises(ValueError, match="does not split"):
        check_tp(MODELS["7B"], 8)  # 28 attention heads
    with pytest.raises(ValueError, match="not in"):
        check_tp(m, 3)
    with pytest.raises(ValueError, match="replicas of tp=4"):
        ServingSim(gpu, m, 6)
    # KV heads split over the ranks, replicated beyond their count (Qwen2.5-7B has 4)
    assert MODELS["7B"].kv_bytes_per_token_per_gpu(2) == MODELS["7B"].kv_bytes_per_token // 2
    wide = replace(MODELS["7B"], heads=32, hidden=4096)  # 4 KV heads over 8 ranks: one head each
    check_tp(wide, 8)
    assert wide.kv_bytes_per_token_per_gpu(8) == wide.kv_bytes_per_token // 4


def test_a_tp_replica_is_one_engine_over_its_gpus():
    """Every rank of a replica reports the replica's latency; its KV cache and FLOPs are split
    over the ranks; a lease on one rank slows (and squeezes the KV cache of) the whole replica."""
    gpu, m = GPUS["H100"], MODELS["70B"]
    sim = ServingSim(gpu, m, 8)
    assert (sim.tp, sim.replicas) == (4, 2)
    assert sim.static_bytes == m.weight_bytes // 4 + EngineConfig().runtime_reserve_bytes
    one = ServingSim(gpu, deployed(m, gpu, 8), 8)  # TP 8: half the prefill time per token
    assert one.p_tok == pytest.approx(sim.p_tok / 2)
    sim.set_rollout(5, 0.4, True, 4 * GiB)
    assert sim.interference()[0].tolist() == [1.0, pytest.approx(1 + sim.alpha * 0.4)]
    full = (gpu.mem_bytes - sim.static_bytes) / sim.kv
    assert sim.kv_capacity_tokens()[0] == pytest.approx(full)
    assert sim.kv_capacity_tokens()[1] == pytest.approx(full - 4 * GiB / sim.kv)
    s = sim.advance(0.5, np.array([1, 1]), np.array([0.0, 0.1]), np.array([3000.0, 500.0]), np.array([100.0, 50.0]))
    assert np.all(s.ttft_p99_ms[4:] == s.ttft_p99_ms[4]) and s.ttft_p99_ms[4] > s.ttft_p99_ms[0]
    assert np.all(s.rps[4:] == 4.0) and np.all(s.rps[:4] == 0.0)
    assert s.mem_used_bytes[5] - s.mem_used_bytes[4] == 4 * GiB
    assert s.gpu_util[5] > s.gpu_util[4]  # its own rollout share on top of the replica's work


def test_step_time_grows_with_batch_and_context_and_model():
    sim7 = ServingSim(GPUS["H100"], MODELS["7B"])
    sim32 = ServingSim(GPUS["H100"], MODELS["32B"], 1 * 2)  # TP 2
    b = np.array([1.0, 8, 64, 256, 1024])
    c = b * 1000
    t7 = sim7.step_time(b, c)
    assert np.all(np.diff(t7) > 0)
    assert np.all(sim32.step_time(b, c) > t7)  # a larger weight shard and 2.3x the KV per token per GPU
    # 7B on H100, small batch: weights streamed once (15.2 GB / 2.5 TB/s ≈ 6.1 ms) + 2 ms overhead
    assert 0.007 < float(sim7.step_time(np.array([1.0]), np.array([100.0]))[0]) < 0.009


@FAST
@given(st.integers(1, 3).flatmap(lambda n: st.tuples(st.just(n), requests(n))))
def test_deterministic(case):
    n, rows = case
    a, b = run(rows, n), run(rows, n)
    for x, y in zip(a, b):
        for name in ("ttft_p99_ms", "tpot_p99_ms", "queue_depth", "gpu_util", "mem_used_bytes"):
            assert np.array_equal(getattr(x, name), getattr(y, name))


@FAST
@given(st.integers(1, 3).flatmap(lambda n: st.tuples(st.just(n), requests(n))), st.sampled_from(["7B", "70B"]))
def test_latency_monotone_in_load(case, model):
    """Doubling every request (same times) raises TTFT: no window's TTFT p99 drops by more
    than 3%, and the queue never shrinks. (The tolerance covers the fluid model's one
    non-monotone term: a step depends on the context already admitted to the KV cache,
    and with more load more of it can still be queued. TPOT is compared in steady state
    below: per window, more load can delay a prefill stall into a later window.)"""
    n, rows = case
    base, double = run(rows, n, model), run(rows, n, model, dup=2)
    b, d = stack(base, "ttft_p99_ms"), stack(double, "ttft_p99_ms")
    assert np.all(d >= b * 0.97 - 1e-6)
    assert np.all(stack(double, "queue_depth").sum(axis=0) >= stack(base, "queue_depth").sum(axis=0))


# Arrival patterns locked to the windows, slowest first: (requests per window, evenly spaced;
# in every how many-th window). 0.25 to 8 requests/s; each is at least 1.25x the one before.
LOCKED = ((1, 8), (1, 5), (1, 4), (1, 2), (1, 1), (2, 1), (3, 1), (4, 1))


def locked_rows(per_window: int, every: int, phase: float, prompt: int, out: int, n_windows: int):
    """`per_window` requests spaced PERIOD / per_window apart, the first `phase` of a spacing
    into the window, in windows 0, every, 2 every, ...: the same place in every window."""
    gap = PERIOD / per_window
    return [
        (w * PERIOD + (phase + j) * gap, 0, prompt, out) for w in range(0, n_windows, every) for j in range(per_window)
    ]


@FAST
@given(
    st.lists(st.integers(0, len(LOCKED) - 1), min_size=2, max_size=2, unique=True).map(sorted),
    st.floats(0.0, 0.999),
    st.integers(100, 6000),
    st.integers(10, 800),
    st.sampled_from(["7B", "32B", "70B"]),
)
def test_steady_state_latency_grows_with_rate(pair, phase, prompt, out, model):
    """Below saturation a higher arrival rate gives a strictly higher mean TTFT p99 and mean
    TPOT p99 in steady state: means over windows 20-59, whole periods of every pattern (40 is
    a multiple of each `every`), arrivals at the same place in the window for both rates.

    Why locked to the windows: a prefill that a window edge cuts is carried into the next
    window as one job at its start and served again in full (docs/simulator.md, "Per-window
    fluid approximation" 1), so a window's p99 also depends on where its arrivals fall against
    the edges. Periodic arrivals at an arbitrary rate drift against the edges, and two rates
    sample that edge term at different phases: at 3.34 vs 4.01 req/s (70B, 1638-token
    prompts, 10 output tokens) it added 3 and 6 ms (2-4 %) to 2 of 40 windows of the lower
    rate only, and its 40-window mean came out 0.14 % above the higher rate's (145.88 vs
    145.68 ms), while the steady-state growth itself can be as small as 0.02 % (100-token
    prompts, 10 output tokens: the running set, whose KV reads lengthen every step, stays
    tiny). At the same phase the edge term is nested: the higher rate's last arrival in a
    window comes no earlier and its first no later, so the edge costs it at least as much.
    Strict: the fluid running set never drains to exactly 0, so every extra request leaves
    context that lengthens later steps; the smallest growth hypothesis found (0.02 %) is far
    above float rounding. Overload has no steady state (the queue grows without bound) and is
    covered by test_overload_builds_a_queue_and_ttft."""
    (m_lo, k_lo), (m_hi, k_hi) = LOCKED[pair[0]], LOCKED[pair[1]]
    assert m_hi / k_hi >= 1.25 * m_lo / k_lo
    lo = run(locked_rows(m_lo, k_lo, phase, prompt, out, 60), 1, model, n_windows=60)
    hi = run(locked_rows(m_hi, k_hi, phase, prompt, out, 60), 1, model, n_windows=60)
    assume(stack(hi, "queue_depth")[20:].max() <= 2)
    for name in ("ttft_p99_ms", "tpot_p99_ms"):
        assert stack(hi, name)[20:].mean() > stack(lo, name)[20:].mean(), name


@FAST
@given(
    st.integers(1, 3).flatmap(lambda n: st.tuples(st.just(n), requests(n))), st.floats(0.05, 1.0), st.integers(0, 2**40)
)
def test_memory_within_total(case, share, rollout_mem):
    n, rows = case

    def lease(sim, w):
        if w == 3:
            sim.set_rollout(slice(None), share, True, rollout_mem)
        if w == 9:
            sim.clear_rollout()

    for s in run(rows, n, "70B", rollout=lease):
        assert np.all(s.mem_used_bytes <= s.mem_total_bytes)
        assert np.all(s.rollout_mem_bytes <= s.mem_used_bytes)
        assert np.all((s.gpu_util >= 0) & (s.gpu_util <= 1))
        assert np.all(s.ttft_p99_ms >= 0) and np.all(s.tpot_p99_ms > 0)


def steady_rows(n_gpus=1, rate=4.0, horizon=20.0, prompt=1500, out=200):
    t = np.arange(0, horizon, 1 / rate)
    return [(float(x), i % n_gpus, prompt, out) for i, x in enumerate(t)]


@FAST
@given(st.floats(0.1, 1.0))
def test_interference_raises_latency_and_revoke_restores_it(share):
    rows = steady_rows()
    n_win = 40

    def lease(sim, w):
        if w == 10:
            sim.set_rollout(0, share, True, 4 * GiB)
        if w == 20:
            sim.set_rollout(0, share, False, 4 * GiB)  # paused: no compute interference
        if w == 30:
            sim.clear_rollout()

    base = stack(run(rows, 1, n_windows=n_win), "tpot_p99_ms")[:, 0]
    lent = stack(run(rows, 1, n_windows=n_win, rollout=lease), "tpot_p99_ms")[:, 0]
    assert np.array_equal(lent[:10], base[:10])
    assert np.all(lent[10:20] > base[10:20])  # running rollout slows every window
    # pausing (or revoking) gives it back: within a few windows latency is at the baseline
    assert np.allclose(lent[24:30], base[24:30], rtol=0.05)
    assert np.allclose(lent[34:], base[34:], rtol=0.05)


def test_interference_is_one_plus_alpha_share():
    """Per GPU (tp 1), 1 + alpha × share up to the time-slicing bound 1 / (1 - share)."""
    for alpha in (0.5, 1.0, 2.0):
        sim = ServingSim(GPUS["H100"], MODELS["7B"], 2, alpha=alpha)
        sim.set_rollout(1, 0.4, True, 0)
        for ratio in sim.interference():  # the linear profile: mean and p99 alike
            assert ratio.tolist() == [1.0, pytest.approx(min(1 + alpha * 0.4, 1 / 0.6))]


def test_overload_builds_a_queue_and_ttft():
    light = run(steady_rows(rate=1.0), 1, n_windows=40)
    heavy = run(steady_rows(rate=40.0, prompt=4000), 1, n_windows=40)
    assert stack(heavy, "queue_depth")[-1, 0] > 10
    assert stack(heavy, "ttft_p99_ms")[-1, 0] > 10 * stack(light, "ttft_p99_ms")[-1, 0]
    assert stack(light, "queue_depth").max() == 0


def test_rollout_memory_squeezes_kv_and_preempts():
    sim = ServingSim(GPUS["H100"], MODELS["70B"], 4)  # one TP-4 replica
    room = sim.gpu.mem_bytes - sim.static_bytes
    a = np.arange(0, 5, 0.05)
    for t_end, sl in windows(a, PERIOD):
        sim.advance(
            t_end,
            np.zeros(sl.stop - sl.start, dtype=int),
            a[sl],
            np.full(sl.stop - sl.start, 3000),
            np.full(sl.stop - sl.start, 500),
        )
    assert sim.C[0] > 0
    sim.set_rollout(2, 0.2, True, room)  # rollout takes every byte one rank's KV shard could use
    s = sim.advance(sim.t + PERIOD)
    assert np.all(s.mem_used_bytes <= s.mem_total_bytes) and sim.C[0] == 0 and np.all(s.queue_depth > 0)


def test_engine_slots_limit_admission():
    rows = steady_rows(rate=50.0, prompt=100, out=2000, horizon=10)
    few = ServingSim(GPUS["H200"], MODELS["7B"], engine=EngineConfig(max_slots=8))
    a = np.array([r[0] for r in rows])
    for t_end, sl in windows(a, PERIOD):
        k = sl.stop - sl.start
        s = few.advance(t_end, np.zeros(k, dtype=int), a[sl], np.full(k, 100), np.full(k, 2000))
    assert few.N[0] <= 8 * 1.5 and s.queue_depth[0] > 100


@pytest.mark.parametrize("n", [99, 100, 150])
def test_ttft_p99_is_the_nearest_rank(n):
    """A burst of n equal requests at a window's start on an idle replica: the i-th waits for
    the i - 1 before it, so TTFTs are S, 2S, ..., nS and the nearest-rank p99 is the
    ceil(0.99 n)-th of them: the largest below 100 requests, not at or above."""
    sim = ServingSim(GPUS["H100"], MODELS["7B"])
    P = 100.0
    S = P * sim.p_tok + sim.engine.step_overhead_s  # one chunk, beside no decode batch
    s = sim.advance(PERIOD, np.zeros(n, dtype=int), np.zeros(n), np.full(n, P), np.full(n, 10.0))
    assert s.ttft_p99_ms[0] == pytest.approx(1000 * S * np.ceil(0.99 * n), rel=1e-9)


@FAST
@given(st.integers(1, 3).flatmap(lambda n: st.tuples(st.just(n), requests(n))), st.randoms(use_true_random=False))
def test_arrival_order_does_not_matter(case, rnd):
    """`advance` takes a window's requests in any order (callers pass them sorted by time, which
    takes a faster path): shuffled, every output agrees to float rounding (sums run in another
    order), the integer ones within a rounding step. Requests arriving at the same instant are
    served in the order given, so arrival times here are distinct."""
    n, rows = case
    rows = sorted({r[0]: r for r in rows}.values())
    a = np.array([r[0] for r in rows], dtype=float)
    g = np.array([r[1] for r in rows], dtype=np.int64)
    p = np.array([r[2] for r in rows], dtype=float)
    o = np.array([r[3] for r in rows], dtype=float)
    sims = [ServingSim(GPUS["H100"], MODELS["7B"], n) for _ in range(2)]
    for t_end, sl in windows(a, PERIOD, t_end=14 * PERIOD):
        mix = np.arange(sl.start, sl.stop)
        rnd.shuffle(mix)
        x = sims[0].advance(t_end, g[sl], a[sl], p[sl], o[sl])
        y = sims[1].advance(t_end, g[mix], a[mix], p[mix], o[mix])
        for name in ("ttft_p99_ms", "tpot_p99_ms", "gpu_util", "rps", "running"):
            assert np.allclose(getattr(x, name), getattr(y, name), rtol=1e-9, atol=1e-12), name
        for name in ("queue_depth", "mem_used_bytes"):
            assert np.abs(getattr(x, name) - getattr(y, name)).max() <= 1, name  # a rounding step at most


def test_spread_is_deterministic_and_balanced():
    rng = np.random.default_rng(0)
    n = 4000
    tr = Trace(
        "t",
        "azure",
        np.sort(rng.uniform(0, 100, n)),
        rng.integers(1, 4000, n).astype(np.int32),
        rng.integers(1, 500, n).astype(np.int32),
    )
    a, b, c = spread(tr, 16, seed=1), spread(tr, 16, seed=1), spread(tr, 16, seed=2)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    counts = np.bincount(a, minlength=16)
    assert counts.min() > 0.8 * n / 16 and counts.max() < 1.2 * n / 16
    assert np.all(spread(tr, 1) == 0)


def test_windows_partition_the_trace():
    a = np.array([0.0, 0.1, 0.5, 0.99, 1.0, 2.7])
    ws = list(windows(a, 0.5))
    assert [w[0] for w in ws] == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
    assert [(s.start, s.stop) for _, s in ws] == [(0, 2), (2, 4), (4, 5), (5, 5), (5, 5), (5, 6)]
    assert sum(s.stop - s.start for _, s in ws) == len(a)
