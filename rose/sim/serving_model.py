"""A deterministic queueing model of an LLM serving engine, one window at a time, for many GPUs.

Pure: no I/O, no wall clock, no randomness (only `spread` draws, from its seed). Used by
`rose agent --simulate`, `rose simulate` and the demo. One call to `ServingSim.advance`
moves every GPU of a fleet through one sampling window with a handful of numpy operations
(a roofline of each engine iteration with chunked prefill, a fluid FIFO prefill queue, a
decode running set, memory with an elastic KV cache, rollout interference from an interference
profile, rose.sim.interference; a tensor-parallel replica of several GPUs is one engine), so 1,000 GPUs × an hour of 0.5 s
windows runs in seconds. The model, its sources and its approximations: docs/simulator.md
"The serving model". GPU and model presets: `rose.sim.models`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from rose.config import GiB
from rose.sim.interference import InterferenceProfile, linear_profile
from rose.sim.models import EngineConfig, GpuSpec, ModelSize, deployed

ALPHA = 1.0  # serving slowdown per unit of rollout compute share without a profile (docs/simulator.md "Interference")
P99 = 0.99
MAX_TTFT_S = 3600.0  # a wait beyond an hour is reported as an hour (schema bound is 1e9 ms)
MAX_STRETCH = 1000.0  # demand/capacity stretch cap when admission is blocked


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
    """Every GPU of a fleet serving one model with continuous batching (docs/simulator.md "The serving model").

    The fleet's `n_gpus` GPUs form `replicas` engines of `tp` GPUs each (tensor parallel; the
    model's `tp`, or the default for the GPU, `rose.sim.models.serving_tp`); GPUs
    ``r*tp .. r*tp+tp-1`` are replica r. `advance(t_until, replica_idx, arrival_s,
    prompt_tokens, output_tokens)` takes the requests that arrive in [t, t_until) (any order;
    `replica_idx` says which replica each goes to: the GPU when tp = 1) and returns the window's
    WindowStats, one entry per GPU. `set_rollout` states the current lease of some GPUs.
    Interference: `profile` (rose.sim.interference), or without one the linear profile of `alpha`.
    """

    def __init__(
        self,
        gpu: GpuSpec,
        model: ModelSize,
        n_gpus: int = 1,
        *,
        engine: EngineConfig = EngineConfig(),
        alpha: float = ALPHA,
        profile: InterferenceProfile | None = None,
        t0: float = 0.0,
    ):
        if n_gpus < 1:
            raise ValueError(f"n_gpus must be >= 1, got {n_gpus}")
        model = deployed(model, gpu, 0, engine.runtime_reserve_bytes)
        tp = model.tp
        if n_gpus % tp:
            raise ValueError(f"{n_gpus} GPUs do not split into replicas of tp={tp} GPUs ({model.name} on {gpu.name})")
        self.gpu, self.model, self.engine, self.alpha = gpu, model, engine, float(alpha)
        self.profile = profile if profile is not None else linear_profile(self.alpha)
        self.n, self.tp, self.replicas = n_gpus, tp, n_gpus // tp
        self.t = float(t0)
        self.static_bytes = model.weight_bytes_per_gpu + engine.runtime_reserve_bytes  # per GPU
        if self.static_bytes >= gpu.mem_bytes:
            raise ValueError(
                f"model {model.name} (tp={tp}) does not fit {gpu.name}: "
                f"{self.static_bytes / GiB:.1f} GiB > {gpu.mem_bytes / GiB:.1f} GiB"
            )
        # a replica's rates: tp GPUs stream their weight and KV shards and share the FLOPs
        self.kv = model.kv_bytes_per_token_per_gpu(tp)  # bytes per context token on each GPU
        bw = gpu.hbm_bytes_per_s * gpu.bw_efficiency
        self.p_tok = 2 * model.flop_params / (tp * gpu.bf16_flops * gpu.prefill_mfu)  # s per prompt token
        self.w_time = model.weight_bytes_per_gpu / bw
        self.kv_time = self.kv / bw  # s per cached token
        self.flop_time = 2 * model.flop_params / (tp * gpu.bf16_flops * gpu.decode_mfu)  # s per batched token
        self.comm = 2 * model.layers * gpu.allreduce_s if tp > 1 else 0.0
        z = lambda: np.zeros(self.replicas)  # noqa: E731
        # per replica. queue (waiting for prefill): requests, prompt tokens (incl. recompute), output tokens
        self.qn, self.qtok, self.qout = z(), z(), z()
        self.qpmax = z()  # largest prompt waiting (sets the prefill stall of the next window)
        # running set: requests, remaining output tokens, context tokens in KV cache
        self.N, self.R, self.C = z(), z(), z()
        # per GPU: the rollout lease on it
        self.share, self.rollout_mem = np.zeros(n_gpus), np.zeros(n_gpus, dtype=np.int64)
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
    def _worst(self, per_gpu: np.ndarray) -> np.ndarray:
        """Per replica, the largest value of its GPUs."""
        return per_gpu if self.tp == 1 else per_gpu.reshape(self.replicas, self.tp).max(axis=1)

    def _per_gpu(self, per_replica: np.ndarray) -> np.ndarray:
        return per_replica if self.tp == 1 else np.repeat(per_replica, self.tp)

    def step_time(self, batch: np.ndarray, ctx_tokens: np.ndarray) -> np.ndarray:
        """One decode iteration (s) of a replica without interference: roofline + overhead."""
        mem = self.w_time + ctx_tokens * self.kv_time
        cmp = batch * self.flop_time
        return self.engine.step_overhead_s + np.maximum(mem, cmp) + self.comm

    def interference(self) -> tuple[np.ndarray, np.ndarray]:
        """Per replica, serving's step time beside rollout over alone: (mean, p99) ratios of the
        profile at each GPU's running share, the replica's most slowed GPU (TP ranks meet at
        every all-reduce). A window holds tens to hundreds of steps: its progress goes at the
        mean, its token-weighted p99 is the per-step distribution's p99
        (rose.sim.interference.StepMultiplier; docs/simulator.md "Interference")."""
        x = self.share * self.rollout_running
        return self._worst(self.profile.serving_mean_ratio(x)), self._worst(self.profile.serving_p99_ratio(x))

    def kv_capacity_tokens(self) -> np.ndarray:
        """Per replica: context tokens its KV cache can hold (every rank holds its share of each
        token, so the GPU with the least room sets it)."""
        return np.maximum(0, self.gpu.mem_bytes - self.static_bytes - self._worst(self.rollout_mem)) / self.kv

    def advance(
        self, t_until: float, replica_idx=None, arrival_s=None, prompt_tokens=None, output_tokens=None
    ) -> WindowStats:
        eng, G = self.engine, self.replicas
        t0, t1 = self.t, float(t_until)
        dt = t1 - t0
        if dt <= 0:
            raise ValueError(f"t_until {t1} must be after the window start {t0}")
        if replica_idx is None:
            gi = np.zeros(0, dtype=np.int64)
            a = P = O = np.zeros(0)
        else:
            gi = np.asarray(replica_idx, dtype=np.int64)
            a = np.asarray(arrival_s, dtype=np.float64)
            P = np.asarray(prompt_tokens, dtype=np.float64)
            O = np.asarray(output_tokens, dtype=np.float64)
        n_arr = np.bincount(gi, minlength=G)  # arrivals per replica
        n_new = n_arr.astype(np.float64)

        f, f99 = self.interference()
        kv_cap = self.kv_capacity_tokens()  # rollout memory is fixed for the window
        N, R, C = self.N, self.R, self.C
        busy = N > 0
        s = self.step_time(N, C) * f  # decode step of this window
        s_pf = np.where(busy, s, (eng.step_overhead_s + self.comm) * f)  # step beside a chunk
        pf = self.p_tok * f

        # admission capacity this window: slots and KV tokens, freed by expected completions
        m = np.divide(R, N, out=np.ones(G), where=busy)
        k0 = np.divide(dt, s)
        done0 = N * -np.expm1(-k0 / np.maximum(m, 1e-9))
        ctx_mean = np.divide(C, N, out=np.zeros(G), where=busy)
        cap_n = eng.max_slots - N + done0
        cap_tok = kv_cap - C + done0 * ctx_mean
        need_n = self.qn + n_new
        need_tok = self.qtok + self.qn + np.bincount(gi, weights=P + 1.0, minlength=G)
        with np.errstate(divide="ignore", invalid="ignore"):
            stretch = np.maximum.reduce(
                [
                    np.ones(G),
                    np.where(need_n > 0, need_n / np.maximum(cap_n, 1e-9), 1.0),
                    np.where(need_tok > 0, need_tok / np.maximum(cap_tok, 1e-9), 1.0),
                ]
            )
        stretch = np.minimum(stretch, MAX_STRETCH)

        # prefill service times: the carried queue as one job at t0, then the window's arrivals
        q_chunks = self.qn + self.qtok / eng.chunk_tokens
        S0 = stretch * (self.qtok * pf + q_chunks * s_pf)
        chunks = np.ceil(P / eng.chunk_tokens)
        Si = stretch[gi] * (P * pf[gi] + chunks * s_pf[gi])
        # every job in (replica, start time, carried job first) order: `order` indexes the
        # carried jobs (0..G-1) followed by the arrivals (G..), `arr` marks the arrivals
        a_in = np.clip(a, t0, t1)
        aall = np.concatenate([np.full(G, t0), a_in])
        Sall = np.concatenate([S0, Si])
        counts = n_arr + 1
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        if not (a_in[1:] < a_in[:-1]).any():
            # arrivals in time order (as windows() and the request stream give them): that order
            # is each replica's carried job, then its arrivals as given (a stable sort by replica)
            n_jobs = G + gi.size
            arr = np.ones(n_jobs, dtype=bool)
            arr[starts] = False
            order = np.empty(n_jobs, dtype=np.int64)
            order[starts] = np.arange(G)
            caller = np.argsort(gi.astype(np.uint16) if G <= 1 << 16 else gi, kind="stable")
            order[arr] = G + caller
            g_s = np.repeat(np.arange(G), counts)
        else:
            gall = np.concatenate([np.arange(G), gi])
            kind = np.concatenate([np.zeros(G, dtype=np.int8), np.ones(gi.size, dtype=np.int8)])
            order = np.lexsort((kind, aall, gall))
            g_s, arr = gall[order], kind[order] == 1
            caller = order[arr] - G
        # `caller`: the caller's index of each arrival in this order
        a_s, S_s = aall[order], Sall[order]
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
        ttft = np.minimum(W + S_s, MAX_TTFT_S)[arr]  # arrivals, grouped by replica
        idle_step = self.step_time(np.maximum(N, 1.0), C) * f99
        ttft_p99 = w_end + idle_step  # a request arriving at t1 waits this beyond its own prefill
        if ttft.size:
            cnt = n_arr
            has = cnt > 0
            rank = np.ceil(P99 * cnt).astype(np.int64) - 1  # nearest rank within the replica
            g_arr = gi[caller]
            if (rank[has] == cnt[has] - 1).all():  # fewer than 100 arrivals each: the p99 is the largest
                top = np.full(G, -np.inf)
                np.maximum.at(top, g_arr, ttft)
                ttft_p99 = np.where(has, top, ttft_p99)
            else:
                o2 = np.lexsort((ttft, g_arr))
                st = np.concatenate([[0], np.cumsum(cnt)[:-1]])
                ttft_p99 = np.where(has, ttft[o2][np.where(has, st + rank, 0)], ttft_p99)
        ttft_p99 = np.minimum(ttft_p99, MAX_TTFT_S)

        # what prefill got through: the carried job a fraction, arrivals whole or not at all
        sigma0 = np.where(S0 > 0, np.clip(dt / np.where(S0 > 0, S0, 1.0), 0.0, 1.0), 1.0)
        served_arr = (finish <= t1)[arr]
        served = np.empty(gi.size, dtype=bool)
        served[caller] = served_arr  # back to the caller's order
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
        k = np.where(busy, n_pf_iters + np.maximum(0.0, dt - busy_pf) / s, 0.0)
        frac_left = np.exp(-k / np.maximum(m, 1e-9))
        done = N * (1 - frac_left)
        decoded = R * (1 - frac_left)
        C_new = np.maximum(0.0, C + decoded - done * ctx_mean)
        N_new, R_new = N - done, R - decoded
        s99 = self.step_time(N, C) * f99  # the p99 of a decode step
        stall = s99 + np.minimum(eng.chunk_tokens, p_max) * pf
        stalled_frac = np.divide(n_pf_iters, k, out=np.zeros(G), where=k > 0)
        tpot = np.where(stalled_frac >= 1 - P99, stall, s99)
        tpot = np.where(busy, tpot, idle_step)

        # utilisation: prefill + time until the longest running request ends (+ rollout)
        harmonic = np.where(busy, np.log1p(N) + 0.5772, 0.0)
        dec_busy = np.minimum(np.maximum(0.0, dt - busy_pf), s * m * harmonic)
        util = np.clip((busy_pf + np.where(busy, dec_busy, 0.0)) / dt, 0.0, 1.0)

        # admitted requests join the running set (their first token came from prefill), as far
        # as slots and KV cache allow; the rest wait in the queue (prefilled again later)
        room_n = np.maximum(0.0, eng.max_slots - N_new)
        room_tok = np.maximum(0.0, kv_cap - C_new)
        fit = np.minimum.reduce(
            [
                np.ones(G),
                np.divide(room_n, adm_n, out=np.ones(G), where=adm_n > 0),
                np.divide(room_tok, adm_tok + adm_n, out=np.ones(G), where=adm_tok + adm_n > 0),
            ]
        )
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
        cap = kv_cap
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

        # per GPU: every rank of a replica reports the replica's latency, load and KV share
        each = self._per_gpu
        util = each(util)
        util = util + (1 - util) * (self.share * self.rollout_running)
        mem_used = (self.static_bytes + np.floor(each(C_new) * self.kv)).astype(np.int64) + self.rollout_mem
        mem_used = np.minimum(mem_used, self.gpu.mem_bytes)
        return WindowStats(
            t_start=t0,
            t_end=t1,
            ttft_p99_ms=each(ttft_p99 * 1000.0),
            tpot_p99_ms=each(tpot * 1000.0),
            rps=each(n_new / dt),
            queue_depth=each(np.rint(self.qn).astype(np.int64)),
            gpu_util=util,
            mem_used_bytes=mem_used,
            rollout_mem_bytes=self.rollout_mem.copy(),
            mem_total_bytes=self.gpu.mem_bytes,
            running=each(self.N.copy()),
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


def windows(
    arrival_s: np.ndarray, period_s: float, t_end: float | None = None, t_start: float = 0.0
) -> Iterator[tuple[float, slice]]:
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
