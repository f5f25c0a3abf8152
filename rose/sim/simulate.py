"""`rose simulate`: a serving cluster driven by a real request trace, plus an agentic RL job,
under four rollout policies (the paper's baselines and ROSE). Pure apart from reading the trace.

Every policy runs over the same windows (the telemetry period, 0.5 s) and the same requests.
Serving is `rose.serving_model.ServingSim` (vectorised over GPUs); the ROSE policy is
`rose.lease_policy.decide`, the very function the scheduler runs, fed one
`rose.events.Telemetry` per serving GPU per window.

Load mapping (trace -> N GPUs)
------------------------------
A GPU's request capacity comes from the serving model's roofline for the trace's mean request:
``cost = P·p + ceil(P/chunk)·overhead + O·step(B_ref)/B_ref`` GPU-seconds (P, O the mean prompt
and output tokens, p the prefill time per token, ``B_ref = 32`` running requests); a GPU is
offered ``load / cost`` requests/s (``--load``, default 0.5: half the roofline, the paper's
"20–40 % of compute idle" once decode batching inefficiency is counted). The cluster needs
``N × that``. A trace longer than an hour is first time-compressed to span an hour (the BurstGPT
slices span 10–11 h with 400 requests). Then the trace is looped and replicated ``k = ceil(need /
trace rate)`` times, each copy shifted by its own uniform offset in [0, 60 s) (from the seed), and
each request of a copy kept with probability ``need / (k × trace rate)``. The aggregate keeps the
trace's shape above a minute (bursts, diurnal drift) and its token mix; below a minute the copies
interleave like independent users. Requests go to GPUs by power-of-two choices on the requests
in system reported at the window start (Mitzenmacher: two choices stays balanced with stale load
information, which is what a real balancer has); `serving_model.spread` is the exact per-request
version but runs a Python loop per request, too slow for the 29 M requests of 1,000 GPUs × 1 h.

SLO (per model and GPU, from the same roofline): TTFT p99 ≤ ``TTFT_SLO_SCALE`` × the unloaded
TTFT of the trace's p99 prompt; TPOT p99 ≤ ``TPOT_SLO_SCALE`` × the unloaded worst inter-token
time (a decode step beside a full prefill chunk). An operator sets SLOs the serving meets on its
own; the static baseline's attainment is the reference.

The agentic RL job (`EpisodeModel`)
-----------------------------------
ReAct-style episodes of ``turns`` turns: the first prefills ``prompt_tokens``, every turn
generates ``gen_tokens`` then waits ``tool_s`` for a tool that appends ``obs_tokens``. The RL
policy has the size of `--model-size` and runs like the served model (same GPU, same tensor
parallel degree, same roofline). A rollout GPU runs ``B`` episodes concurrently; each reserves
KV for its longest context, so ``B = min(batch, (mem - weights/tp - reserve) / (ctx_max × kv))``;
a lease too small to hold the policy weights and one episode cannot run rollout (counted as
`leases_unusable`). Rate of a GPU with B episodes: ``B / duration(B)`` with
``duration = turns × (prefill + gen × step(B_dec) + tool)``, ``B_dec`` the episodes decoding
(fixed point of the decode/tool split). A leased share runs at ``compute_share × rate(B)``, and
only while its lease is active and not paused. The trainer takes ``episodes_per_step``
episodes per RL step; training overlaps the next step's rollout (one-step off-policy, as
asynchronous agentic RL runs), so RL steps/h = episodes/h ÷ episodes_per_step.

Work ledger (fluid, exact): a slot (the dedicated pool, an elastic GPU, a lease) holds in-flight
work ``w`` (episode units). Its first ``B/2`` units fill the pipeline (staggered episodes are
half done on average); beyond that every whole unit is a completed episode. When a lease ends
(revoke or expiry) its episodes stop at their last finished turn and are pushed back as
continuations (`rose.rollout.episode.Episode.continuation`): the slot's ``w`` is parked minus
the turn in progress (half a turn per episode on average, ``B / (2 × turns)`` units, counted as
`work_recomputed`); the dedicated pool (or the next slot to start, without one) resumes parked
work first. So ``produced = completed + in flight + parked + recomputed`` at every window, and
``completed = consumed by the trainer + buffered``.

Policies
--------
* ``static``: a dedicated rollout pool of M GPUs. Serving runs alone.
* ``elastic``: the static pool plus whole external GPUs, requested while the rollout backlog
  of the current RL step would take longer than ``ELASTIC_TARGET_STEP_FRAC`` of the static
  pool's step time; each arrives ``ELASTIC_PROVISION_S`` (180 s) after its request, at most
  ``ELASTIC_CAP_FRAC × M`` at once (the cost cap; they are paid GPU-hours, reported).
* ``share-all``: every serving GPU lends ``SHARE_ALL_SHARE`` of its compute and half of the
  memory serving does not hold at start, from the first window, never revoked: the SLO is
  ignored. Serving sees the interference and the smaller KV room (preemptions).
* ``rose``: the static pool plus leases. Each window, every serving GPU's telemetry goes through
  `decide()`; a grant or revoke decided at the end of window w takes effect in window w+1 (the
  command's Kafka hop is milliseconds, the window 0.5 s). The executor's local guard
  (`rose.guard`) reads the same per-window latency sample the agent writes for it: when a
  leased GPU's headroom falls below the guard's trip level (the policy's revoke headroom) the
  rollout is paused from the next window without waiting for the command, and resumes once
  headroom is back at the clear level (the grant headroom); a paused rollout keeps its memory
  and makes no progress. While rollout runs with share x, serving is slowed by the serving
  model's interference ``1 + alpha·x`` (alpha from `rose bench interference`: ALPHA_MEASURED,
  or a result file given to the CLI).

Exact shortcut in the policy calls. A GPU with no lease whose window has headroom below the
grant threshold cannot be granted anything, and a run of such events leaves the policy's view
exactly as its last two alone would (streak 0, the last event's time and latencies, the one
before as the trend predictor's third sample); `tests/test_simulate.py` checks that equivalence
against `decide` itself. So for such a GPU the simulator defers the call and, before the GPU's
next eligible or leased window, hands `decide` only the last two deferred events. Optionally (`decide_every` > 1) the policy sees one telemetry event
per `decide_every` windows carrying the worst p99 of those windows (a longer telemetry period);
the default is every window.

Weight sync per RL step: every GPU running rollout at the step receives the policy weights
(its tensor-parallel shard): a full bf16 copy for the baselines, ROSE's lossless delta
(`weight_delta_ratio` of full, measured by `rose bench weights`: WEIGHT_DELTA_RATIO, or a
result file given to the CLI) for ROSE; every slot that starts (a lease, an external GPU) first
receives a full copy, except that a serving node keeps the last weights it held in host memory,
so a GPU leased again fetches only the deltas it missed (at most a full copy).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from rose.config import PolicyConfig
from rose.contract.events import Latency, Telemetry
from rose.policy.lease_policy import GpuView, decide
from rose.sim.serving_model import EngineConfig, ServingSim, gpu_spec, model_size
from rose.sim.traces import Trace

POLICIES = ("static", "elastic", "share-all", "rose")

PERIOD_S = 0.5  # telemetry period (TelemetryConfig.period_s), one serving window
DEFAULT_LOAD = 0.7  # fraction of a GPU's roofline capacity the trace's busiest minute uses
PEAK_BIN_S = 60.0  # the provisioning time scale: capacity is sized for the busiest minute
B_REF = 32  # running requests at which the capacity estimate amortises a decode step
COPY_JITTER_S = 60.0  # trace copies are shifted by uniform offsets in [0, this)
LONG_TRACE_S = 3600.0  # traces longer than this are compressed to span it
TTFT_SLO_SCALE = 5.0  # × unloaded TTFT of the trace's p99 prompt
TPOT_SLO_SCALE = 2.0  # × unloaded decode step beside a full prefill chunk
SHARE_ALL_SHARE = 0.5  # = PolicyConfig.max_compute_share: the most ROSE would ever lend
SHARE_ALL_MEM_FRAC = 0.5  # of the memory serving does not hold at start
ELASTIC_PROVISION_S = 180.0  # request -> usable external GPU (VM/pod start, image, weights)
ELASTIC_CAP_FRAC = 0.25  # cost cap: external GPUs at once, as a fraction of the static pool
ELASTIC_TARGET_STEP_FRAC = 0.8  # add GPUs while a step would take longer than this × static's
# Measured defaults (the JSON behind each is in docs/paper-check/; pass a fresh result file to
# `rose simulate --interference-bench / --weights-bench` to use your own):
# `rose bench interference --quick --json` on this project's 2-core CPU box: a serving step's p99
# beside an unprotected rollout worker is 4.157× its p99 alone -> alpha = 3.157 (see `calibration`).
ALPHA_MEASURED = 3.157
# `rose bench weights --quick --json`: lossless delta bytes per RL step / full bf16 = 0.02128.
WEIGHT_DELTA_RATIO = 0.02128
DECIDE_CALLS_BUDGET = 2_000_000  # decide() costs ~12 µs a call in CPython: ~25 s of a run
SLO_TOLERANCE = 0.005  # ROSE's attainment counts as equal to static's within this


@dataclass(frozen=True)
class EpisodeModel:
    """One agentic episode (ReAct-style tool use) and the RL step that consumes them."""

    turns: int = 8
    prompt_tokens: int = 1024  # task + system prompt, prefilled once
    gen_tokens: int = 256  # generated per turn (thought + action)
    obs_tokens: int = 384  # tool observation appended per turn, prefilled
    tool_s: float = 2.0  # tool latency per turn (code run, search, API)
    batch: int = 64  # concurrent episodes a dedicated rollout GPU runs at most
    episodes_per_step: int = 256  # e.g. 32 tasks × 8 samples (GRPO group)

    @property
    def ctx_max(self) -> int:
        return self.prompt_tokens + self.turns * (self.gen_tokens + self.obs_tokens)


@dataclass(frozen=True)
class SimConfig:
    n_gpus: int = 64
    dedicated: int = 0  # 0: n_gpus // 8 (at least 1)
    model: str = "7B"
    gpu: str = "H100"
    duration_s: float = 0.0  # 0: the trace's span, at most an hour
    seed: int = 0
    load: float = DEFAULT_LOAD
    period_s: float = PERIOD_S
    decide_every: int = 0  # 0: auto (every window up to DECIDE_CALLS_BUDGET calls, then coarser)
    alpha: float = ALPHA_MEASURED
    alpha_source: str = "rose bench interference --quick on 2 CPU cores (docs/paper-check/interference.json)"
    weight_delta_ratio: float = WEIGHT_DELTA_RATIO
    weight_ratio_source: str = "rose bench weights --quick (docs/paper-check/weights.json)"
    check_invariants: bool = False  # assert the simulator's invariants every window (tests)
    policies: tuple[str, ...] = POLICIES
    episode: EpisodeModel = field(default_factory=EpisodeModel)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    record_series: bool = True  # per-window series for plots

    @property
    def pool(self) -> int:
        return self.dedicated if self.dedicated > 0 else max(1, self.n_gpus // 8)


# ---- the cost models ---------------------------------------------------------------------

class RolloutModel:
    """Episode rate of one GPU running B concurrent episodes, from the serving roofline."""

    def __init__(self, sim: ServingSim, ep: EpisodeModel, reserve_bytes: int):
        self.ep, self.sim = ep, sim
        self.weights = sim.model.weight_bytes_per_gpu
        self.reserve = reserve_bytes
        self.kv_episode = ep.ctx_max * sim.kv
        self.rate_by_batch = np.array([self._rate(b) for b in range(ep.batch + 1)])

    def _rate(self, b: int) -> float:
        if b <= 0:
            return 0.0
        ep, sim = self.ep, self.sim
        prefill = (ep.prompt_tokens / ep.turns + ep.obs_tokens) * sim.p_tok
        ctx_avg = ep.prompt_tokens + ep.turns * (ep.gen_tokens + ep.obs_tokens) / 2
        f = 0.5
        for _ in range(30):  # fixed point of the share of episodes decoding
            bd = max(1.0, b * f)
            step = float(sim.step_time(np.array([bd]), np.array([bd * ctx_avg]))[0])
            dec = ep.gen_tokens * step
            f = (dec + prefill) / (dec + prefill + ep.tool_s)
        return b / (ep.turns * (prefill + dec + ep.tool_s))

    def batch_for(self, mem_bytes):
        """Concurrent episodes that fit `mem_bytes` (0: cannot run rollout)."""
        room = np.asarray(mem_bytes, dtype=np.float64) - self.weights - self.reserve
        return np.clip(np.floor(room / self.kv_episode), 0, self.ep.batch).astype(np.int64)

    def rate(self, mem_bytes, share=1.0):
        return self.rate_by_batch[self.batch_for(mem_bytes)] * share

    @property
    def dedicated_batch(self) -> int:
        return int(self.batch_for(self.sim.gpu.mem_bytes))

    @property
    def dedicated_rate(self) -> float:
        return float(self.rate(self.sim.gpu.mem_bytes))


def request_costs_s(sim: ServingSim, prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
    """GPU-seconds each request costs at the roofline (see module docstring)."""
    P = prompt.astype(np.float64)
    O = output.astype(np.float64)
    ctx = B_REF * float(np.mean(P + O / 2)) if P.size else 0.0
    step = float(sim.step_time(np.array([B_REF]), np.array([ctx]))[0])
    return P * sim.p_tok + np.ceil(P / sim.engine.chunk_tokens) * sim.engine.step_overhead_s + O * step / B_REF


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
    """The serving SLO (ms) of this model on this GPU for this trace (see module docstring)."""
    p99 = float(np.percentile(trace.prompt_tokens, 99))
    idle = float(sim.step_time(np.array([1.0]), np.array([0.0]))[0])
    ttft = p99 * sim.p_tok + math.ceil(p99 / sim.engine.chunk_tokens) * idle
    tpot = idle + sim.engine.chunk_tokens * sim.p_tok
    return Latency(round(TTFT_SLO_SCALE * ttft * 1000, 3), round(TPOT_SLO_SCALE * tpot * 1000, 3))


# ---- the request stream ------------------------------------------------------------------

def trace_compression(trace: Trace) -> float:
    """Time compression of a trace longer than LONG_TRACE_S (1: played as recorded)."""
    return trace.duration_s / LONG_TRACE_S if trace.duration_s > LONG_TRACE_S else 1.0


class RequestStream:
    """The trace mapped onto the cluster: per window, the arrivals (see module docstring)."""

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


def balance(w: int, n_req: int, in_system: np.ndarray, seed: int) -> np.ndarray:
    """Power of two choices on the load reported at the window start (same draws per policy)."""
    G = in_system.size
    if G == 1:
        return np.zeros(n_req, dtype=np.int64)
    c = np.random.default_rng([seed, 3, w]).integers(0, G, size=(n_req, 2))
    return np.where(in_system[c[:, 0]] <= in_system[c[:, 1]], c[:, 0], c[:, 1])


# ---- the work ledger ---------------------------------------------------------------------

class Ledger:
    """Episode work of one policy: produced = completed + in flight + parked + recomputed."""

    def __init__(self, ep: EpisodeModel):
        self.ep = ep
        self.produced = 0.0
        self.completed = 0
        self.parked = 0.0
        self.recomputed = 0.0

    def progress(self, w: np.ndarray, fill: np.ndarray, gain: np.ndarray) -> None:
        """Add `gain` to slots with in-flight work `w` (in place) and complete whole episodes."""
        self.produced += float(gain.sum())
        w += gain
        done = np.floor(np.maximum(0.0, w - fill))
        w -= done
        self.completed += int(done.sum())

    def park(self, w: np.ndarray, batch: np.ndarray) -> None:
        """Slots ending: their episodes go back as continuations, losing the turn in progress."""
        lost = np.minimum(w, batch / (2.0 * self.ep.turns))
        self.recomputed += float(lost.sum())
        self.parked += float((w - lost).sum())
        w[...] = 0.0

    def unpark(self, limit: float = math.inf) -> float:
        take = min(self.parked, limit)
        self.parked -= take
        return take

    def steps(self) -> int:
        return self.completed // self.ep.episodes_per_step


# ---- the policies' rollout side ----------------------------------------------------------

class Run:
    """The rollout side and the tallies of one policy."""

    def __init__(self, name: str, ctx: "_Ctx", sim: ServingSim | None):
        self.name, self.ctx, self.sim = name, ctx, sim  # sim None: serving shared (no rollout on it)
        self.ledger = Ledger(ctx.ep)
        self.ded_w = np.zeros(1)
        self.slo_ok_gpu_windows = self.gpu_windows = self.slo_ok_windows = self.windows = 0
        self.revokes = self.grants = self.expiries = self.guard_pauses = self.leases_unusable = 0
        self.decide_calls = 0
        self.weight_bytes = self.weight_bytes_full = 0.0
        self.lease_gpu_s = self.lease_share_s = self.ext_gpu_s = 0.0
        self.last_steps = 0
        self.min_free_bytes = 1 << 62
        self.series: dict[str, list] = {k: [] for k in (
            "t", "ttft_p99_max_ratio", "tpot_p99_max_ratio", "slo_ok_frac", "leased", "running", "episodes",
            "external_gpus")}
        self.load_weights(ctx.M)  # the dedicated pool loads the policy once

    def load_weights(self, n: int) -> None:
        self.weight_bytes += n * self.ctx.wfull
        self.weight_bytes_full += n * self.ctx.wfull

    # hooks
    def in_flight(self) -> float:
        return float(self.ded_w.sum())

    def rollout_gpus(self) -> int:
        return self.ctx.M

    def leased_counts(self) -> tuple[int, int]:
        return 0, 0

    def external(self) -> int:
        return 0

    def synced(self, steps: int) -> None:
        """Every rollout GPU now holds the weights of RL step `steps`."""

    def step(self, w: int, t1: float, st) -> None:
        """One window: the dedicated pool (resuming parked continuations first), then the rest."""
        c = self.ctx
        if c.M > 0:
            self.ded_w[0] += self.ledger.unpark()
            self.ledger.progress(self.ded_w, np.array([c.ded_fill]), np.array([c.ded_rate * c.dt]))
        self.extra(w, t1, st)

    def extra(self, w: int, t1: float, st) -> None:
        pass


class ElasticRun(Run):
    """Static pool + whole external GPUs on backlog, after a provisioning delay, under a cost cap."""

    def __init__(self, name, ctx, sim):
        super().__init__(name, ctx, sim)
        self.ext_w = np.zeros(0)
        self.requested: list[float] = []  # ready times of requested GPUs not yet arrived
        self.cap = max(1, math.floor(ELASTIC_CAP_FRAC * ctx.M))

    def in_flight(self) -> float:
        return float(self.ded_w.sum() + self.ext_w.sum())

    def rollout_gpus(self) -> int:
        return self.ctx.M + self.ext_w.size

    def external(self) -> int:
        return int(self.ext_w.size)

    def extra(self, w, t1, st):
        c, led = self.ctx, self.ledger
        arrived = sum(1 for t in self.requested if t <= t1)
        if arrived:
            self.requested = [t for t in self.requested if t > t1]
            fill = c.rollout.dedicated_batch / 2.0
            new = np.array([led.unpark(fill) for _ in range(arrived)])
            self.ext_w = np.concatenate([self.ext_w, new])
            self.load_weights(arrived)
        n = self.ext_w.size
        if n:
            led.progress(self.ext_w, np.full(n, c.rollout.dedicated_batch / 2.0),
                         np.full(n, c.rollout.dedicated_rate * c.dt))
            self.ext_gpu_s += n * c.dt
        backlog = c.ep.episodes_per_step - led.completed % c.ep.episodes_per_step
        per_gpu = c.rollout.dedicated_rate * ELASTIC_TARGET_STEP_FRAC * c.step_static_s
        want = min(self.cap, max(0, math.ceil(backlog / per_gpu) - c.M))
        more = want - n - len(self.requested)
        if more > 0:
            self.requested += [t1 + ELASTIC_PROVISION_S] * more


class ShareAllRun(Run):
    """Every serving GPU lends a fixed share and memory from the start; never revoked."""

    def __init__(self, name, ctx, sim):
        super().__init__(name, ctx, sim)
        room = ctx.gpu.mem_bytes - sim.static_bytes
        self.mem = np.full(ctx.G, int(room * SHARE_ALL_MEM_FRAC), dtype=np.int64)
        self.batch = ctx.rollout.batch_for(self.mem)
        self.usable = self.batch > 0
        self.w = np.zeros(ctx.G)
        self.leases_unusable = int((~self.usable).sum())
        sim.set_rollout(slice(None), SHARE_ALL_SHARE, self.usable, self.mem)
        self.load_weights(int(self.usable.sum()))

    def in_flight(self):
        return float(self.ded_w.sum() + self.w.sum())

    def rollout_gpus(self):
        return self.ctx.M + int(self.usable.sum())

    def leased_counts(self):
        return self.ctx.G, int(self.usable.sum())

    def extra(self, w, t1, st):
        c = self.ctx
        self.ledger.progress(self.w, self.batch / 2.0, c.rollout.rate(self.mem, SHARE_ALL_SHARE) * c.dt)
        self.lease_gpu_s += c.G * c.dt
        self.lease_share_s += float(self.usable.sum()) * SHARE_ALL_SHARE * c.dt


class RoseRun(Run):
    """Static pool + leases from `decide()`, applied by modelled executors with the local guard."""

    _PEND = ("ts", "util", "used", "rmem", "ttft", "tpot", "rps", "qd")

    def __init__(self, name, ctx, sim):
        super().__init__(name, ctx, sim)
        G = ctx.G
        self.views: list[GpuView | None] = [None] * G
        self.view_lease = np.zeros(G, dtype=bool)  # the policy's view holds a lease
        self.leased = np.zeros(G, dtype=bool)  # a lease is live on the executor
        self.mem = np.zeros(G, dtype=np.int64)
        self.share = np.zeros(G)
        self.exp = np.zeros(G)
        self.batch = np.zeros(G, dtype=np.int64)
        self.paused = np.zeros(G, dtype=bool)
        self.w = np.zeros(G)
        self.pending = np.zeros(G, dtype=bool)
        self.pend = {k: np.zeros(G) for k in self._PEND}
        self.pending2 = np.zeros(G, dtype=bool)  # a deferred event before the last one
        self.pend2 = {k: np.zeros(G) for k in self._PEND}
        self.acc_ttft = np.zeros(G)
        self.acc_tpot = np.zeros(G)
        self.version = np.full(G, -1, dtype=np.int64)  # policy version held by the node, -1 none
        self.grant_room: dict[int, int] = {}  # GPU -> free memory after margin at its grant (checks)

    def synced(self, steps: int) -> None:
        self.version[self.leased & (self.batch > 0)] = steps

    def in_flight(self):
        return float(self.ded_w.sum() + self.w.sum())

    def rollout_gpus(self):
        return self.ctx.M + int((self.leased & (self.batch > 0)).sum())

    def leased_counts(self):
        return int(self.leased.sum()), int(self.running().sum())

    def running(self) -> np.ndarray:
        return self.leased & ~self.paused & (self.batch > 0)

    def extra(self, w, t1, st):
        c, pc = self.ctx, self.ctx.policy
        run_mask = self.running()
        self.ledger.progress(self.w, self.batch / 2.0,
                             np.where(run_mask, c.rollout.rate(self.mem, self.share), 0.0) * c.dt)
        self.lease_gpu_s += float(self.leased.sum()) * c.dt
        self.lease_share_s += float(self.share[run_mask].sum()) * c.dt
        # the executor's local guard, on the window's latency sample
        h = np.minimum(1.0 - st.ttft_p99_ms / c.slo.ttft_p99, 1.0 - st.tpot_p99_ms / c.slo.tpot_p99)
        trip = self.leased & ~self.paused & (h < pc.revoke_headroom)
        self.guard_pauses += int(trip.sum())
        clear = self.paused & (h >= pc.grant_headroom)
        self.paused = (self.paused | trip) & ~clear
        # the scheduler, every `decide_every` windows, on the worst p99 of those windows
        np.maximum(self.acc_ttft, st.ttft_p99_ms, out=self.acc_ttft)
        np.maximum(self.acc_tpot, st.tpot_p99_ms, out=self.acc_tpot)
        if (w + 1) % c.decide_every and w != c.n_win - 1:
            return
        commands = self.decide_all(w, t1, st)
        self.acc_ttft[:] = 0.0
        self.acc_tpot[:] = 0.0
        self.apply(commands, t1)

    def decide_all(self, w: int, ts: float, st) -> list:
        c, pc, slo = self.ctx, self.ctx.policy, self.ctx.slo
        ttft, tpot = self.acc_ttft, self.acc_tpot
        h = np.minimum(1.0 - ttft / slo.ttft_p99, 1.0 - tpot / slo.tpot_p99)
        defer = ~self.view_lease & (h < pc.grant_headroom)
        vals = {"ts": ts, "util": st.gpu_util, "used": st.mem_used_bytes, "rmem": st.rollout_mem_bytes,
                "ttft": ttft, "tpot": tpot, "rps": st.rps, "qd": st.queue_depth}
        again = defer & self.pending
        for k, v in vals.items():
            self.pend2[k][again] = self.pend[k][again]
            self.pend[k][defer] = v[defer] if isinstance(v, np.ndarray) else v
        call = np.flatnonzero(~defer)
        first = call[self.pending[call]]
        self.pending2[defer] = again[defer]
        self.pending[defer] = True
        self.pending[call] = False
        pend, total = self.pend, st.mem_total_bytes
        late = set(first.tolist())
        util, used, rmem = st.gpu_util.tolist(), st.mem_used_bytes.tolist(), st.rollout_mem_bytes.tolist()
        rps, qd, lt, lp = st.rps.tolist(), st.queue_depth.tolist(), ttft.tolist(), tpot.tolist()
        out = []
        views = self.views
        for g in call.tolist():
            view = views[g]
            if g in late:  # the last two deferred events first: the view as if every one had been seen
                for p in ((self.pend2, pend) if self.pending2[g] else (pend,)):
                    ev = _telemetry(g, f"d{int(p['ts'][g] / c.dt)}", float(p["ts"][g]), float(p["util"][g]),
                                    total, int(p["used"][g]), int(p["rmem"][g]), float(p["ttft"][g]),
                                    float(p["tpot"][g]), slo, float(p["rps"][g]), int(p["qd"][g]))
                    view = decide(view, ev, pc).view
                    self.decide_calls += 1
            ev = _telemetry(g, w, ts, util[g], total, used[g], rmem[g], lt[g], lp[g], slo, rps[g], qd[g])
            d = decide(view, ev, pc)
            self.decide_calls += 1
            views[g] = d.view
            self.view_lease[g] = d.view.lease_id is not None
            for cmd in d.commands:
                out.append((g, cmd))
                if cmd.kind == "grant":
                    self.grant_room[g] = total - (used[g] - rmem[g]) - int(total * pc.mem_margin_frac)
        return out

    def apply(self, commands: list, t1: float) -> None:
        """The executors: expiry, then the commands; effective from the next window."""
        c = self.ctx
        ended = self.leased & (self.exp <= t1)
        self.expiries += int(ended.sum())
        self.leased &= ~ended
        granted = []
        for g, cmd in commands:
            if cmd.kind == "grant":
                if self.leased[g]:
                    ended[g] = True
                self.leased[g] = True
                self.mem[g], self.share[g], self.exp[g] = cmd.mem_bytes, cmd.compute_share, cmd.expires_at
                self.grants += 1
                granted.append(g)
            elif cmd.kind == "renew" and self.leased[g]:
                self.exp[g] = cmd.expires_at
            elif cmd.kind == "revoke":
                self.revokes += 1
                if self.leased[g]:
                    ended[g] = True
                self.leased[g] = False
        if ended.any():
            wv = self.w[ended]
            self.ledger.park(wv, self.batch[ended])
            self.w[ended] = wv
        gone = ~self.leased
        self.mem[gone], self.share[gone], self.batch[gone] = 0, 0.0, 0
        self.paused &= self.leased
        if granted:
            new = np.array(granted, dtype=np.int64)
            self.batch[new] = c.rollout.batch_for(self.mem[new])
            self.paused[new] = False
            ok = new[self.batch[new] > 0]
            self.leases_unusable += int(new.size - ok.size)
            # the node keeps the last weights it had in host memory: a GPU that held a lease
            # before only fetches the deltas it missed (never more than a full copy)
            missed = self.ledger.steps() - self.version[ok]
            full = float(c.wfull)
            self.weight_bytes += float(np.where(self.version[ok] < 0, full,
                                                np.minimum(full, missed * c.delta_ratio * full)).sum())
            self.weight_bytes_full += full * ok.size
            self.version[ok] = self.ledger.steps()
            for g in ok.tolist():  # resume parked continuations first
                self.w[g] = self.ledger.unpark(self.batch[g] / 2.0)
        # an executor starts no worker for a lease too small for the policy: it holds nothing
        self.sim.set_rollout(slice(None), self.share, self.running(), np.where(self.batch > 0, self.mem, 0))


@dataclass
class _Ctx:
    """What every policy run shares."""

    G: int
    M: int
    ep: EpisodeModel
    policy: PolicyConfig
    gpu: object
    rollout: RolloutModel
    slo: Latency
    dt: float
    n_win: int
    decide_every: int
    wfull: int
    ded_rate: float
    ded_fill: float
    step_static_s: float
    delta_ratio: float


_RUNS = {"static": Run, "elastic": ElasticRun, "share-all": ShareAllRun, "rose": RoseRun}


def _telemetry(g: int, w, ts: float, util: float, total: int, used: int, rollout: int, ttft: float,
               tpot: float, slo: Latency, rps: float, qd: int) -> Telemetry:
    return Telemetry(f"sim/{g}@{w}", ts, f"node-{g // 8}", f"sim/{g}", "serving",
                     0.0 if util < 0.0 else 1.0 if util > 1.0 else util, total, used, rollout,
                     Latency(ttft, tpot), slo, rps, qd)


def simulate(trace: Trace, cfg: SimConfig) -> dict:
    """Run every policy of `cfg.policies` on `trace`; the JSON-ready result."""
    t_wall = time.perf_counter()
    for p in cfg.policies:
        if p not in POLICIES:
            raise ValueError(f"unknown policy {p!r} (known: {', '.join(POLICIES)})")
    if cfg.n_gpus < 1:
        raise ValueError(f"n_gpus must be >= 1, got {cfg.n_gpus}")
    if cfg.decide_every < 0:
        raise ValueError(f"decide_every must be >= 0, got {cfg.decide_every}")
    gpu, model = gpu_spec(cfg.gpu), model_size(cfg.model)
    G, M, ep = cfg.n_gpus, cfg.pool, cfg.episode
    probe = ServingSim(gpu, model, 1, engine=cfg.engine)
    rollout = RolloutModel(probe, ep, cfg.engine.runtime_reserve_bytes)
    if rollout.dedicated_batch < 1:
        raise ValueError(f"model {model.name} leaves no room for one episode on {gpu.name}")
    slo = slo_for(probe, trace)
    costs = request_costs_s(probe, trace.prompt_tokens, trace.output_tokens)
    cost = float(costs.mean())
    duration = cfg.duration_s if cfg.duration_s > 0 else min(LONG_TRACE_S, max(trace.duration_s, cfg.period_s))
    n_win = max(1, math.ceil(duration / cfg.period_s - 1e-9))
    compress = trace_compression(trace)
    peak = peak_to_mean(trace, costs, n_win * cfg.period_s, compress)
    rps_gpu = cfg.load / cost / peak
    stream = RequestStream(trace, rps_gpu * G, n_win * cfg.period_s, cfg.seed)
    ded_rate = M * rollout.dedicated_rate
    every = cfg.decide_every or auto_decide_every(G, n_win, cfg.period_s, cfg.policy)
    ctx = _Ctx(G, M, ep, cfg.policy, gpu, rollout, slo, cfg.period_s, n_win, every,
               model.weight_bytes_per_gpu, ded_rate, M * rollout.dedicated_batch / 2.0,
               ep.episodes_per_step / ded_rate, cfg.weight_delta_ratio)

    want = [p for p in POLICIES if p in cfg.policies]
    sims: dict[str, ServingSim] = {}
    if {"static", "elastic"} & set(want):
        sims["base"] = ServingSim(gpu, model, G, engine=cfg.engine, alpha=cfg.alpha)
    for p in ("share-all", "rose"):
        if p in want:
            sims[p] = ServingSim(gpu, model, G, engine=cfg.engine, alpha=cfg.alpha)
    runs = {p: _RUNS[p](p, ctx, sims.get(p)) for p in want}
    series_every = max(1, n_win // 720)

    for w in range(n_win):
        t1 = (w + 1) * cfg.period_s
        arr, P, O = stream.window(w, w * cfg.period_s, t1)
        stats = {k: sim.advance(t1, balance(w, arr.size, sim.N + sim.qn, cfg.seed), arr, P, O)
                 for k, sim in sims.items()}
        for p, run in runs.items():
            st = stats.get(p, stats.get("base"))
            ok = (st.ttft_p99_ms <= slo.ttft_p99) & (st.tpot_p99_ms <= slo.tpot_p99)
            n_ok = int(ok.sum())
            run.slo_ok_gpu_windows += n_ok
            run.gpu_windows += G
            run.windows += 1
            run.slo_ok_windows += int(n_ok == G)
            run.min_free_bytes = min(run.min_free_bytes, int((st.mem_total_bytes - st.mem_used_bytes).min()))
            run.step(w, t1, st)
            if cfg.check_invariants:
                check_invariants(run, st)
            steps = run.ledger.steps()
            if steps > run.last_steps:  # weight sync to every GPU running rollout
                full = (steps - run.last_steps) * run.rollout_gpus() * ctx.wfull
                run.last_steps = steps
                run.weight_bytes_full += full
                run.weight_bytes += full * (cfg.weight_delta_ratio if p == "rose" else 1.0)
                run.synced(steps)
            if cfg.record_series and (w % series_every == 0 or w == n_win - 1):
                s = run.series
                leased, running = run.leased_counts()
                s["t"].append(round(t1, 3))
                s["ttft_p99_max_ratio"].append(round(float(st.ttft_p99_ms.max()) / slo.ttft_p99, 4))
                s["tpot_p99_max_ratio"].append(round(float(st.tpot_p99_ms.max()) / slo.tpot_p99, 4))
                s["slo_ok_frac"].append(round(n_ok / G, 4))
                s["leased"].append(leased)
                s["running"].append(running)
                s["episodes"].append(run.ledger.completed)
                s["external_gpus"].append(run.external())

    hours = n_win * cfg.period_s / 3600.0
    pol: dict[str, dict] = {}
    for p, run in runs.items():
        led = run.ledger
        res = {
            "episodes": led.completed,
            "episodes_per_hour": round(led.completed / hours, 2),
            "rl_steps": led.steps(),
            "rl_steps_per_hour": round(led.steps() / hours, 3),
            "gain_vs_static": None,
            "slo_attainment": round(run.slo_ok_gpu_windows / max(1, run.gpu_windows), 5),
            "slo_attainment_all_gpus": round(run.slo_ok_windows / max(1, run.windows), 5),
            "revokes": run.revokes,
            "weight_sync_bytes": int(run.weight_bytes),
            "weight_sync_bytes_full_broadcast": int(run.weight_bytes_full),
            "work": {"produced": round(led.produced, 4), "completed": led.completed,
                     "in_flight": round(run.in_flight(), 4), "parked": round(led.parked, 4),
                     "recomputed": round(led.recomputed, 4),
                     "consumed": led.steps() * ep.episodes_per_step,
                     "buffered": led.completed - led.steps() * ep.episodes_per_step},
            "min_free_mem_bytes": run.min_free_bytes,
        }
        if p in ("share-all", "rose"):
            res.update(mean_leased_gpus=round(run.lease_gpu_s / (hours * 3600.0), 3),
                       mean_leased_compute=round(run.lease_share_s / (hours * 3600.0), 3),
                       leases_unusable=run.leases_unusable)
        if p == "rose":
            res.update(grants=run.grants, expiries=run.expiries, guard_pauses=run.guard_pauses,
                       decide_calls=run.decide_calls)
        if p == "elastic":
            res.update(external_gpu_hours=round(run.ext_gpu_s / 3600.0, 3), external_gpu_cap=run.cap)
        pol[p] = res
    # gain over the static pool: measured when static ran, else its (deterministic) rate
    ref = pol["static"]["episodes"] if "static" in pol else _static_episodes(ctx)
    for res in pol.values():
        res["gain_vs_static"] = round(res["episodes"] / ref, 4) if ref > 0 else None
    out: dict = {"policies": pol, "config": {
        "trace": trace.name, "trace_format": trace.fmt, "gpus": G, "dedicated": M, "model_size": model.name,
        "gpu": gpu.name, "duration_s": n_win * cfg.period_s, "period_s": cfg.period_s, "windows": n_win,
        "seed": cfg.seed, "load": cfg.load, "decide_every": every,
        "telemetry_period_s": every * cfg.period_s,
        "slo_ms": {"ttft_p99": slo.ttft_p99, "tpot_p99": slo.tpot_p99},
        "request_cost_s": round(cost, 6), "peak_to_mean": round(peak, 4), "rps_per_gpu": round(rps_gpu, 4),
        "trace_compress": round(stream.compress, 4), "trace_copies": stream.copies,
        "trace_keep": round(stream.keep, 5),
        "interference_alpha": cfg.alpha, "interference_alpha_source": cfg.alpha_source,
        "weight_delta_ratio": cfg.weight_delta_ratio, "weight_delta_ratio_source": cfg.weight_ratio_source,
        "episode": asdict(ep),
        "rollout": {"dedicated_batch": rollout.dedicated_batch,
                    "dedicated_episodes_per_s": round(rollout.dedicated_rate, 5),
                    "policy_weight_bytes_per_gpu": model.weight_bytes_per_gpu,
                    "kv_bytes_per_episode": int(rollout.kv_episode)},
        "slo_tolerance": SLO_TOLERANCE,
    }}
    if cfg.record_series:
        out["series"] = {p: run.series for p, run in runs.items()}
    out["wall_s"] = round(time.perf_counter() - t_wall, 3)
    return out


def check_invariants(run: Run, st) -> None:
    """What must hold after every window (AssertionError naming the broken one)."""
    c, led = run.ctx, run.ledger
    assert (st.mem_used_bytes <= st.mem_total_bytes).all(), "memory used exceeds the GPU"
    assert (st.mem_used_bytes >= st.rollout_mem_bytes).all(), "rollout memory exceeds memory used"
    assert (st.ttft_p99_ms >= 0).all() and (st.tpot_p99_ms >= 0).all(), "negative latency"
    if run.sim is not None:
        s = run.sim
        assert (s.qn >= -1e-9).all() and (s.N >= -1e-9).all() and (s.C >= -1e-6).all(), "negative serving state"
    w = [run.ded_w] + [getattr(run, k) for k in ("w", "ext_w") if hasattr(run, k)]
    assert all((x >= -1e-9).all() for x in w), "negative in-flight work"
    assert led.parked >= -1e-9 and led.recomputed >= -1e-9, "negative parked or recomputed work"
    total = led.completed + run.in_flight() + led.parked + led.recomputed
    assert abs(led.produced - total) <= 1e-6 * max(1.0, led.produced), \
        f"work ledger: produced {led.produced} != completed+in flight+parked+recomputed {total}"
    consumed = led.steps() * c.ep.episodes_per_step
    assert 0 <= led.completed - consumed < c.ep.episodes_per_step, "trainer consumed more than completed"
    if isinstance(run, RoseRun):
        pc = c.policy
        assert (run.share <= pc.max_compute_share + 1e-9).all() and (run.share >= 0).all(), "share out of bounds"
        for g, room in run.grant_room.items():  # a grant never lends memory serving holds or the margin
            assert not run.leased[g] or run.mem[g] <= room, f"lease of {run.mem[g]} B > free {room} B on GPU {g}"
        run.grant_room.clear()
        assert (run.mem[run.leased] <= st.mem_total_bytes - run.sim.static_bytes).all(), "lease beyond the GPU"
        assert (run.mem[~run.leased] == 0).all() and (run.share[~run.leased] == 0).all(), "lease left behind"
        assert not (run.paused & ~run.leased).any(), "paused without a lease"
    if isinstance(run, ShareAllRun):
        assert (run.mem <= st.mem_total_bytes - run.sim.static_bytes).all(), "share-all lends beyond the GPU"


def calibration(interference: dict | None, weights: dict | None) -> dict:
    """SimConfig fields from benchmark results (`rose bench interference|weights --json` objects).

    Interference: the bench measures a serving step's p99 alone and beside a rollout worker
    running flat out with no protection (every core, no priority, no guard); that phase is a
    share of 1, so ``alpha = unprotected_p99_over_alone - 1``. The unprotected phase is used
    because the simulator models the protection (the guard's pause) itself; the bench's nice-19
    priority is not credited, which makes alpha an upper bound. Weights: ``bytes_ratio_per_step``.
    """
    out: dict = {}
    if interference is not None:
        r = interference.get("unprotected_p99_over_alone")
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
            raise ValueError("--interference-bench: expected a positive unprotected_p99_over_alone "
                             "(the output of `rose bench interference --json`)")
        out["alpha"] = round(max(0.0, float(r) - 1.0), 4)
        out["alpha_source"] = (f"rose bench interference ({interference.get('_source', 'result')}, device "
                               f"{interference.get('device', '?')}): unprotected p99 / alone = {r}")
    if weights is not None:
        r = weights.get("bytes_ratio_per_step")
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
            raise ValueError("--weights-bench: expected bytes_ratio_per_step in (0, 1] "
                             "(the output of `rose bench weights --json`)")
        out["weight_delta_ratio"] = float(r)
        out["weight_ratio_source"] = f"rose bench weights ({weights.get('_source', 'result')})"
    return out


def auto_decide_every(n_gpus: int, n_win: int, period_s: float, pc: PolicyConfig) -> int:
    """Windows per policy event: 1 while the run needs at most DECIDE_CALLS_BUDGET calls, else the
    smallest factor under it, kept below the lease renewal margin (so leases never lapse)."""
    k = max(1, math.ceil(n_gpus * n_win / DECIDE_CALLS_BUDGET))
    cap = max(1, math.floor((pc.renew_before_s - 1e-9) / period_s))
    return min(k, cap)


def _static_episodes(ctx: _Ctx) -> int:
    """Episodes the static pool completes in the run (its ledger alone; no serving involved)."""
    led = Ledger(ctx.ep)
    w = np.zeros(1)
    for _ in range(ctx.n_win):
        led.progress(w, np.array([ctx.ded_fill]), np.array([ctx.ded_rate * ctx.dt]))
    return led.completed
