"""The trace mapped onto the cluster: what a request costs a GPU, the load that sizes the fleet,
the serving SLO, the arrivals of every window and their balancing over GPUs.

Pure apart from seeded draws. The mapping (roofline capacity, time compression, shifted
copies, power-of-two-choices balancing) and the SLO rule: docs/simulator.md "Load mapping"
and "SLO".
"""

from __future__ import annotations

import math

import numpy as np

from rose.contract.events import Latency
from rose.sim.serving_model import ServingSim
from rose.sim.traces import Trace

PEAK_BIN_S = 60.0  # the provisioning time scale: capacity is sized for the busiest minute
B_REF = 32  # running requests at which the capacity estimate amortises a decode step
COPY_JITTER_S = 60.0  # trace copies are shifted by uniform offsets in [0, this)
LONG_TRACE_S = 3600.0  # traces longer than this are compressed to span it
TTFT_SLO_SCALE = 5.0  # × unloaded TTFT of the trace's p99 prompt
TPOT_SLO_SCALE = 2.0  # × unloaded decode step beside a full prefill chunk


def roofline_costs_s(sim: ServingSim, prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
    """Replica-seconds of compute each request costs at the roofline (docs/simulator.md "Load mapping")."""
    P = prompt.astype(np.float64)
    O = output.astype(np.float64)
    ctx = B_REF * float(np.mean(P + O / 2)) if P.size else 0.0
    step = float(sim.step_time(np.array([B_REF]), np.array([ctx]))[0])
    return P * sim.p_tok + np.ceil(P / sim.engine.chunk_tokens) * sim.engine.step_overhead_s + O * step / B_REF


def kv_costs_s(sim: ServingSim, prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
    """Replica-seconds of the whole KV cache each request holds (docs/simulator.md "Load mapping"):
    its context, ``P + O/2`` on average while it decodes, for its ``O`` decode steps, over the
    replica's KV capacity. The step is the one of a full KV cache holding the output-weighted
    mean request (Little's law: ``B = cap × E[O] / E[O (P + O/2)]`` requests decoding)."""
    P = prompt.astype(np.float64)
    O = output.astype(np.float64)
    cap = float(sim.kv_capacity_tokens()[0])
    held = O * (P + O / 2)  # context token-steps
    if not P.size or cap <= 0 or held.sum() <= 0:
        return np.zeros(P.size)
    batch = cap * float(O.sum()) / float(held.sum())
    step = float(sim.step_time(np.array([batch]), np.array([cap]))[0])
    return held * step / cap


def request_costs_s(sim: ServingSim, prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
    """GPU-seconds each request costs on the resource that binds first (the larger mean): the
    roofline's compute or the KV cache's memory; a replica's seconds count for its tp GPUs."""
    roof, kv = roofline_costs_s(sim, prompt, output), kv_costs_s(sim, prompt, output)
    return sim.tp * (kv if kv.sum() > roof.sum() else roof)


def capacity_bound(sim: ServingSim, prompt: np.ndarray, output: np.ndarray) -> str:
    """Which resource sizes a serving GPU's request rate for this trace: 'roofline' or 'kv'."""
    return "kv" if kv_costs_s(sim, prompt, output).sum() > roofline_costs_s(sim, prompt, output).sum() else "roofline"


def peak_to_mean(trace: Trace, costs: np.ndarray, duration_s: float, compress: float) -> float:
    """Busiest minute's GPU-seconds over the mean minute, in the part of the trace the run plays."""
    t = trace.arrival_s / compress
    span = float(t[-1]) if t.size else 0.0
    upto = min(duration_s, span) if span > 0 else duration_s
    sel = t <= upto
    bins = np.bincount(np.floor(t[sel] / PEAK_BIN_S).astype(np.int64), weights=costs[sel])
    n_bins = max(1, math.ceil(upto / PEAK_BIN_S))
    mean = float(bins.sum()) / n_bins
    return float(bins.max()) / mean if mean > 0 else 1.0


def slo_for(sim: ServingSim, trace: Trace) -> Latency:
    """The serving SLO (ms) of this model on this GPU for this trace (docs/simulator.md "SLO")."""
    p99 = float(np.percentile(trace.prompt_tokens, 99))
    idle = float(sim.step_time(np.array([1.0]), np.array([0.0]))[0])
    ttft = p99 * sim.p_tok + math.ceil(p99 / sim.engine.chunk_tokens) * idle
    tpot = idle + sim.engine.chunk_tokens * sim.p_tok
    return Latency(round(TTFT_SLO_SCALE * ttft * 1000, 3), round(TPOT_SLO_SCALE * tpot * 1000, 3))


def trace_compression(trace: Trace) -> float:
    """Time compression of a trace longer than LONG_TRACE_S (1: played as recorded)."""
    return trace.duration_s / LONG_TRACE_S if trace.duration_s > LONG_TRACE_S else 1.0


class RequestStream:
    """The trace mapped onto the cluster: per window, the arrivals (docs/simulator.md "Load mapping")."""

    def __init__(self, trace: Trace, need_rps: float, duration_s: float, seed: int):
        if len(trace) == 0:
            raise ValueError("trace has no requests")
        self.compress = trace_compression(trace)
        a = trace.arrival_s / self.compress
        gap = (a[-1] / (len(a) - 1)) if len(a) > 1 else 1.0
        period = float(a[-1]) + gap  # the loop length: the next lap starts one mean gap later
        rate = len(a) / period
        self.trace_rps = rate
        self.copies = max(1, math.ceil(need_rps / rate))
        self.keep = float(min(1.0, need_rps / (self.copies * rate)))
        rng = np.random.default_rng([seed, 1])
        self.offsets = np.sort(rng.uniform(0.0, COPY_JITTER_S, self.copies))
        laps = np.arange(-1, math.ceil(duration_s / period) + 1)
        self.base_t = (a[None, :] + laps[:, None] * period).ravel()
        self.base_i = np.tile(np.arange(len(a)), len(laps))
        self.P, self.O = trace.prompt_tokens, trace.output_tokens
        self.seed = seed

    def window(self, w: int, t0: float, t1: float):
        """(arrival_s, prompt, output) of the requests in [t0, t1), sorted by arrival."""
        lo = np.searchsorted(self.base_t, t0 - COPY_JITTER_S, side="left")
        hi = np.searchsorted(self.base_t, t1, side="left")
        bt = self.base_t[lo:hi]
        # copy j holds base request i in this window iff t0 <= bt_i + off_j < t1
        j0 = np.searchsorted(self.offsets, t0 - bt, side="left")
        j1 = np.searchsorted(self.offsets, t1 - bt, side="left")
        n = j1 - j0
        tot = int(n.sum())
        if tot == 0:
            z = np.zeros(0)
            return z, z, z
        rep = np.repeat(np.arange(bt.size), n)
        first = np.repeat(np.cumsum(n) - n, n)
        j = np.repeat(j0, n) + (np.arange(tot) - first)
        t = bt[rep] + self.offsets[j]
        src = self.base_i[lo:hi][rep]
        if self.keep < 1.0:
            keep = np.random.default_rng([self.seed, 2, w]).random(tot) < self.keep
            t, src = t[keep], src[keep]
        o = np.argsort(t, kind="stable")
        t, src = t[o], src[o]
        return t, self.P[src].astype(np.float64), self.O[src].astype(np.float64)


def two_choices(w: int, n_req: int, n_replicas: int, seed: int) -> np.ndarray | None:
    """The two replicas drawn for each request of window `w` (None for one replica): the same
    draws for every policy, so a caller balancing several fleets draws them once."""
    if n_replicas == 1:
        return None
    return np.random.default_rng([seed, 3, w]).integers(0, n_replicas, size=(n_req, 2))


def balance(
    w: int,
    n_req: int,
    in_system: np.ndarray,
    seed: int,
    choices: np.ndarray | None = None,
    admitting: np.ndarray | None = None,
) -> np.ndarray:
    """Power of two choices on the load reported at the window start (same draws per policy);
    `choices`: `two_choices(w, n_req, in_system.size, seed)` when the caller drew them already.
    `admitting` (per replica; None: all): the replicas the router sends requests to; while some
    are out (lent), the two choices are drawn among the others (their own seeded draws)."""
    if admitting is not None and not admitting.all():
        inside = np.flatnonzero(admitting)
        if inside.size == 1:
            return np.full(n_req, inside[0], dtype=np.int64)
        pick = np.random.default_rng([seed, 3, w, 1]).integers(0, inside.size, size=(n_req, 2))
        a, b = inside[pick[:, 0]], inside[pick[:, 1]]
        return np.where(in_system[a] <= in_system[b], a, b)
    G = in_system.size
    if G == 1:
        return np.zeros(n_req, dtype=np.int64)
    c = two_choices(w, n_req, G, seed) if choices is None else choices
    assert c is not None  # drawn for G > 1 replicas
    c0, c1 = c[:, 0], c[:, 1]
    return np.where(in_system[c0] <= in_system[c1], c0, c1)
