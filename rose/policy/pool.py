"""The pool decision (docs/contract.md §9): how many replicas of a pool stay serving, which
replicas a replica lease may take, which lent replicas come back, and per replica which kind of
lease (replica, co-resident or none).

Pure like `decide()`: no I/O, no clock, no randomness. Time is the newest telemetry event's `ts`,
command ids are hashes of their cause (`lease_commands.command_id`), and every choice among
replicas is by sorted replica id, so the same telemetry and config always give byte-identical
commands. The design (forecast, capacity, reclaim order) is docs/policy.md "Pool decisions";
how a scheduler instance comes to hold a whole pool's telemetry is docs/scheduler.md "Pool
decisions and partitioning".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

# a pool's settings are configuration (`policy.pools.<pool>`): defined in rose.config, checked in
# rose.config_checks
from rose.config import PolicyConfig
from rose.config import PoolConfig as PoolConfig
from rose.config_checks import FORECASTS as FORECASTS
from rose.config_checks import check_pool_config as check_pool_config
from rose.contract.events import Command, Telemetry
from rose.contract.immutable import immutable
from rose.policy.lease_commands import Cause, lease_command, lease_id_for
from rose.policy.lease_policy import memory_margin

if TYPE_CHECKING:
    from rose.policy.pool_records import PoolSample

LEASE_NONE, LEASE_REPLICA, LEASE_CORESIDENT = "none", "replica", "coresident"


# ---------------------------------------------------------------- forecasts (the evaluation runs these too)


def forecast_rps(kind: str, load: tuple[float, ...], bin_s: float, horizon_s: float) -> float:
    """The pool's load (requests/s) to provision for over the next `horizon_s`, from its load per
    bin over the window (oldest first): the newest bin, the window's peak, or the peak plus the
    window's rising linear trend (least squares) carried over the horizon."""
    if not load:
        return 0.0
    if kind == "last":
        return load[-1]
    peak = max(load)
    if kind == "peak":
        return peak
    if kind == "peak_trend":
        return peak + max(0.0, _slope(load, bin_s)) * horizon_s
    raise ValueError(f"forecast {kind!r} is not one of {FORECASTS}")


def _slope(load: tuple[float, ...], bin_s: float) -> float:
    """Least-squares slope of the load per second."""
    n = len(load)
    if n < 2:
        return 0.0
    mean_t, mean_y = (n - 1) / 2, sum(load) / n
    cov = sum((i - mean_t) * (y - mean_y) for i, y in enumerate(load))
    var = sum((i - mean_t) ** 2 for i in range(n))
    return cov / var / bin_s


def replicas_needed(forecast: float, capacity_rps: float, headroom: float) -> int:
    """ceil(forecast × (1 + headroom) / capacity), at least 1."""
    return max(1, math.ceil(forecast * (1.0 + headroom) / capacity_rps - 1e-9))


# ---------------------------------------------------------------- the pool's view of its telemetry


@immutable
class Replica:
    """One replica as its newest telemetry shows it."""

    replica: str
    serving_state: str
    rps: float
    gpus: tuple[str, ...]  # sorted
    mem_total_bytes: tuple[int, ...]  # per GPU, as `gpus`


@immutable
class PoolView:
    """A pool's recent telemetry reduced to what the decision reads."""

    pool: str
    now: float  # the newest event's ts
    cause_event_id: str  # the newest event: the cause of every command of this decision
    replicas: tuple[Replica, ...]  # sorted by id
    load: tuple[float, ...]  # requests/s summed over replicas, per bin, oldest first
    observed_capacity_rps: float  # highest per-bin replica rps with the headroom on every sample; 0: none


def pool_view(events: Iterable[Telemetry | PoolSample], cfg: PoolConfig) -> PoolView | None:
    """The view of one pool's events (any order) over `cfg.window_s` before the newest; None
    without events. A replica's rps in a bin is the mean of each GPU's samples in the bin (each
    sample is a rate over one telemetry window of the same period, so the mean is the bin's rate;
    the highest of noisy short counts is biased up, and summed over replicas the bias adds up),
    the highest over its GPUs (the GPUs of a tensor-parallel replica serve the same requests); a
    bin without its telemetry carries its previous value (a missing sample is not a quiet
    replica); bins before the first sample of any replica are left out (no history is not zero
    load). The pool's load is the sum over replicas; the forecast's peak over bins holds the
    burstiness."""
    evs = sorted(events, key=lambda e: (e.ts, e.event_id))
    if not evs:
        return None
    newest = evs[-1]
    now, start = newest.ts, newest.ts - cfg.window_s
    nbins = window_bins(cfg)
    acc: dict[tuple[str, str, int], _BinSum] = {}
    latest: dict[str, Telemetry | PoolSample] = {}
    gpus: dict[str, dict[str, int]] = {}
    for e in evs:
        if e.ts <= start and e.ts != now:
            continue
        rid = e.replica_id
        latest[rid] = e
        gpus.setdefault(rid, {})[e.gpu] = e.mem_total_bytes
        k = min(nbins - 1, max(0, nbins - 1 - int((now - e.ts) / cfg.bin_s)))
        acc.setdefault((rid, e.gpu, k), _BinSum()).add(
            e, e.serving_state == "serving" and has_headroom(e, cfg.headroom)
        )
    per: dict[str, list[float | None]] = {rid: [None] * nbins for rid in latest}
    observed = 0.0
    for (rid, _, k), b in acc.items():
        prev, mean = per[rid][k], b.total / b.count
        per[rid][k] = mean if prev is None else max(prev, mean)
        if b.all_headroom:
            observed = max(observed, mean)
    first = min(next(k for k, v in enumerate(row) if v is not None) for row in per.values())
    load = [0.0] * nbins
    for row in per.values():
        carried = 0.0
        for k, v in enumerate(row):
            carried = carried if v is None else v
            load[k] += carried
    reps = tuple(_replica(latest[rid], gpus[rid]) for rid in sorted(latest))
    return PoolView(newest.pool, now, newest.event_id, reps, tuple(load[first:]), observed)


def window_bins(cfg: PoolConfig) -> int:
    """The bins of `bin_s` in the forecast's look-back `window_s`."""
    return max(1, math.ceil(cfg.window_s / cfg.bin_s - 1e-9))


class _BinSum:
    """One GPU's samples in one bin: their rps summed and counted, and whether every one was
    serving with the headroom on every SLO metric (the bin then counts towards the capacity)."""

    __slots__ = ("total", "count", "all_headroom")

    def __init__(self) -> None:
        self.total, self.count, self.all_headroom = 0.0, 0, True

    def add(self, e: Telemetry | PoolSample, headroom: bool) -> None:
        self.total += e.rps
        self.count += 1
        self.all_headroom = self.all_headroom and headroom


def _replica(newest: Telemetry | PoolSample, gpus: dict[str, int]) -> Replica:
    ids = tuple(sorted(gpus))
    return Replica(newest.replica_id, newest.serving_state, newest.rps, ids, tuple(gpus[g] for g in ids))


def has_headroom(e: Telemetry | PoolSample, headroom: float) -> bool:
    """A pool stage's sample carries it, computed by the GPU stage with the pool's headroom."""
    if not isinstance(e, Telemetry):
        return e.headroom_ok
    lat, slo = e.latency_ms, e.slo_ms
    return lat.ttft_p99 <= (1 - headroom) * slo.ttft_p99 and lat.tpot_p99 <= (1 - headroom) * slo.tpot_p99


# ---------------------------------------------------------------- the decision


@immutable
class PoolDecision:
    """How many replicas stay serving and which replicas move; `explain()` for --explain."""

    pool: str
    ts: float
    cause_event_id: str
    forecast: str
    forecast_rps: float
    horizon_s: float
    capacity_rps: float  # 0: no capacity figure, nothing is lent
    capacity_source: str  # "config" | "estimated" | "none"
    needed: int
    keep: tuple[str, ...]  # serving (or reclaiming: back within the horizon) and staying so
    lend: tuple[str, ...]  # serving replicas a replica lease may take
    reclaim: tuple[str, ...]  # draining or lent replicas to bring back, in reclaim order
    history_short: bool = False  # a surplus not lent: the view's bins do not cover the window yet

    def explain(self) -> str:
        cap = f"{self.capacity_rps:.3f} rps/replica ({self.capacity_source})" if self.capacity_rps else "none"
        short = " (less than a window of history: nothing lent)" if self.history_short else ""
        return (
            f"pool {self.pool}: forecast {self.forecast} {self.forecast_rps:.3f} rps over {self.horizon_s:.1f} s, "
            f"capacity {cap}, need {self.needed}; keep [{', '.join(self.keep)}] "
            f"lend [{', '.join(self.lend)}] reclaim [{', '.join(self.reclaim)}]{short}"
        )


def decide_pool(view: PoolView, cfg: PoolConfig) -> PoolDecision:
    """Keep `replicas_needed` replicas serving: lend the surplus (never the last serving replica),
    or reclaim the deficit (draining replicas first: their engines are still awake; then lent
    ones). Replicas are chosen by id: the lowest ids stay serving, so successive decisions move
    the same replicas and replay picks the same ones. Nothing is lent until the view's bins cover
    the window: the forecast was chosen on decisions with a window of history (docs/policy.md),
    and the peak of a few seconds of a new pool's samples (a window in which no request happened
    to finish reads 0 rps) is no forecast of the next minutes. A deficit is reclaimed at once."""
    f = forecast_rps(cfg.forecast, view.load, cfg.bin_s, cfg.horizon_s)
    if cfg.replica_capacity_rps > 0:
        cap, source = cfg.replica_capacity_rps, "config"
    elif view.observed_capacity_rps > 0:
        cap, source = view.observed_capacity_rps, "estimated"
    else:
        cap, source = 0.0, "none"
    by_state: dict[str, list[str]] = {}
    for r in view.replicas:
        by_state.setdefault(r.serving_state, []).append(r.replica)
    serving, back = by_state.get("serving", []), by_state.get("reclaiming", [])
    out = by_state.get("draining", []) + by_state.get("lent", [])
    needed = replicas_needed(f, cap, cfg.headroom) if cap else len(view.replicas)
    lend: list[str] = []
    reclaim: list[str] = []
    surplus = len(serving) + len(back) - needed
    short = surplus > 0 and len(view.load) < window_bins(cfg)
    if surplus > 0 and not short:
        lend = serving[len(serving) - min(surplus, len(serving) - 1) :] if len(serving) > 1 else []
    elif surplus < 0:
        reclaim = out[:-surplus]
    keep = tuple(r for r in serving + back if r not in lend) + tuple(reclaim)
    return PoolDecision(
        view.pool, view.now, view.cause_event_id, cfg.forecast, f, cfg.horizon_s, cap, source, needed,
        tuple(sorted(keep)), tuple(lend), tuple(reclaim), short,
    )  # fmt: skip


# ---------------------------------------------------------------- per replica: which kind of lease


def lease_kinds(decision: PoolDecision, coresident_ok: Mapping[str, bool]) -> dict[str, str]:
    """Per replica of the decision's kept and lent sets: a replica lease where the pool can spare
    the replica, else a co-resident lease where the co-resident rule (`decide()`'s prediction)
    grants headroom on every GPU of the replica, else none."""
    kinds = {r: LEASE_REPLICA for r in decision.lend}
    for r in decision.keep:
        kinds[r] = LEASE_CORESIDENT if coresident_ok.get(r, False) else LEASE_NONE
    return kinds


# ---------------------------------------------------------------- commands


@immutable
class ReplicaLease:
    """A live replica lease on one GPU, as the scheduler's view holds it."""

    gpu: str
    lease_id: str
    epoch: int


def replica_commands(
    decision: PoolDecision,
    view: PoolView,
    cause: Telemetry,
    epochs: Mapping[str, int],
    leases: Mapping[str, ReplicaLease],
    policy: PolicyConfig,
) -> tuple[Command, ...]:
    """The commands of a decision, on its cause event (`cause.event_id == decision.cause_event_id`):
    per lent replica, one grant per GPU (a gang: `group_id` `{replica}#{epoch}`, compute share 1,
    memory the whole GPU less the margin: the executor caps it to what the sleeping engine frees);
    per reclaimed replica, a revoke of each GPU's live lease. `epochs` is each GPU's last epoch."""
    by_id = {r.replica: r for r in view.replicas}
    out: list[Command] = []
    for rid in decision.lend:
        gpus = by_id[rid].gpus
        epoch = max(epochs.get(g, 0) for g in gpus) + 1  # one epoch for the gang: above every member's
        for g, total in zip(gpus, by_id[rid].mem_total_bytes, strict=True):
            out.append(replica_grant(cause, g, total, epoch, f"{rid}#{epoch}", len(gpus), decision.explain(), policy))
    for rid in decision.reclaim:
        for g in by_id[rid].gpus:
            lease = leases.get(g)
            if lease is None:
                continue  # nothing live here: the executor readmits a replica with no lease (fail-safe)
            out.append(replica_revoke(cause, g, lease.lease_id, lease.epoch, decision.explain()))
    return tuple(out)


def replica_grant(
    cause: Cause, gpu: str, mem_total: int, epoch: int, group_id: str, group_size: int, why: str, policy: PolicyConfig
) -> Command:
    """One GPU's grant of a replica lease: compute share 1, memory the whole GPU less the margin
    (the executor caps it to what the sleeping engine frees), a gang of the replica's GPUs."""
    return lease_command(
        cause, "grant", gpu, lease_id_for(gpu, epoch), epoch,
        mem_bytes=mem_total - memory_margin(mem_total, policy), compute_share=1.0,
        expires_at=cause.ts + policy.ttl_s, reason=f"replica lease: {why}",
        group_id=group_id, group_size=group_size, lease_kind=LEASE_REPLICA,
    )  # fmt: skip


def replica_revoke(cause: Cause, gpu: str, lease_id: str, epoch: int, why: str) -> Command:
    """The revoke of one GPU's replica lease: the replica comes back to serving."""
    return lease_command(
        cause, "revoke", gpu, lease_id, epoch, mem_bytes=0, compute_share=0.0,
        expires_at=cause.ts, reason=f"reclaim: {why}", lease_kind=LEASE_REPLICA,
    )  # fmt: skip
