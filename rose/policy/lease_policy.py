"""The lease policy: one pure step `decide(view, telemetry, config) -> (view', commands, explanation)`.

The rules and their defaults are docs/contract.md §4; docs/policy.md explains the design
(lease sizing, hysteresis, cooldown, the trend predictor). No I/O, no wall clock, no
randomness: time is the event's `ts`, command ids are hashes of their cause, so the same
telemetry log and config always give byte-identical commands. Its callers (the scheduler
service, `rose replay`, `rose simulate`) share one fold around it, `rose.policy.core`: the
per-GPU views, the executors' lease states folded into them, admission.
"""

from __future__ import annotations

import hashlib
from dataclasses import fields, replace

from rose.config import GiB, PolicyConfig
from rose.contract.events import Command, Telemetry
from rose.contract.immutable import immutable

POLICY_VERSION = "1.1"

_NEVER = -1.0  # "no previous sample" for ts, p99 and memory fields (real values are ≥ 0)
NEVER = _NEVER


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

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in _VIEW_FIELDS}

    @classmethod
    def from_dict(cls, d: dict) -> GpuView:
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

    def to_dict(self) -> dict:
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


def command_id(cause_event_id: str, kind: str, gpu: str, epoch: int) -> str:
    """Deterministic from the cause: a replay of the same log gives the same id."""
    return hashlib.sha256(f"{cause_event_id}\x1f{kind}\x1f{gpu}\x1f{epoch}".encode()).hexdigest()[:32]


def lease_id_for(gpu: str, epoch: int) -> str:
    return f"{gpu}#{epoch}"


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


def compute_share_for(load: float, slowdown_per_share: float, cfg: PolicyConfig) -> float:
    """The compute share that lands serving's headroom mid-hysteresis, `target = (grant_headroom
    + revoke_headroom) / 2`, given its load now (worst p99 / SLO, rollout not running) and its
    slowdown `1 + a * share` (`a`: the GPU's estimate, the prior before it has one). No credit
    is taken for a time-slicing bound: the estimate is what this GPU showed."""
    a = slowdown_per_share if slowdown_per_share > 0.0 else cfg.interference_prior
    target = (cfg.grant_headroom + cfg.revoke_headroom) / 2.0
    room = (1.0 - target) / load if load > 0.0 else float("inf")  # slowdown serving can take
    if room <= 1.0:
        return 0.0
    share = min((room - 1.0) / a, cfg.max_compute_share)
    return 0.0 if share < 0.0 else 1.0 if share > 1.0 else round(share, 4)


def _ewma(old: float, x: float, w: float) -> float:
    return x if old < 0.0 else old + w * (x - old)


_SLOWDOWN_BOUNDS = (0.01, 50.0)  # keeps one freak window from zeroing or exploding the estimate


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
    """One policy step for one telemetry event of one GPU."""
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

    lat, slo = event.latency_ms, event.slo_ms
    h_ttft = 1.0 - lat.ttft_p99 / slo.ttft_p99
    h_tpot = 1.0 - lat.tpot_p99 / slo.tpot_p99
    headroom = {"ttft_p99": h_ttft, "tpot_p99": h_tpot}
    total = event.mem_total_bytes
    rollout = event.rollout_mem_bytes
    serving = event.mem_used_bytes - rollout
    margin = memory_margin(total, cfg)

    # The lease as of this event: one whose expiry passed is over (the executor revoked itself).
    lease_id = view.lease_id
    expired_note = ""
    if lease_id is not None and ts >= view.lease_expires_at:
        expired_note = f"lease {lease_id} expired at {view.lease_expires_at:.3f} without renewal; "
        lease_id = None
    lease_mem = view.lease_mem_bytes if lease_id is not None else 0
    free = free_memory(total, serving, lease_mem, rollout)

    # Two levels (v1.1). Latency conditions pause a lease's compute (throttle to share 0); memory
    # conditions revoke it. On a GPU without a lease, either blocks a grant.
    slow: list[str] = []  # latency: headroom below the revoke threshold, or the trend crosses the SLO
    short: list[str] = []  # memory: free memory below the margin, or KV growth heading there
    rv = cfg.revoke_headroom
    if h_ttft < rv:
        slow.append(f"headroom {h_ttft:.2f} < {rv:.2f} on ttft_p99")
    if h_tpot < rv:
        slow.append(f"headroom {h_tpot:.2f} < {rv:.2f} on tpot_p99")
    if free < margin:
        short.append(f"free memory {_gib(free)} < margin {_gib(margin)}")
    dt = ts - view.last_ts if view.last_ts >= 0.0 else 0.0
    p_ttft, p_tpot = h_ttft, h_tpot
    horizon = cfg.trend_horizon_s
    if dt > 0.0:
        dt2 = view.last_ts - view.prev2_ts
        if view.prev2_ts >= 0.0 and dt2 > 0.0:
            p_ttft = _trend(
                "ttft_p99", lat.ttft_p99, view.prev_ttft_p99, view.prev2_ttft_p99, slo.ttft_p99, dt, dt2, horizon, slow
            )
            p_tpot = _trend(
                "tpot_p99", lat.tpot_p99, view.prev_tpot_p99, view.prev2_tpot_p99, slo.tpot_p99, dt, dt2, horizon, slow
            )
        prev_mem = view.prev_serving_mem
        if 0 <= prev_mem < serving and margin > 0:
            growth = (serving - prev_mem) / dt * horizon
            limit = cfg.kv_growth_revoke_frac * margin
            if growth >= limit:
                short.append(
                    f"KV growth {_gib(growth)} per {horizon:g} s >= {_gib(limit)} "
                    f"({cfg.kv_growth_revoke_frac:g} x margin {_gib(margin)})"
                )
            elif free - growth < margin <= free:
                short.append(
                    f"KV growth {_gib(growth)} per {horizon:g} s would leave "
                    f"{_gib(free - growth)} < margin {_gib(margin)}"
                )
    predicted = {"ttft_p99": p_ttft, "tpot_p99": p_tpot}

    g = cfg.grant_headroom
    h_min = h_ttft if h_ttft < h_tpot else h_tpot
    streak = view.streak + 1 if h_min >= g else 0

    epoch = view.epoch
    expires_at = view.lease_expires_at if lease_id is not None else 0.0
    share = view.lease_compute_share if lease_id is not None else 0.0
    granted_at = view.lease_granted_at if lease_id is not None else 0.0
    paused_since = view.paused_since if lease_id is not None else _NEVER
    cooldown_until, revokes_in_row = view.cooldown_until, view.revokes_in_row
    commands: tuple[Command, ...] = ()
    gpu = view.gpu

    # The interference estimate: serving's load alone on calm events with no rollout running
    # (never on an event deferral may hold back: those have h_min < grant_headroom), and its
    # slowdown per unit of share on events where a lease runs.
    load = 1.0 - h_min
    base_load, per_share = view.base_load, view.slowdown_per_share
    w_est = cfg.interference_weight
    if lease_id is not None and share > 0.0:
        if base_load > 0.0:
            obs = (load / base_load - 1.0) / share
            lo, hi = _SLOWDOWN_BOUNDS
            per_share = _ewma(per_share, lo if obs < lo else hi if obs > hi else obs, w_est)
    elif h_min >= g:
        base_load = _ewma(base_load, load, w_est)

    def command(kind: str, mem: int, cshare: float, expires: float, why: str) -> tuple[Command, ...]:
        assert lease_id is not None  # every command is about a lease: the held one, or the one granted
        return (
            Command(
                command_id(event.event_id, kind, gpu, epoch),
                ts,
                kind,
                gpu,
                lease_id,
                epoch,
                mem,
                cshare,
                expires,
                why,
                event.event_id,
            ),
        )

    if lease_id is not None:
        paused_for = ts - paused_since if paused_since >= 0.0 else 0.0
        if short or paused_for >= cfg.max_pause_s:
            action = "revoke"
            reason = "; ".join(short) if short else f"paused for {paused_for:.1f} s >= {cfg.max_pause_s:g} s"
            lived = ts - granted_at
            revokes_in_row = 1 if lived >= cfg.cooldown_reset_s else revokes_in_row + 1
            cool = cooldown_for(revokes_in_row, cfg)
            cooldown_until = ts + cool
            reason += f"; cooldown {cool:g} s"
            commands = command("revoke", 0, 0.0, ts, reason)
            lease_id, lease_mem, share, expires_at, granted_at, paused_since = None, 0, 0.0, 0.0, 0.0, _NEVER
        elif slow and share > 0.0:
            action, reason = "throttle", "pause: " + "; ".join(slow)
            share, paused_since, expires_at = 0.0, ts, ts + cfg.ttl_s
            commands = command("throttle", lease_mem, share, expires_at, reason)
        elif share == 0.0 and not slow and streak >= cfg.grant_streak:
            share = compute_share_for(max(load, base_load), per_share, cfg)
            if share > 0.0:
                action = "throttle"
                reason = (
                    f"resume: headroom {h_min:.2f} >= {g:.2f} for {streak} events after "
                    f"{paused_for:.1f} s paused; share {share:g}"
                )
                paused_since, expires_at = _NEVER, ts + cfg.ttl_s
                commands = command("throttle", lease_mem, share, expires_at, reason)
            else:
                action, reason = "hold", f"paused: serving load {max(load, base_load):.2f} leaves no share"
                if expires_at - ts < cfg.renew_before_s:
                    action, expires_at = "renew", ts + cfg.ttl_s
                    commands = command("renew", lease_mem, 0.0, expires_at, reason)
        elif expires_at - ts < cfg.renew_before_s:
            action = "renew"
            state = "paused" if share == 0.0 else f"min headroom {h_min:.2f} >= {rv:.2f}"
            reason = f"{state}, free memory {_gib(free)} >= margin {_gib(margin)}"
            expires_at = ts + cfg.ttl_s
            commands = command("renew", lease_mem, share, expires_at, reason)
        else:
            action = "hold"
            reason = f"lease {lease_id} live until {expires_at:.3f}; " + (
                f"paused {paused_for:.1f} s, headroom streak {streak}"
                if share == 0.0
                else f"min headroom {h_min:.2f} >= {rv:.2f}"
            )
    else:
        avail = free - margin
        blockers = slow + short
        if blockers:
            action, reason = "none", "no grant: " + "; ".join(blockers)
        elif streak < cfg.grant_streak:
            if h_min < g:
                m = "ttft_p99" if h_ttft < h_tpot else "tpot_p99"
                action, reason = "none", f"headroom {h_min:.2f} < {g:.2f} on {m}"
            else:
                action, reason = "none", f"headroom streak {streak} < {cfg.grant_streak}"
        elif ts < cooldown_until:
            action, reason = "none", f"cooldown until {cooldown_until:.3f}"
        elif avail < cfg.min_lease_bytes:
            action, reason = (
                "none",
                (f"free memory after margin {_gib(avail)} < minimum lease {_gib(cfg.min_lease_bytes)}"),
            )
        elif (grant_share := compute_share_for(max(load, base_load), per_share, cfg)) <= 0.0:
            action, reason = "none", f"serving load {max(load, base_load):.2f} leaves no compute share"
        else:
            action = "grant"
            epoch += 1
            lease_id = lease_id_for(gpu, epoch)
            lease_mem, share = _lease_mem(avail, h_min, cfg), grant_share
            expires_at = ts + cfg.ttl_s
            granted_at = ts
            reason = (
                f"headroom {h_min:.2f} >= {g:.2f} for {streak} events, free memory after margin "
                f"{_gib(avail)} >= {_gib(cfg.min_lease_bytes)}; share {share:g}"
            )
            commands = command("grant", lease_mem, share, expires_at, reason)
    if expired_note and not commands:  # commands stay the same whether the executor's `expired` came first
        reason = expired_note + reason

    v = GpuView(
        gpu=gpu,
        last_ts=ts,
        last_event_id=event.event_id,
        streak=streak,
        epoch=epoch,
        lease_id=lease_id,
        lease_expires_at=expires_at,
        lease_mem_bytes=lease_mem,
        lease_compute_share=share,
        lease_granted_at=granted_at,
        cooldown_until=cooldown_until,
        revokes_in_row=revokes_in_row,
        prev_ttft_p99=lat.ttft_p99,
        prev_tpot_p99=lat.tpot_p99,
        prev_serving_mem=serving,
        ignored_stale=view.ignored_stale,
        prev2_ts=view.last_ts,
        prev2_ttft_p99=view.prev_ttft_p99,
        prev2_tpot_p99=view.prev_tpot_p99,
        paused_since=paused_since,
        base_load=base_load,
        slowdown_per_share=per_share,
    )
    return Decision(v, commands, Explanation(headroom, predicted, free, action, reason))
