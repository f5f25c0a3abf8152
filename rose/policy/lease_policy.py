"""The lease policy: one pure step `decide(view, telemetry, config) -> (view', commands, explanation)`.

The rules and their defaults are docs/contract.md §4; docs/policy.md explains the design
(lease sizing, hysteresis, cooldown, the trend predictor). No I/O, no wall clock, no
randomness: time is the event's `ts`, command ids are hashes of their cause, so the same
telemetry log and config always give byte-identical commands. Its callers (the scheduler
service, `rose replay`, `rose simulate`) share one fold around it, `rose.policy.core`: the
per-GPU views, the executors' lease states folded into them, admission.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from rose.config import GiB, PolicyConfig
from rose.contract.events import Command, Telemetry
from rose.contract.immutable import immutable
from rose.policy.compute_share import compute_share_for, interference_estimate
from rose.policy.lease_commands import lease_command, lease_id_for

POLICY_VERSION = "1.1"

_NEVER = -1.0  # "no previous sample" for ts, p99 and memory fields (real values are ≥ 0)
NEVER = _NEVER
# a view's lease fields once its lease ended (a gang's with them)
NO_LEASE: dict[str, Any] = {
    "lease_id": None,
    "lease_expires_at": 0.0,
    "lease_mem_bytes": 0,
    "lease_compute_share": 0.0,
    "lease_granted_at": 0.0,
    "paused_since": NEVER,
    "group_id": "",
    "group_size": 0,
}


@immutable
class GpuView:
    """Everything the policy knows about one GPU. A cache of the log, never a source of
    truth: it can be rebuilt by replaying telemetry and folding in lease states."""

    gpu: str
    last_ts: float = _NEVER
    last_event_id: str = ""
    streak: int = 0  # consecutive events with grant headroom on every metric
    epoch: int = 0  # last epoch used on this GPU; the next grant uses epoch + 1
    lease_id: str | None = None
    lease_expires_at: float = 0.0
    lease_mem_bytes: int = 0
    lease_compute_share: float = 0.0
    lease_granted_at: float = 0.0
    cooldown_until: float = 0.0
    revokes_in_row: int = 0
    prev_ttft_p99: float = _NEVER  # latencies and serving memory of the last fresh event
    prev_tpot_p99: float = _NEVER
    prev_serving_mem: int = -1
    prev_rollout_mem: int = -1  # rollout memory of the last fresh event: a worker starts on the first showing it
    serving_mem_high: int = -1  # serving memory's recent peak, which a grant leaves room for (`serving_peak`)
    serving_mem_high_ts: float = _NEVER  # when serving last reached it
    ignored_stale: int = 0  # duplicate / out-of-order events ignored
    prev2_ts: float = _NEVER  # the fresh event before the last: the trend predictor's third sample
    prev2_ttft_p99: float = _NEVER
    prev2_tpot_p99: float = _NEVER
    paused_since: float = _NEVER  # event time the held lease was throttled to share 0 (v1.1)
    # the online interference estimate (docs/policy.md "Interference estimate"): serving's load
    # (worst p99 / SLO) on calm events with no rollout running, and its slowdown per unit of
    # compute share while a lease runs, both EWMAs; _NEVER until first seen
    base_load: float = _NEVER
    slowdown_per_share: float = _NEVER
    # gang leases (docs/policy.md "Gang leases"; kept by rose.policy.core, which alone groups
    # GPUs): the node of the last event, the held lease's group, and what this GPU's last event
    # would have granted (ready_mem_bytes > 0) or resumed to (ready_share > 0) on its own
    node: str = ""
    group_id: str = ""
    group_size: int = 0
    ready_mem_bytes: int = 0
    ready_share: float = 0.0
    # replica leases (docs/scheduler.md "Pool decisions and partitioning", kept by
    # rose.policy.core): the held lease's kind, and the last pool intent applied to this GPU
    lease_kind: str = "coresident"
    intent_id: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _VIEW_FIELDS}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GpuView:
        return cls(**{k: d[k] for k in _VIEW_FIELDS if k in d})

    def holds_lease(self, ts: float) -> bool:
        """True while a lease is live at event time `ts`."""
        return self.lease_id is not None and ts < self.lease_expires_at


_VIEW_FIELDS = tuple(f.name for f in fields(GpuView))


@immutable
class Explanation:
    """Why a decision was (not) taken: for spans, logs and `rose replay --explain`."""

    headroom: dict[str, float]  # per SLO metric, 1 - p99/slo
    predicted_headroom: dict[str, float]  # after the trend predictor (== headroom unless rising)
    free_mem_bytes: int  # total - serving - max(lease, rollout)
    action: str  # grant | renew | throttle | revoke | hold | none | ignored
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "reason": self.reason,
            "headroom": self.headroom,
            "predicted_headroom": self.predicted_headroom,
            "free_mem_bytes": self.free_mem_bytes,
        }


@immutable
class Decision:
    view: GpuView
    commands: tuple[Command, ...]
    explain: Explanation
    others: tuple[GpuView, ...] = ()  # views of other GPUs the step changed (a gang's members)


def cooldown_for(revokes_in_row: int, cfg: PolicyConfig) -> float:
    """Cooldown after the n-th revoke in a row (n ≥ 1)."""
    return min(cfg.cooldown_s * cfg.cooldown_backoff ** (revokes_in_row - 1), cfg.cooldown_max_s)


def memory_margin(total: int, cfg: PolicyConfig) -> int:
    """Memory of a GPU never lent: `mem_margin_frac` of its total."""
    return int(total * cfg.mem_margin_frac)


def free_memory(total: int, serving: int, lease_mem: int, rollout: int) -> int:
    """Memory neither serving holds nor is promised to (`lease_mem`) or taken by (`rollout`)
    rollout: `total - serving - max(lease_mem, rollout)`."""
    return total - serving - (lease_mem if lease_mem > rollout else rollout)


def _gib(b: float) -> str:
    return f"{b / GiB:.2f} GiB"


def _lease_mem(avail: int, h: float, cfg: PolicyConfig) -> int:
    """mem_bytes of a new lease; docs/policy.md "What `decide()` implements"."""
    g = cfg.grant_headroom
    s = (h - g) / (1.0 - g) if g < 1.0 else 1.0
    s = 0.0 if s < 0.0 else 1.0 if s > 1.0 else s
    gran = cfg.lease_granularity_bytes
    mem = int(avail * (0.5 + 0.5 * s))
    if gran > 0:
        mem -= mem % gran
    return max(cfg.min_lease_bytes, mem)


def _trend(
    metric: str,
    p99: float,
    prev: float,
    prev2: float,
    slo: float,
    dt: float,
    dt2: float,
    horizon: float,
    why: list[str],
) -> float:
    """Predicted headroom `horizon` seconds ahead: only when p99 rose on each of the last two
    intervals (`dt2` then `dt` long), extrapolated at the smaller of the two rates; appends a
    revoke reason if it crosses the SLO (docs/policy.md "The trend predictor")."""
    if not 0.0 <= prev2 < prev < p99:
        return 1.0 - p99 / slo
    slope = (p99 - prev) / dt
    slope2 = (prev - prev2) / dt2
    pred = p99 + (slope if slope < slope2 else slope2) * horizon
    if pred > slo:
        why.append(f"trend: {metric} rising to {pred:.1f} ms > SLO {slo:.1f} ms within {horizon:g} s")
    return 1.0 - pred / slo


def decide(view: GpuView | None, event: Telemetry, cfg: PolicyConfig) -> Decision:
    """One policy step for one telemetry event of one GPU: what the event says (`assess`), what
    to do about the lease (`choose`), and the view the GPU's next event meets (`next_view`)."""
    if view is None:
        view = GpuView(gpu=event.gpu)
    ts = event.ts
    if ts <= view.last_ts or event.event_id == view.last_event_id:
        why = (
            f"duplicate event_id {event.event_id}"
            if event.event_id == view.last_event_id
            else f"stale: ts {ts:.3f} <= last {view.last_ts:.3f}"
        )
        return Decision(replace(view, ignored_stale=view.ignored_stale + 1), (), Explanation({}, {}, 0, "ignored", why))
    held, expired_note = lease_at(view, ts)
    a = assess(view, event, held, cfg)
    c = choose(view.gpu, event, a, held, cfg)
    reason = c.reason
    if expired_note and not c.commands:  # commands stay the same whether the executor's `expired` came first
        reason = expired_note + reason
    return Decision(
        next_view(view, event, a, c.terms), c.commands, Explanation(a.headroom, a.predicted, a.free, c.action, reason)
    )


@immutable
class LeaseTerms:
    """The lease fields of a GPU's view: the lease held (if any) and what outlives it (the
    epoch floor, the cooldown and the revokes in a row behind it)."""

    lease_id: str | None
    epoch: int
    mem_bytes: int
    share: float
    expires_at: float
    granted_at: float
    paused_since: float
    cooldown_until: float
    revokes_in_row: int

    def until(self, expires_at: float, share: float, paused_since: float) -> LeaseTerms:
        """The same lease, running at `share` (0: paused since `paused_since`) until `expires_at`."""
        return LeaseTerms(
            self.lease_id,
            self.epoch,
            self.mem_bytes,
            share,
            expires_at,
            self.granted_at,
            paused_since,
            self.cooldown_until,
            self.revokes_in_row,
        )


@immutable
class Assessment:
    """What one fresh event says about its GPU before anything is chosen."""

    headroom: dict[str, float]  # per SLO metric, 1 - p99/slo
    predicted: dict[str, float]  # after the trend predictor
    h_min: float  # the smaller headroom
    serving: int  # serving's memory: used - rollout
    serving_high: int  # its recent peak after this event (`serving_peak`)
    serving_high_ts: float
    free: int  # total - serving - max(lease, rollout)
    margin: int  # memory never lent
    slow: tuple[str, ...]  # latency conditions: pause a lease, block a grant
    short: tuple[str, ...]  # memory conditions: revoke a lease, block a grant
    streak: int  # consecutive events with grant headroom on every metric, this one included
    load: float  # serving's load now: worst p99 / SLO
    base_load: float  # the interference estimate after this event
    slowdown_per_share: float


@immutable
class Choice:
    """What to do about the lease: the action, why, the lease fields after it, its commands."""

    action: str
    reason: str
    terms: LeaseTerms
    commands: tuple[Command, ...]


def lease_at(view: GpuView, ts: float) -> tuple[LeaseTerms, str]:
    """The view's lease as of event time `ts`: one whose expiry passed is over (the executor
    revoked itself). With it, a note saying so ("" when nothing expired)."""
    lease_id = view.lease_id
    note = ""
    if lease_id is not None and ts >= view.lease_expires_at:
        note = f"lease {lease_id} expired at {view.lease_expires_at:.3f} without renewal; "
        lease_id = None
    if lease_id is None:
        return LeaseTerms(None, view.epoch, 0, 0.0, 0.0, 0.0, _NEVER, view.cooldown_until, view.revokes_in_row), note
    # positional, here and in `assess`: keyword arguments cost about three times as much on this path
    return LeaseTerms(
        lease_id,
        view.epoch,
        view.lease_mem_bytes,
        view.lease_compute_share,
        view.lease_expires_at,
        view.lease_granted_at,
        view.paused_since,
        view.cooldown_until,
        view.revokes_in_row,
    ), note


def assess(view: GpuView, event: Telemetry, held: LeaseTerms, cfg: PolicyConfig) -> Assessment:
    """Headroom, memory and their trends; two levels (v1.1): latency conditions pause a lease's
    compute (throttle to share 0), memory conditions revoke it. On a GPU without a lease,
    either blocks a grant."""
    lat, slo = event.latency_ms, event.slo_ms
    h_ttft = 1.0 - lat.ttft_p99 / slo.ttft_p99
    h_tpot = 1.0 - lat.tpot_p99 / slo.tpot_p99
    total = event.mem_total_bytes
    rollout = event.rollout_mem_bytes
    serving = event.mem_used_bytes - rollout
    margin = memory_margin(total, cfg)
    free = free_memory(total, serving, held.mem_bytes, rollout)
    slow: list[str] = []  # latency: headroom below the revoke threshold, or the trend crosses the SLO
    short: list[str] = []  # memory: free memory below the margin, or KV growth heading there
    rv = cfg.revoke_headroom
    if h_ttft < rv:
        slow.append(f"headroom {h_ttft:.2f} < {rv:.2f} on ttft_p99")
    if h_tpot < rv:
        slow.append(f"headroom {h_tpot:.2f} < {rv:.2f} on tpot_p99")
    if free < margin:
        short.append(f"free memory {_gib(free)} < margin {_gib(margin)}")
    dt = event.ts - view.last_ts if view.last_ts >= 0.0 else 0.0
    p_ttft, p_tpot = h_ttft, h_tpot
    if dt > 0.0:
        if view.prev2_ts >= 0.0:
            p_ttft, p_tpot = _predicted(view, event, dt, (h_ttft, h_tpot), cfg, slow)
        if 0 <= view.prev_serving_mem < serving and margin > 0:
            _kv_growth(view.prev_serving_mem, serving, free, margin, dt, cfg, short)
    h_min = h_ttft if h_ttft < h_tpot else h_tpot
    load = 1.0 - h_min
    share = held.share if held.lease_id is not None else 0.0
    started = share > 0.0 and worker_started(view, event) and view.prev_ttft_p99 >= 0.0
    before = max(view.prev_ttft_p99 / slo.ttft_p99, view.prev_tpot_p99 / slo.tpot_p99) if started else -1.0
    base_load, per_share = interference_estimate(view.base_load, view.slowdown_per_share, load, before, share, cfg)
    high, high_ts = serving_peak(view, serving, event.ts, held.lease_id is not None or h_min >= cfg.grant_headroom, cfg)
    return Assessment(
        {"ttft_p99": h_ttft, "tpot_p99": h_tpot},  # headroom
        {"ttft_p99": p_ttft, "tpot_p99": p_tpot},  # predicted
        h_min,
        serving,
        high,
        high_ts,
        free,
        margin,
        tuple(slow),
        tuple(short),
        view.streak + 1 if h_min >= cfg.grant_headroom else 0,  # streak
        load,
        base_load,
        per_share,
    )


def worker_started(view: GpuView, event: Telemetry) -> bool:
    """Whether `event` is the first to show rollout memory after one that showed none: where a
    lease's worker started, and the interference estimate reads its slowdown."""
    return event.rollout_mem_bytes > 0 and view.prev_rollout_mem == 0


def serving_peak(view: GpuView, serving: int, ts: float, counts: bool, cfg: PolicyConfig) -> tuple[int, float]:
    """Serving memory's recent peak and when serving last reached it (docs/policy.md "Lease
    size"), over the events that `counts`: those that hold a lease or have grant headroom, never
    one deferral (rose.policy.deferral) may hold back. A peak is held for `kv_peak_hold_s` after
    serving last reached it, then serving now replaces it."""
    high, high_ts = view.serving_mem_high, view.serving_mem_high_ts
    if counts and (high < 0 or serving >= high or ts - high_ts >= cfg.kv_peak_hold_s):
        return serving, ts
    return high, high_ts


def _predicted(
    view: GpuView, event: Telemetry, dt: float, now: tuple[float, float], cfg: PolicyConfig, slow: list[str]
) -> tuple[float, float]:
    """Predicted headroom per metric (`_trend`), given the event before the last (`prev2_ts` ≥
    0); else `now`."""
    dt2 = view.last_ts - view.prev2_ts
    if not dt2 > 0.0:
        return now
    lat, slo, horizon = event.latency_ms, event.slo_ms, cfg.trend_horizon_s
    return (
        _trend("ttft_p99", lat.ttft_p99, view.prev_ttft_p99, view.prev2_ttft_p99, slo.ttft_p99, dt, dt2, horizon, slow),
        _trend("tpot_p99", lat.tpot_p99, view.prev_tpot_p99, view.prev2_tpot_p99, slo.tpot_p99, dt, dt2, horizon, slow),
    )


def _kv_growth(
    prev_mem: int, serving: int, free: int, margin: int, dt: float, cfg: PolicyConfig, short: list[str]
) -> None:
    """Appends a memory condition when serving's memory, grown from `prev_mem` (≥ 0) to `serving`,
    grows fast enough to eat the (positive) margin."""
    horizon = cfg.trend_horizon_s
    growth = (serving - prev_mem) / dt * horizon
    limit = cfg.kv_growth_revoke_frac * margin
    if growth >= limit:
        short.append(
            f"KV growth {_gib(growth)} per {horizon:g} s >= {_gib(limit)} "
            f"({cfg.kv_growth_revoke_frac:g} x margin {_gib(margin)})"
        )
    elif free - growth < margin <= free:
        short.append(
            f"KV growth {_gib(growth)} per {horizon:g} s would leave {_gib(free - growth)} < margin {_gib(margin)}"
        )


def choose(gpu: str, event: Telemetry, a: Assessment, held: LeaseTerms, cfg: PolicyConfig) -> Choice:
    """What to do about `gpu`'s lease on this event: keep, renew, pause, resume or revoke the
    lease it holds, or grant one."""
    if held.lease_id is not None:
        return _choose_held(gpu, event, a, held, cfg)
    return _choose_grant(gpu, event, a, held, cfg)


def _command(
    gpu: str, event: Telemetry, t: LeaseTerms, kind: str, mem: int, share: float, expires: float, why: str
) -> tuple[Command, ...]:
    assert t.lease_id is not None  # every command is about a lease: the held one, or the one granted
    return (
        lease_command(
            event, kind, gpu, t.lease_id, t.epoch, mem_bytes=mem, compute_share=share, expires_at=expires, reason=why
        ),
    )


def _choose_held(gpu: str, event: Telemetry, a: Assessment, t: LeaseTerms, cfg: PolicyConfig) -> Choice:
    ts, share, rv = event.ts, t.share, cfg.revoke_headroom
    paused_for = ts - t.paused_since if t.paused_since >= 0.0 else 0.0
    if a.short or paused_for >= cfg.max_pause_s:
        reason = "; ".join(a.short) if a.short else f"paused for {paused_for:.1f} s >= {cfg.max_pause_s:g} s"
        revokes_in_row = 1 if ts - t.granted_at >= cfg.cooldown_reset_s else t.revokes_in_row + 1
        cool = cooldown_for(revokes_in_row, cfg)
        reason += f"; cooldown {cool:g} s"
        ended = replace(
            t,
            lease_id=None,
            mem_bytes=0,
            share=0.0,
            expires_at=0.0,
            granted_at=0.0,
            paused_since=_NEVER,
            cooldown_until=ts + cool,
            revokes_in_row=revokes_in_row,
        )
        return Choice("revoke", reason, ended, _command(gpu, event, t, "revoke", 0, 0.0, ts, reason))
    if a.slow and share > 0.0:
        reason = "pause: " + "; ".join(a.slow)
        t = t.until(ts + cfg.ttl_s, 0.0, ts)
        return Choice(
            "throttle", reason, t, _command(gpu, event, t, "throttle", t.mem_bytes, 0.0, t.expires_at, reason)
        )
    if share == 0.0 and not a.slow and a.streak >= cfg.grant_streak:
        load = max(a.load, a.base_load)
        share = compute_share_for(load, a.slowdown_per_share, cfg)
        if share > 0.0:
            reason = (
                f"resume: headroom {a.h_min:.2f} >= {cfg.grant_headroom:.2f} for {a.streak} events after "
                f"{paused_for:.1f} s paused; share {share:g}"
            )
            t = t.until(ts + cfg.ttl_s, share, _NEVER)
            return Choice(
                "throttle", reason, t, _command(gpu, event, t, "throttle", t.mem_bytes, share, t.expires_at, reason)
            )
        reason = f"paused: serving load {load:.2f} leaves no share"
        if t.expires_at - ts >= cfg.renew_before_s:
            return Choice("hold", reason, t, ())
        t = t.until(ts + cfg.ttl_s, t.share, t.paused_since)
        return Choice("renew", reason, t, _command(gpu, event, t, "renew", t.mem_bytes, 0.0, t.expires_at, reason))
    if t.expires_at - ts < cfg.renew_before_s:
        state = "paused" if share == 0.0 else f"min headroom {a.h_min:.2f} >= {rv:.2f}"
        reason = f"{state}, free memory {_gib(a.free)} >= margin {_gib(a.margin)}"
        t = t.until(ts + cfg.ttl_s, t.share, t.paused_since)
        return Choice("renew", reason, t, _command(gpu, event, t, "renew", t.mem_bytes, share, t.expires_at, reason))
    reason = f"lease {t.lease_id} live until {t.expires_at:.3f}; " + (
        f"paused {paused_for:.1f} s, headroom streak {a.streak}"
        if share == 0.0
        else f"min headroom {a.h_min:.2f} >= {rv:.2f}"
    )
    return Choice("hold", reason, t, ())


def _choose_grant(gpu: str, event: Telemetry, a: Assessment, t: LeaseTerms, cfg: PolicyConfig) -> Choice:
    g, ts = cfg.grant_headroom, event.ts
    avail = a.free - a.margin - (a.serving_high - a.serving)  # serving's way back to its recent peak: never lent
    blockers = a.slow + a.short
    if blockers:
        return Choice("none", "no grant: " + "; ".join(blockers), t, ())
    if a.streak < cfg.grant_streak:
        if a.h_min < g:
            m = "ttft_p99" if a.headroom["ttft_p99"] < a.headroom["tpot_p99"] else "tpot_p99"
            return Choice("none", f"headroom {a.h_min:.2f} < {g:.2f} on {m}", t, ())
        return Choice("none", f"headroom streak {a.streak} < {cfg.grant_streak}", t, ())
    if ts < t.cooldown_until:
        return Choice("none", f"cooldown until {t.cooldown_until:.3f}", t, ())
    if avail < cfg.min_lease_bytes:
        why = f"free memory after margin and serving's recent peak {_gib(avail)} < minimum lease {_gib(cfg.min_lease_bytes)}"
        return Choice("none", why, t, ())
    load = max(a.load, a.base_load)
    share = compute_share_for(load, a.slowdown_per_share, cfg)
    if share <= 0.0:
        return Choice("none", f"serving load {load:.2f} leaves no compute share", t, ())
    epoch = t.epoch + 1
    t = replace(
        t,
        lease_id=lease_id_for(gpu, epoch),
        epoch=epoch,
        mem_bytes=_lease_mem(avail, a.h_min, cfg),
        share=share,
        expires_at=ts + cfg.ttl_s,
        granted_at=ts,
    )
    reason = (
        f"headroom {a.h_min:.2f} >= {g:.2f} for {a.streak} events, free memory after margin "
        f"{_gib(avail)} >= {_gib(cfg.min_lease_bytes)}; share {share:g}"
    )
    return Choice("grant", reason, t, _command(gpu, event, t, "grant", t.mem_bytes, share, t.expires_at, reason))


def next_view(view: GpuView, event: Telemetry, a: Assessment, t: LeaseTerms) -> GpuView:
    """The view the GPU's next event meets: this event as the latest (the one before it kept for
    the trend predictor), the lease fields as chosen, the interference estimate updated."""
    lat = event.latency_ms
    return GpuView(
        gpu=view.gpu,
        last_ts=event.ts,
        last_event_id=event.event_id,
        streak=a.streak,
        epoch=t.epoch,
        lease_id=t.lease_id,
        lease_expires_at=t.expires_at,
        lease_mem_bytes=t.mem_bytes,
        lease_compute_share=t.share,
        lease_granted_at=t.granted_at,
        cooldown_until=t.cooldown_until,
        revokes_in_row=t.revokes_in_row,
        prev_ttft_p99=lat.ttft_p99,
        prev_tpot_p99=lat.tpot_p99,
        prev_serving_mem=a.serving,
        prev_rollout_mem=event.rollout_mem_bytes,
        serving_mem_high=a.serving_high,
        serving_mem_high_ts=a.serving_high_ts,
        ignored_stale=view.ignored_stale,
        prev2_ts=view.last_ts,
        prev2_ttft_p99=view.prev_ttft_p99,
        prev2_tpot_p99=view.prev_tpot_p99,
        paused_since=t.paused_since,
        base_load=a.base_load,
        slowdown_per_share=a.slowdown_per_share,
    )
