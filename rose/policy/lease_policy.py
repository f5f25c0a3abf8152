"""The lease policy: one pure step `(view, telemetry, config) -> (view', commands)`.

Every caller (the scheduler service, `rose replay`, `rose simulate`) runs this one
function; a second implementation of the policy anywhere is a defect. No I/O, no wall
clock, no randomness: time is the event's `ts`, command ids are hashes of their cause,
so the same telemetry log and config always give byte-identical commands.

What it implements (docs/contract.md §4, thresholds from `PolicyConfig`):

* Headroom of an SLO metric is `1 - p99 / slo`. A GPU is *eligible* on an event when every
  metric has headroom ≥ `grant_headroom`; `streak` counts consecutive eligible events.
* Memory. `serving = mem_used - rollout_mem`, `margin = mem_margin_frac * total`,
  `free = total - serving - max(lease_mem, rollout_mem)`: memory neither serving holds nor is
  promised to (or taken by) rollout. A grant needs `free - margin ≥ min_lease_bytes`, and its
  `mem_bytes ≤ free - margin ≤ total - serving - margin`. Capacity always comes from the GPU's
  own telemetry, so heterogeneous fleets need no global constant.
* Revoke conditions, any one suffices and revoke outranks everything:
  1. headroom < `revoke_headroom` on any metric;
  2. `free < margin` (serving grew into the lease or rollout exceeds it);
  3. trend (see "The trend predictor" below): per metric, a p99 that rose on each of the last
     two intervals, extrapolated at the smaller of the two rates: `p99 + slope *
     trend_horizon_s > slo` (the SLO would be crossed before the next sample);
  4. KV-cache growth: serving memory rising at a rate that, over `trend_horizon_s`, grows by
     ≥ `kv_growth_revoke_frac * margin`, or would push `free` below the margin.
  On a GPU without a lease, the same conditions block a grant.
* Hysteresis: between the two thresholds a lease is held and renewed; nothing is granted.
* Leases last `ttl_s` from the event that granted or renewed them; renewed once less than
  `renew_before_s` is left. A lease whose `expires_at ≤ ts` is over (the executor revoked
  itself): it is forgotten, never renewed nor revoked.
* Renewals keep the lease's size: the headroom seen while a lease is held already includes
  the rollout's interference, so it cannot size the lease without a model; resizing is
  revoke + a fresh grant.
* Cooldown after a revoke: `cooldown_s * cooldown_backoff ** (n - 1)` for the n-th revoke in
  a row, capped at `cooldown_max_s`; a lease that lived `cooldown_reset_s` resets n.
* Epochs strictly increase per GPU from grant to grant; renew and revoke carry their lease's.
* Lease size (grant only), with `h` the smallest headroom:
  `mem_bytes = max(min_lease, floor_to_granularity(avail * (0.5 + 0.5 * s)))`, where
  `avail = free - margin` and `s = (h - grant_headroom) / (1 - grant_headroom)` in [0, 1]:
  half the available memory at the grant threshold (room for the KV cache to grow under
  load), all of it on an idle GPU.
  `compute_share`: if serving is compute-bound, giving a share `c` slows it by `1 / (1 - c)`,
  so the p99 after the grant is about `(1 - h) / (1 - c) * slo`. Choose `c` so that headroom
  lands mid-hysteresis, `target = (grant_headroom + revoke_headroom) / 2`:
  `c = 1 - (1 - h) / (1 - target)`, capped at `max_compute_share`, then scaled by
  `1 - gpu_util / 2` (NVML utilisation counts any-kernel-running time, so a busy GPU can still
  have SM headroom: it halves the share at 100 %, never zeroes it).
* Duplicate or out-of-order telemetry (`ts ≤ last_ts`, or the same `event_id` as the last)
  is ignored: counter + 1, no commands, nothing else changes.

The trend predictor
-------------------
Its intent: revoke *before* the SLO is crossed when latency is genuinely climbing (a queue
building up), rather than on the event that already shows headroom < `revoke_headroom`.
Its input is noisy: a window's p99 is a small-sample tail, and under chunked prefill a GPU's
TPOT p99 is bimodal: a plain decode step (~8 ms for 7B on an H100) in a window without
prefill, the prefill-chunk stall (~70 ms) in one with it. Extrapolating one jump between two
such windows (`8 -> 70 ms` in 0.5 s: +62 ms in the next 0.5 s) crosses a 139 ms SLO, so a
two-point predictor revoked on window-to-window noise (in `rose simulate` on the Azure
traces, 190 of 192 revokes; each revoke starts a cooldown, and the backoff kept most GPUs
out). So the predictor now needs the climb to be sustained:

    samples (t2, p2), (t1, p1), (t0, p0), oldest first, t0 this event
    rising only if p2 < p1 < p0
    slope = min((p1 - p2) / (t1 - t2), (p0 - p1) / (t0 - t1))
    predicted p99 = p0 + slope * trend_horizon_s;  revoke if it exceeds the SLO

A single spike predicts nothing (`8, 8, 70`: the first interval did not rise; the two-point
predictor said 132 ms), and a spike followed by a plateau or a small further rise predicts
little (`8, 70, 71`: 72 ms). A steady ramp gives its own slope, so it is revoked on the last
sample before it would cross the SLO, as the two-point predictor did, once it has risen for
two intervals (one more sample than before); a climb steep enough to go from grant-level
headroom past the SLO in two samples is left to the headroom rule and the executor's local
guard, as it was before for one sample. The smaller rate is a
lower bound on the climb over both intervals, so noise that happens to rise twice must rise
steeply twice to revoke. Why not an EWMA-smoothed slope: its state depends on every past
sample (the simulator's exact deferral of ineligible events relies on a bounded history),
and a time constant long enough to average out the bimodal p99 (several windows) delays a
genuine climb by as much. The cost is one more sample (ts and both p99s) in `GpuView`:
`prev2_*`, `_NEVER` until seen, so a view from an older `to_dict` loads with no history and
the trend starts two events later. The headroom and memory conditions need no history and
still revoke on the very event. KV-cache growth (condition 4) stays a two-point rate on
purpose: running out of memory is not a late token but a failed or preempted request, so
one large prompt's KV growth is reason enough to give the memory back.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields

from rose.config import PolicyConfig
from rose.contract.events import Command, InvalidEvent, LeaseState, Telemetry

POLICY_VERSION = "1"

_GiB = float(1 << 30)
_NEVER = -1.0  # "no previous sample" for ts, p99 and memory fields (real values are ≥ 0)
_LEASE_ENDING_STATES = frozenset(("revoking", "revoked", "expired", "rejected"))


@dataclass(frozen=True, slots=True)
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

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in _VIEW_FIELDS}

    @classmethod
    def from_dict(cls, d: dict) -> "GpuView":
        return cls(**{k: d[k] for k in _VIEW_FIELDS if k in d})

    def holds_lease(self, ts: float) -> bool:
        """True while a lease is live at event time `ts`."""
        return self.lease_id is not None and ts < self.lease_expires_at


_VIEW_FIELDS = tuple(f.name for f in fields(GpuView))


@dataclass(frozen=True, slots=True)
class Explanation:
    """Why a decision was (not) taken: for spans, logs and `rose replay --explain`."""

    headroom: dict[str, float]  # per SLO metric, 1 - p99/slo
    predicted_headroom: dict[str, float]  # after the trend predictor (== headroom unless rising)
    free_mem_bytes: int  # total - serving - max(lease, rollout)
    action: str  # grant | renew | revoke | hold | none | ignored
    reason: str

    def to_dict(self) -> dict:
        return {"action": self.action, "reason": self.reason, "headroom": self.headroom,
                "predicted_headroom": self.predicted_headroom, "free_mem_bytes": self.free_mem_bytes}


@dataclass(frozen=True, slots=True)
class Decision:
    view: GpuView
    commands: tuple[Command, ...]
    explain: Explanation


def command_id(cause_event_id: str, kind: str, gpu: str, epoch: int) -> str:
    """Deterministic from the cause: a replay of the same log gives the same id."""
    return hashlib.sha256(f"{cause_event_id}\x1f{kind}\x1f{gpu}\x1f{epoch}".encode()).hexdigest()[:32]


def lease_id_for(gpu: str, epoch: int) -> str:
    return f"{gpu}#{epoch}"


def cooldown_for(revokes_in_row: int, cfg: PolicyConfig) -> float:
    """Cooldown after the n-th revoke in a row (n ≥ 1)."""
    return min(cfg.cooldown_s * cfg.cooldown_backoff ** (revokes_in_row - 1), cfg.cooldown_max_s)


def _gib(b: float) -> str:
    return f"{b / _GiB:.2f} GiB"


def _lease_size(avail: int, h: float, util: float, cfg: PolicyConfig) -> tuple[int, float]:
    """(mem_bytes, compute_share) of a new lease; see the module docstring."""
    g = cfg.grant_headroom
    s = (h - g) / (1.0 - g) if g < 1.0 else 1.0
    s = 0.0 if s < 0.0 else 1.0 if s > 1.0 else s
    gran = cfg.lease_granularity_bytes
    mem = int(avail * (0.5 + 0.5 * s))
    if gran > 0:
        mem -= mem % gran
    mem = max(cfg.min_lease_bytes, mem)
    target = (g + cfg.revoke_headroom) / 2.0
    share = 1.0 - (1.0 - h) / (1.0 - target) if target < 1.0 else 0.0
    share = min(share, cfg.max_compute_share) * (1.0 - util / 2.0)
    share = 0.0 if share < 0.0 else 1.0 if share > 1.0 else round(share, 4)
    return mem, share


def _trend(metric: str, p99: float, prev: float, prev2: float, slo: float, dt: float, dt2: float,
           horizon: float, why: list[str]) -> float:
    """Predicted headroom `horizon` seconds ahead: only when p99 rose on each of the last two
    intervals (`dt2` then `dt` long), extrapolated at the smaller of the two rates; appends a
    revoke reason if it crosses the SLO (module docstring: "The trend predictor")."""
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
        why = (f"duplicate event_id {event.event_id}" if event.event_id == view.last_event_id
               else f"stale: ts {ts:.3f} <= last {view.last_ts:.3f}")
        v = GpuView(view.gpu, view.last_ts, view.last_event_id, view.streak, view.epoch, view.lease_id,
                    view.lease_expires_at, view.lease_mem_bytes, view.lease_compute_share,
                    view.lease_granted_at, view.cooldown_until, view.revokes_in_row, view.prev_ttft_p99,
                    view.prev_tpot_p99, view.prev_serving_mem, view.ignored_stale + 1, view.prev2_ts,
                    view.prev2_ttft_p99, view.prev2_tpot_p99)
        return Decision(v, (), Explanation({}, {}, 0, "ignored", why))

    lat, slo = event.latency_ms, event.slo_ms
    h_ttft = 1.0 - lat.ttft_p99 / slo.ttft_p99
    h_tpot = 1.0 - lat.tpot_p99 / slo.tpot_p99
    headroom = {"ttft_p99": h_ttft, "tpot_p99": h_tpot}
    total = event.mem_total_bytes
    rollout = event.rollout_mem_bytes
    serving = event.mem_used_bytes - rollout
    margin = int(total * cfg.mem_margin_frac)

    # The lease as of this event: one whose expiry passed is over (the executor revoked itself).
    lease_id = view.lease_id
    expired_note = ""
    if lease_id is not None and ts >= view.lease_expires_at:
        expired_note = f"lease {lease_id} expired at {view.lease_expires_at:.3f} without renewal; "
        lease_id = None
    lease_mem = view.lease_mem_bytes if lease_id is not None else 0
    free = total - serving - (lease_mem if lease_mem > rollout else rollout)

    # Revoke conditions (also block grants on a GPU without a lease).
    why: list[str] = []
    rv = cfg.revoke_headroom
    if h_ttft < rv:
        why.append(f"headroom {h_ttft:.2f} < {rv:.2f} on ttft_p99")
    if h_tpot < rv:
        why.append(f"headroom {h_tpot:.2f} < {rv:.2f} on tpot_p99")
    if free < margin:
        why.append(f"free memory {_gib(free)} < margin {_gib(margin)}")
    dt = ts - view.last_ts if view.last_ts >= 0.0 else 0.0
    p_ttft, p_tpot = h_ttft, h_tpot
    horizon = cfg.trend_horizon_s
    if dt > 0.0:
        dt2 = view.last_ts - view.prev2_ts
        if view.prev2_ts >= 0.0 and dt2 > 0.0:
            p_ttft = _trend("ttft_p99", lat.ttft_p99, view.prev_ttft_p99, view.prev2_ttft_p99, slo.ttft_p99,
                            dt, dt2, horizon, why)
            p_tpot = _trend("tpot_p99", lat.tpot_p99, view.prev_tpot_p99, view.prev2_tpot_p99, slo.tpot_p99,
                            dt, dt2, horizon, why)
        prev_mem = view.prev_serving_mem
        if 0 <= prev_mem < serving and margin > 0:
            growth = (serving - prev_mem) / dt * horizon
            limit = cfg.kv_growth_revoke_frac * margin
            if growth >= limit:
                why.append(f"KV growth {_gib(growth)} per {horizon:g} s >= {_gib(limit)} "
                           f"({cfg.kv_growth_revoke_frac:g} x margin {_gib(margin)})")
            elif free - growth < margin <= free:
                why.append(f"KV growth {_gib(growth)} per {horizon:g} s would leave "
                           f"{_gib(free - growth)} < margin {_gib(margin)}")
    predicted = {"ttft_p99": p_ttft, "tpot_p99": p_tpot}

    g = cfg.grant_headroom
    h_min = h_ttft if h_ttft < h_tpot else h_tpot
    streak = view.streak + 1 if h_min >= g else 0

    epoch = view.epoch
    expires_at = view.lease_expires_at if lease_id is not None else 0.0
    share = view.lease_compute_share if lease_id is not None else 0.0
    granted_at = view.lease_granted_at if lease_id is not None else 0.0
    cooldown_until, revokes_in_row = view.cooldown_until, view.revokes_in_row
    commands: tuple[Command, ...] = ()
    gpu = view.gpu

    if lease_id is not None:
        if why:
            action, reason = "revoke", "; ".join(why)
            lived = ts - granted_at
            revokes_in_row = 1 if lived >= cfg.cooldown_reset_s else revokes_in_row + 1
            cool = cooldown_for(revokes_in_row, cfg)
            cooldown_until = ts + cool
            reason += f"; cooldown {cool:g} s"
            commands = (Command(command_id(event.event_id, "revoke", gpu, epoch), ts, "revoke", gpu, lease_id,
                                epoch, 0, 0.0, ts, reason, event.event_id),)
            lease_id, lease_mem, share, expires_at, granted_at = None, 0, 0.0, 0.0, 0.0
        elif expires_at - ts < cfg.renew_before_s:
            action = "renew"
            reason = f"min headroom {h_min:.2f} >= {rv:.2f}, free memory {_gib(free)} >= margin {_gib(margin)}"
            expires_at = ts + cfg.ttl_s
            commands = (Command(command_id(event.event_id, "renew", gpu, epoch), ts, "renew", gpu, lease_id,
                                epoch, lease_mem, share, expires_at, reason, event.event_id),)
        else:
            action = "hold"
            reason = f"lease {lease_id} live until {expires_at:.3f}; min headroom {h_min:.2f} >= {rv:.2f}"
    else:
        avail = free - margin
        if why:
            action, reason = "none", "no grant: " + "; ".join(why)
        elif streak < cfg.grant_streak:
            if h_min < g:
                m = "ttft_p99" if h_ttft < h_tpot else "tpot_p99"
                action, reason = "none", f"headroom {h_min:.2f} < {g:.2f} on {m}"
            else:
                action, reason = "none", f"headroom streak {streak} < {cfg.grant_streak}"
        elif ts < cooldown_until:
            action, reason = "none", f"cooldown until {cooldown_until:.3f}"
        elif avail < cfg.min_lease_bytes:
            action, reason = "none", (f"free memory after margin {_gib(avail)} < minimum lease "
                                      f"{_gib(cfg.min_lease_bytes)}")
        else:
            action = "grant"
            epoch += 1
            lease_id = lease_id_for(gpu, epoch)
            lease_mem, share = _lease_size(avail, h_min, event.gpu_util, cfg)
            expires_at = ts + cfg.ttl_s
            granted_at = ts
            reason = (f"headroom {h_min:.2f} >= {g:.2f} for {streak} events, free memory after margin "
                      f"{_gib(avail)} >= {_gib(cfg.min_lease_bytes)}")
            commands = (Command(command_id(event.event_id, "grant", gpu, epoch), ts, "grant", gpu, lease_id,
                                epoch, lease_mem, share, expires_at, reason, event.event_id),)
    if expired_note and not commands:  # commands stay the same whether the executor's `expired` came first
        reason = expired_note + reason

    v = GpuView(gpu, ts, event.event_id, streak, epoch, lease_id, expires_at, lease_mem, share, granted_at,
                cooldown_until, revokes_in_row, lat.ttft_p99, lat.tpot_p99, serving, view.ignored_stale,
                view.last_ts, view.prev_ttft_p99, view.prev_tpot_p99)
    return Decision(v, commands, Explanation(headroom, predicted, free, action, reason))


def check_admission(event: Telemetry, record_ts_ms: int | None, key: bytes | str | None,
                    cfg: PolicyConfig) -> None:
    """Raise InvalidEvent for telemetry the scheduler must not decide on (it goes to the dlq):
    an event time further than `max_ts_skew_s` from the Kafka record time (a broken clock
    would otherwise poison the GPU's view: every later event would look stale), or a message
    key that is not the event's GPU (it would land on another GPU's partition)."""
    if record_ts_ms is not None and record_ts_ms > 0:
        skew = event.ts - record_ts_ms / 1000.0
        if abs(skew) > cfg.max_ts_skew_s:
            raise InvalidEvent("ts", f"event time {event.ts:.3f} is {skew:+.0f}s from the record time "
                                     f"(limit ±{cfg.max_ts_skew_s:.0f}s)")
    if key is not None:
        k = key.encode() if isinstance(key, str) else key
        if k != event.gpu.encode():
            raise InvalidEvent("gpu", f"message key {k[:64]!r} does not match gpu {event.gpu!r}")


def observe_lease_state(view: GpuView | None, state: LeaseState, cfg: PolicyConfig) -> GpuView:
    """Fold an executor's lease state into the view (rebuild after restart, live updates).

    The epoch floor rises to every epoch seen, so a new grant never reuses one. A
    revoking/revoked/expired/rejected state of the current (or a newer, unknown) lease ends
    it: no renew afterwards. An `active` state never creates a lease the view does not hold:
    its expiry is unknown here, and renewing a lease the executor may already have dropped
    would resurrect it. A revoke the view did not know of starts a cooldown.
    """
    if view is None:
        view = GpuView(gpu=state.gpu)
    epoch = view.epoch if view.epoch >= state.epoch else state.epoch
    lease_id, expires_at, mem, share, granted_at = (view.lease_id, view.lease_expires_at, view.lease_mem_bytes,
                                                    view.lease_compute_share, view.lease_granted_at)
    cooldown_until, revokes_in_row = view.cooldown_until, view.revokes_in_row
    if state.state in _LEASE_ENDING_STATES:
        current = lease_id is not None and state.lease_id == lease_id
        unknown = state.epoch > view.epoch
        if current or (lease_id is not None and unknown):
            lease_id, expires_at, mem, share, granted_at = None, 0.0, 0, 0.0, 0.0
        if (current or unknown) and state.state in ("revoking", "revoked"):
            revokes_in_row += 1
            cooldown_until = max(cooldown_until, state.ts + cooldown_for(revokes_in_row, cfg))
    return GpuView(view.gpu, view.last_ts, view.last_event_id, view.streak, epoch, lease_id, expires_at, mem,
                   share, granted_at, cooldown_until, revokes_in_row, view.prev_ttft_p99, view.prev_tpot_p99,
                   view.prev_serving_mem, view.ignored_stale, view.prev2_ts, view.prev2_ttft_p99,
                   view.prev2_tpot_p99)
