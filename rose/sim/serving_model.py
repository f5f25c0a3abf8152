"""A deterministic queueing model of an LLM serving engine, one window at a time, for many GPUs.

Pure: no I/O, no wall clock, no randomness (only `spread` draws, from its seed). Used by
`rose agent --simulate`, `rose simulate` and the demo. One call to `ServingSim.advance`
moves every GPU of a fleet through one sampling window with a handful of numpy operations,
so 1,000 GPUs × an hour of 0.5 s windows runs in seconds.

Model sizes (`MODELS`). Weight bytes are bf16, 2 bytes × parameters. KV-cache bytes per token
are ``2 (K and V) × layers × kv_heads × head_dim × 2 bytes``:

======  ==================  =========  ======  ========  ========  ===  ============
name    representative      params     layers  kv_heads  head_dim  tp   KV B/token
======  ==================  =========  ======  ========  ========  ===  ============
7B      Llama-2-7B          6.74e9     32      32 (MHA)  128       1    524,288
14B     Qwen-14B (v1)       14.17e9    40      40 (MHA)  128       1    819,200
32B     Qwen2.5-32B         32.76e9    64      8 (GQA)   128       1    262,144
70B     Llama-2-70B         68.98e9    80      8 (GQA)   128       2    327,680
======  ==================  =========  ======  ========  ========  ===  ============

Sources: the models' published `config.json` (num_hidden_layers, num_key_value_heads,
hidden_size / num_attention_heads) and parameter counts from their model cards / papers
(Llama 2 paper Table 1; Qwen technical report; Qwen2.5 model card). 70B in bf16 (138 GB)
does not fit one 80 GB GPU with room for a KV cache, so it is served tensor-parallel over
`tp = 2` GPUs. A TP group of tp GPUs serving tp× the traffic is, per GPU, the same as one
GPU holding ``weights / tp`` that sees its own share of traffic (each GPU holds 1/tp of the
group's tp× larger KV cache and does 1/tp of its tp× larger FLOPs), plus two all-reduces per
layer per iteration (`GpuSpec.allreduce_s`). So every GPU is modelled alone.

GPUs (`GPUS`). H100 SXM5: 80 GiB HBM3 (81,559 MiB as NVML reports it), 3.35 TB/s,
989 TFLOP/s dense bf16. H200 SXM: 141 GB HBM3e (143,771 MiB per NVML), 4.8 TB/s, same
compute (NVIDIA datasheets). Achieved fractions: 75% of peak HBM bandwidth in decode
(attention + GEMV kernels reach 70–85%), 45% MFU in prefill (large GEMMs; vLLM/SGLang
prefill measures 40–55%).

Roofline of one engine iteration (continuous batching, as vLLM/SGLang run it):

* Decode step with B running requests holding C context tokens in KV cache reads every
  weight once and every cached K/V once: ``t_mem = (W/tp + C × kv) / (bw × 0.75)``; it does
  ``2 × params × B`` FLOPs: ``t_cmp = 2 P B / (peak × 0.45)``. Step time is
  ``overhead + max(t_mem, t_cmp) + comm``: memory-bound for any realistic B (for 7B on H100
  the crossover is B ≈ 300), so TPOT grows with batch mostly through the KV term.
  ``overhead`` = 2 ms: scheduling, sampling and launch per iteration.
* Prefill is compute-bound: ``p = 2 P / (peak × 0.45)`` seconds per prompt token (30 µs for 7B
  on H100; the attention term ``∝ prompt²`` is below 10% up to 8k tokens and is ignored).
* Chunked prefill: an iteration carries the decode batch plus up to `chunk_tokens` (2048)
  prompt tokens, so a prompt costs ``P × p + ceil(P / chunk) × step`` and every decode token
  produced in such an iteration waits ``step + min(chunk, P) × p`` — the inter-token stall
  that dominates TPOT p99 in practice.

Per-window fluid approximation (what `advance` computes, vectorised over GPUs):

1. Prefill is a FIFO server. Requests of the window, preceded by the queue carried from the
   previous window as one job at the window's start, get waits by the Lindley recursion
   ``W_i = max(0, W_{i-1} + S_{i-1} - (a_i - a_{i-1}))``, computed in closed form
   (``W = Y - cummin(Y)`` of the cumulated ``S - gap``, segmented per GPU). TTFT = wait + own
   service. When batch slots or free KV cache cannot take the window's demand, every
   service time is stretched by demand / capacity (admission blocks prefill).
2. TTFT p99 per GPU is the nearest-rank p99 of that window's requests; a window without
   arrivals reports what a request arriving at its end would wait beyond its own prefill.
3. Decode: the running set is tracked as counts (requests N, remaining output tokens R,
   context tokens C) with exponentially distributed remaining lengths (mean R/N): after k
   iterations ``N·(1-e^{-k/m})`` requests have finished. k counts the prefill iterations
   and the pure decode steps that fill the rest of the window. Requests whose prefill ends
   inside the window join the running set at its end.
4. TPOT p99 is the token-weighted 99th percentile of a two-point mix: tokens made in
   prefill iterations (stalled by the largest prompt chunk of the window) and plain steps;
   an idle GPU reports the step time a new request would see.
5. Memory = weights/tp + runtime reserve + C × kv + rollout memory. The KV cache grows with
   demand (an engine with an elastic KV pool, the premise of lending memory; engines that
   preallocate a fixed pool report a constant instead). When rollout memory leaves less
   room than the running set needs, the excess is preempted back to the queue
   (recomputed), so memory never exceeds the total.
6. Utilisation is NVML's busy fraction: prefill time plus the expected time until the
   longest running request ends (m × H_N steps), plus a running rollout's `compute_share`
   of the remaining time.

Interference: while a rollout lease with `compute_share` x is granted and running (not
paused), every serving step and prefill time is multiplied by ``1 + alpha × x``. ``ALPHA = 1``
is the linearisation of the 1/(1-x) slowdown of fair time-slicing at small x; it is a
parameter, to be calibrated with `rose bench interference`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

GiB = 1 << 30
MiB = 1 << 20

ALPHA = 1.0  # serving slowdown per unit of rollout compute share (see module docstring)
P99 = 0.99
MAX_TTFT_S = 3600.0  # a wait beyond an hour is reported as an hour (schema bound is 1e9 ms)
MAX_STRETCH = 1000.0  # demand/capacity stretch cap when admission is blocked


@dataclass(frozen=True)
class ModelSize:
    """Shape of a served model: what sets weight memory, KV memory and FLOPs."""

    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    tp: int = 1  # GPUs per replica (tensor parallel)
    bytes_per_param: int = 2  # bf16

    @property
    def weight_bytes(self) -> int:
        return int(self.params * self.bytes_per_param)

    @property
    def weight_bytes_per_gpu(self) -> int:
        return self.weight_bytes // self.tp

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param


MODELS: dict[str, ModelSize] = {
    "7B": ModelSize("7B", 6.74e9, layers=32, kv_heads=32, head_dim=128),  # Llama-2-7B
    "14B": ModelSize("14B", 14.17e9, layers=40, kv_heads=40, head_dim=128),  # Qwen-14B
    "32B": ModelSize("32B", 32.76e9, layers=64, kv_heads=8, head_dim=128),  # Qwen2.5-32B
    "70B": ModelSize("70B", 68.98e9, layers=80, kv_heads=8, head_dim=128, tp=2),  # Llama-2-70B
}


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator: memory, peak rates and the fractions of them an engine achieves."""

    name: str
    mem_bytes: int
    hbm_bytes_per_s: float
    bf16_flops: float
    bw_efficiency: float = 0.75
    prefill_mfu: float = 0.45
    decode_mfu: float = 0.45
    allreduce_s: float = 10e-6  # one small NVLink all-reduce (per layer, twice per iteration, tp > 1)


GPUS: dict[str, GpuSpec] = {
    "H100": GpuSpec("H100", 81_559 * MiB, 3.35e12, 989e12),
    "H200": GpuSpec("H200", 143_771 * MiB, 4.8e12, 989e12),
}


@dataclass(frozen=True)
class EngineConfig:
    """The serving engine's scheduler settings (vLLM names in comments)."""

    max_slots: int = 256  # max_num_seqs
    chunk_tokens: int = 2048  # max_num_batched_tokens with chunked prefill (latency setting)
    step_overhead_s: float = 0.002  # scheduling, sampling, launch per iteration
    runtime_reserve_bytes: int = 2 * GiB  # CUDA context, activations, graphs


def model_size(name: str) -> ModelSize:
    """A preset by name ('7B', '14b', ...); ValueError naming the choices otherwise."""
    m = MODELS.get(name.upper())
    if m is None:
        raise ValueError(f"unknown model size {name!r} (known: {', '.join(MODELS)})")
    return m


def gpu_spec(name: str) -> GpuSpec:
    g = GPUS.get(name.upper())
    if g is None:
        raise ValueError(f"unknown GPU {name!r} (known: {', '.join(GPUS)})")
    return g


@dataclass
class WindowStats:
    """One window of every GPU; each array has one entry per GPU."""

    t_start: float
    t_end: float
    ttft_p99_ms: np.ndarray
    tpot_p99_ms: np.ndarray
    rps: np.ndarray
    queue_depth: np.ndarray  # int64
    gpu_util: np.ndarray
    mem_used_bytes: np.ndarray  # int64, includes rollout
    rollout_mem_bytes: np.ndarray  # int64
    mem_total_bytes: int = 0
    running: np.ndarray = field(default_factory=lambda: np.zeros(0))  # requests decoding (float)


class ServingSim:
    """Every GPU of a fleet serving one model with continuous batching; see module docstring.

    `advance(t_until, gpu_idx, arrival_s, prompt_tokens, output_tokens)` takes the requests
    that arrive in [t, t_until) (any order; `gpu_idx` says which GPU each goes to) and returns
    the window's WindowStats. `set_rollout` states the current lease of some GPUs.
    """

    def __init__(self, gpu: GpuSpec, model: ModelSize, n_gpus: int = 1, *,
                 engine: EngineConfig = EngineConfig(), alpha: float = ALPHA, t0: float = 0.0):
        if n_gpus < 1:
            raise ValueError(f"n_gpus must be >= 1, got {n_gpus}")
        self.gpu, self.model, self.engine, self.alpha = gpu, model, engine, float(alpha)
        self.n = n_gpus
        self.t = float(t0)
        self.static_bytes = model.weight_bytes_per_gpu + engine.runtime_reserve_bytes
        if self.static_bytes >= gpu.mem_bytes:
            raise ValueError(f"model {model.name} (tp={model.tp}) does not fit {gpu.name}: "
                             f"{self.static_bytes / GiB:.1f} GiB > {gpu.mem_bytes / GiB:.1f} GiB")
        self.kv = model.kv_bytes_per_token
        self.p_tok = 2 * model.params / (gpu.bf16_flops * gpu.prefill_mfu)  # s per prompt token
        self.w_time = model.weight_bytes_per_gpu / (gpu.hbm_bytes_per_s * gpu.bw_efficiency)
        self.kv_time = self.kv / (gpu.hbm_bytes_per_s * gpu.bw_efficiency)  # s per cached token
        self.flop_time = 2 * model.params / (gpu.bf16_flops * gpu.decode_mfu)  # s per batched token
        self.comm = 2 * model.layers * gpu.allreduce_s if model.tp > 1 else 0.0
        z = lambda: np.zeros(n_gpus)  # noqa: E731
        # queue (waiting for prefill): requests, prompt tokens (incl. recompute), output tokens
        self.qn, self.qtok, self.qout = z(), z(), z()
        self.qpmax = z()  # largest prompt waiting (sets the prefill stall of the next window)
        # running set: requests, remaining output tokens, context tokens in KV cache
        self.N, self.R, self.C = z(), z(), z()
        self.share, self.rollout_mem = z(), np.zeros(n_gpus, dtype=np.int64)
        self.rollout_running = np.zeros(n_gpus, dtype=bool)

    # ---- inputs ---------------------------------------------------------------------
    def set_rollout(self, gpus, compute_share=0.0, running=True, mem_bytes=0) -> None:
        """The lease of `gpus` (index, slice or index array): share, running, memory."""
        self.share[gpus] = np.clip(compute_share, 0.0, 1.0)
        self.rollout_running[gpus] = running
        room = self.gpu.mem_bytes - self.static_bytes
        self.rollout_mem[gpus] = np.clip(np.asarray(mem_bytes, dtype=np.int64), 0, room)

    def clear_rollout(self, gpus=slice(None)) -> None:
        self.set_rollout(gpus, 0.0, False, 0)

    # ---- the model ------------------------------------------------------------------
    def step_time(self, batch: np.ndarray, ctx_tokens: np.ndarray) -> np.ndarray:
        """One decode iteration (s) without interference: roofline + overhead."""
        mem = self.w_time + ctx_tokens * self.kv_time
        cmp = batch * self.flop_time
        return self.engine.step_overhead_s + np.maximum(mem, cmp) + self.comm

    def interference(self) -> np.ndarray:
        return 1.0 + self.alpha * self.share * self.rollout_running

    def kv_capacity_tokens(self) -> np.ndarray:
        return np.maximum(0, self.gpu.mem_bytes - self.static_bytes - self.rollout_mem) / self.kv

    def advance(self, t_until: float, gpu_idx=None, arrival_s=None, prompt_tokens=None,
                output_tokens=None) -> WindowStats:
        eng, G = self.engine, self.n
        t0, t1 = self.t, float(t_until)
        dt = t1 - t0
        if dt <= 0:
            raise ValueError(f"t_until {t1} must be after the window start {t0}")
        if gpu_idx is None:
            gi = np.zeros(0, dtype=np.int64)
            a = P = O = np.zeros(0)
        else:
            gi = np.asarray(gpu_idx, dtype=np.int64)
            a = np.asarray(arrival_s, dtype=np.float64)
            P = np.asarray(prompt_tokens, dtype=np.float64)
            O = np.asarray(output_tokens, dtype=np.float64)
        n_new = np.bincount(gi, minlength=G).astype(np.float64)

        f = self.interference()
        N, R, C = self.N, self.R, self.C
        s = self.step_time(N, C) * f  # decode step of this window
        s_pf = np.where(N > 0, s, (eng.step_overhead_s + self.comm) * f)  # step beside a chunk
        pf = self.p_tok * f

        # admission capacity this window: slots and KV tokens, freed by expected completions
        m = np.divide(R, N, out=np.ones(G), where=N > 0)
        k0 = np.divide(dt, s)
        done0 = N * -np.expm1(-k0 / np.maximum(m, 1e-9))
        ctx_mean = np.divide(C, N, out=np.zeros(G), where=N > 0)
        cap_n = eng.max_slots - N + done0
        cap_tok = self.kv_capacity_tokens() - C + done0 * ctx_mean
        need_n = self.qn + n_new
        need_tok = self.qtok + self.qn + np.bincount(gi, weights=P + 1.0, minlength=G)
        with np.errstate(divide="ignore", invalid="ignore"):
            stretch = np.maximum.reduce([
                np.ones(G),
                np.where(need_n > 0, need_n / np.maximum(cap_n, 1e-9), 1.0),
                np.where(need_tok > 0, need_tok / np.maximum(cap_tok, 1e-9), 1.0),
            ])
        stretch = np.minimum(stretch, MAX_STRETCH)

        # prefill service times: the carried queue as one job at t0, then the window's arrivals
        q_chunks = self.qn + self.qtok / eng.chunk_tokens
        S0 = stretch * (self.qtok * pf + q_chunks * s_pf)
        chunks = np.ceil(P / eng.chunk_tokens)
        Si = stretch[gi] * (P * pf[gi] + chunks * s_pf[gi])
        gall = np.concatenate([np.arange(G), gi])
        aall = np.concatenate([np.full(G, t0), np.clip(a, t0, t1)])
        Sall = np.concatenate([S0, Si])
        kind = np.concatenate([np.zeros(G, dtype=np.int8), np.ones(gi.size, dtype=np.int8)])
        order = np.lexsort((kind, aall, gall))
        g_s, a_s, S_s, arr = gall[order], aall[order], Sall[order], kind[order] == 1
        counts = np.bincount(g_s, minlength=G)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        X = np.empty_like(S_s)
        X[0] = 0.0
        X[1:] = S_s[:-1] - np.diff(a_s)
        X[starts] = 0.0
        Y = np.cumsum(X)
        Y -= np.repeat(Y[starts], counts)
        K = (Y.max() - Y.min()) + 1.0 if Y.size else 1.0
        Z = Y - K * g_s
        W = Z - np.minimum.accumulate(Z)
        finish = a_s + W + S_s  # prefill completion time of each job
        ends = starts + counts - 1
        w_end = np.maximum(0.0, finish[ends] - t1)  # work left at t1 (s)

        # TTFT p99 of the window's arrivals, per GPU (nearest rank)
        ttft = np.minimum(W + S_s, MAX_TTFT_S)[arr]
        g_arr = g_s[arr]
        idle_step = self.step_time(np.maximum(N, 1.0), C) * f
        ttft_p99 = w_end + idle_step  # a request arriving at t1 waits this beyond its own prefill
        if ttft.size:
            o2 = np.lexsort((ttft, g_arr))
            cnt = np.bincount(g_arr, minlength=G)
            st = np.concatenate([[0], np.cumsum(cnt)[:-1]])
            has = cnt > 0
            rank = st + np.ceil(P99 * cnt).astype(np.int64) - 1
            ttft_p99 = np.where(has, ttft[o2][np.where(has, rank, 0)], ttft_p99)
        ttft_p99 = np.minimum(ttft_p99, MAX_TTFT_S)

        # what prefill got through: the carried job a fraction, arrivals whole or not at all
        sigma0 = np.where(S0 > 0, np.clip(dt / np.where(S0 > 0, S0, 1.0), 0.0, 1.0), 1.0)
        served_arr = (finish <= t1)[arr]
        served = np.empty(gi.size, dtype=bool)
        served[order[arr] - G] = served_arr  # back to the caller's order
        wsv = served.astype(np.float64)
        adm_n = self.qn * sigma0 + np.bincount(gi, weights=wsv, minlength=G)
        adm_tok = self.qtok * sigma0 + np.bincount(gi, weights=P * wsv, minlength=G)
        adm_out = self.qout * sigma0 + np.bincount(gi, weights=O * wsv, minlength=G)
        busy_pf = np.minimum(dt, S0 * sigma0 + np.bincount(gi, weights=Si * wsv, minlength=G))
        n_pf_iters = q_chunks * sigma0 + np.bincount(gi, weights=chunks * wsv, minlength=G)
        p_max = np.zeros(G)
        np.maximum.at(p_max, gi[served], P[served])
        p_max = np.maximum(p_max, np.where(sigma0 * self.qn > 0, self.qpmax, 0.0))
        nsv = 1.0 - wsv
        unserved_max = np.zeros(G)
        np.maximum.at(unserved_max, gi[~served], P[~served])
        self.qpmax = np.maximum(np.where(sigma0 < 1, self.qpmax, 0.0), unserved_max)
        self.qn = self.qn * (1 - sigma0) + np.bincount(gi, weights=nsv, minlength=G)
        self.qtok = self.qtok * (1 - sigma0) + np.bincount(gi, weights=P * nsv, minlength=G)
        self.qout = self.qout * (1 - sigma0) + np.bincount(gi, weights=O * nsv, minlength=G)

        # decode of the running set over k iterations
        k = np.where(N > 0, n_pf_iters + np.maximum(0.0, dt - busy_pf) / s, 0.0)
        frac_left = np.exp(-k / np.maximum(m, 1e-9))
        done = N * (1 - frac_left)
        decoded = R * (1 - frac_left)
        C_new = np.maximum(0.0, C + decoded - done * ctx_mean)
        N_new, R_new = N - done, R - decoded
        stall = s + np.minimum(eng.chunk_tokens, p_max) * pf
        stalled_frac = np.divide(n_pf_iters, k, out=np.zeros(G), where=k > 0)
        tpot = np.where(stalled_frac >= 1 - P99, stall, s)
        tpot = np.where(N > 0, tpot, idle_step)

        # utilisation: prefill + time until the longest running request ends (+ rollout)
        harmonic = np.where(N > 0, np.log1p(N) + 0.5772, 0.0)
        dec_busy = np.minimum(np.maximum(0.0, dt - busy_pf), s * m * harmonic)
        util = np.clip((busy_pf + np.where(N > 0, dec_busy, 0.0)) / dt, 0.0, 1.0)
        rollout_busy = self.share * self.rollout_running
        util = util + (1 - util) * rollout_busy

        # admitted requests join the running set (their first token came from prefill), as far
        # as slots and KV cache allow; the rest wait in the queue (prefilled again later)
        room_n = np.maximum(0.0, eng.max_slots - N_new)
        room_tok = np.maximum(0.0, self.kv_capacity_tokens() - C_new)
        fit = np.minimum.reduce([np.ones(G), np.divide(room_n, adm_n, out=np.ones(G), where=adm_n > 0),
                                 np.divide(room_tok, adm_tok + adm_n, out=np.ones(G), where=adm_tok + adm_n > 0)])
        if (fit < 1).any():
            back = 1 - fit
            self.qn += adm_n * back
            self.qtok += adm_tok * back
            self.qout += adm_out * back
            self.qpmax = np.where(back > 0, np.maximum(self.qpmax, p_max), self.qpmax)
            adm_n, adm_tok, adm_out = adm_n * fit, adm_tok * fit, adm_out * fit
        N_new = N_new + adm_n
        R_new = R_new + np.maximum(0.0, adm_out - adm_n)
        C_new = C_new + adm_tok + adm_n
        # preempt what no longer fits (rollout memory grew) back to the queue, recomputed
        cap = self.kv_capacity_tokens()
        over = np.divide(C_new - cap, C_new, out=np.zeros(G), where=C_new > cap)
        over = np.clip(over, 0.0, 1.0)
        if over.any():
            self.qn += N_new * over
            self.qtok += C_new * over
            self.qout += R_new * over
            self.qpmax = np.where(over > 0, np.maximum(self.qpmax, ctx_mean + 1), self.qpmax)
            N_new, R_new, C_new = N_new * (1 - over), R_new * (1 - over), C_new * (1 - over)
        self.N, self.R, self.C = N_new, R_new, C_new
        self.t = t1

        mem_used = (self.static_bytes + np.floor(C_new * self.kv)).astype(np.int64) + self.rollout_mem
        mem_used = np.minimum(mem_used, self.gpu.mem_bytes)
        return WindowStats(
            t_start=t0, t_end=t1,
            ttft_p99_ms=ttft_p99 * 1000.0,
            tpot_p99_ms=tpot * 1000.0,
            rps=n_new / dt,
            queue_depth=np.rint(self.qn).astype(np.int64),
            gpu_util=util,
            mem_used_bytes=mem_used,
            rollout_mem_bytes=self.rollout_mem.copy(),
            mem_total_bytes=self.gpu.mem_bytes,
            running=self.N.copy(),
        )


# ---- load balancing and replay --------------------------------------------------------

NOMINAL_PREFILL_S_PER_TOKEN = 30e-6  # 7B on H100 (p above); only ranks queues in `spread`
NOMINAL_TPOT_S = 0.015


def spread(trace, n_gpus: int, seed: int = 0) -> np.ndarray:
    """GPU index of every request of `trace`, as a load balancer would assign them.

    Power of two choices (Mitzenmacher): for each request two GPUs are drawn (from `seed`)
    and it joins the one with fewer requests in the system, where a request stays in the
    system for its nominal time ``prompt × 30 µs + output × 15 ms``. This approximates
    join-shortest-queue without a model of each GPU, and is deterministic for a seed.
    Per-GPU lists: ``np.flatnonzero(gpu_of == g)``.
    """
    import heapq

    if n_gpus < 1:
        raise ValueError(f"n_gpus must be >= 1, got {n_gpus}")
    n = len(trace)
    if n_gpus == 1:
        return np.zeros(n, dtype=np.int32)
    rng = np.random.default_rng(seed)
    cand = rng.integers(0, n_gpus, size=(n, 2)).tolist()
    stay = (trace.prompt_tokens * NOMINAL_PREFILL_S_PER_TOKEN + trace.output_tokens * NOMINAL_TPOT_S).tolist()
    arr = trace.arrival_s.tolist()
    heaps: list[list[float]] = [[] for _ in range(n_gpus)]
    out = np.empty(n, dtype=np.int32)
    pop, push = heapq.heappop, heapq.heappush
    for i in range(n):
        t = arr[i]
        c1, c2 = cand[i]
        h1, h2 = heaps[c1], heaps[c2]
        while h1 and h1[0] <= t:
            pop(h1)
        while h2 and h2[0] <= t:
            pop(h2)
        c = c1 if len(h1) <= len(h2) else c2
        push(heaps[c], t + stay[i])
        out[i] = c
    return out


def windows(arrival_s: np.ndarray, period_s: float, t_end: float | None = None,
            t_start: float = 0.0) -> Iterator[tuple[float, slice]]:
    """(window end, slice of requests arriving in it) for consecutive windows of `period_s`.

    `arrival_s` must be sorted (Trace.arrival_s is). Windows run from `t_start` to `t_end`
    (default: the end of the window holding the last arrival).
    """
    if period_s <= 0:
        raise ValueError(f"period_s must be > 0, got {period_s}")
    if t_end is None:
        last = float(arrival_s[-1]) if len(arrival_s) else t_start - period_s
        t_end = t_start + (math.floor((last - t_start) / period_s) + 1) * period_s
    n_win = max(0, math.ceil((t_end - t_start) / period_s - 1e-9))
    edges = t_start + period_s * np.arange(n_win + 1)
    idx = np.searchsorted(arrival_s, edges, side="left")
    for w in range(n_win):
        yield float(edges[w + 1]), slice(int(idx[w]), int(idx[w + 1]))

