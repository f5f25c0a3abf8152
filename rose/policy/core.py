"""The scheduling core: per-GPU views, the executors' lease states folded into them, admission,
and the calls to `decide()`. The scheduler service (Kafka records in, commands out), `rose
replay` (a recorded log) and `rose simulate` (a simulated fleet and its executors) run this
one fold; they differ only in where events come from and where commands go.

Pure like the policy: no I/O, no clock. The folding rules are docs/policy.md "Folding lease
states" (and docs/contract.md §4).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from rose.config import PolicyConfig
from rose.contract.events import Command, InvalidEvent, LeaseState, Telemetry
from rose.policy.lease_policy import (
    NEVER,
    Decision,
    GpuView,
    command_id,
    cooldown_for,
    decide,
    lease_id_for,
)

_LEASE_ENDING_STATES = frozenset(("revoking", "revoked", "expired", "rejected"))


def check_admission(event: Telemetry, record_ts_ms: int | None, key: bytes | str | None, cfg: PolicyConfig) -> None:
    """Raise InvalidEvent for telemetry the scheduler must not decide on (it goes to the dlq):
    an event time further than `max_ts_skew_s` from the Kafka record time (a broken clock
    would otherwise poison the GPU's view: every later event would look stale), or a message
    key that is not the event's GPU (it would land on another GPU's partition)."""
    if record_ts_ms is not None and record_ts_ms > 0:
        skew = event.ts - record_ts_ms / 1000.0
        if abs(skew) > cfg.max_ts_skew_s:
            raise InvalidEvent(
                "ts",
                f"event time {event.ts:.3f} is {skew:+.0f}s from the record time (limit ±{cfg.max_ts_skew_s:.0f}s)",
            )
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
    lease: dict[str, Any] = {}
    cooldown_until, revokes_in_row = view.cooldown_until, view.revokes_in_row
    if state.state in _LEASE_ENDING_STATES:
        current = view.lease_id is not None and state.lease_id == view.lease_id
        unknown = state.epoch > view.epoch
        if current or (view.lease_id is not None and unknown):
            lease = {
                "lease_id": None,
                "lease_expires_at": 0.0,
                "lease_mem_bytes": 0,
                "lease_compute_share": 0.0,
                "lease_granted_at": 0.0,
                "paused_since": -1.0,
            }
        if (current or unknown) and state.state in ("revoking", "revoked"):
            revokes_in_row += 1
            cooldown_until = max(cooldown_until, state.ts + cooldown_for(revokes_in_row, cfg))
    return replace(view, epoch=epoch, cooldown_until=cooldown_until, revokes_in_row=revokes_in_row, **lease)


class SchedulingCore:
    """The views of the GPUs a caller decides for, and the lease floor: the newest lease state
    each executor published per GPU (any GPU, owned or not). `views` and `lease_floor` may be
    the caller's own dicts: the core folds into them in place."""

    __slots__ = ("cfg", "views", "lease_floor")

    def __init__(
        self,
        cfg: PolicyConfig,
        views: dict[str, GpuView] | None = None,
        lease_floor: dict[str, LeaseState] | None = None,
    ):
        self.cfg = cfg
        self.views: dict[str, GpuView] = {} if views is None else views
        self.lease_floor: dict[str, LeaseState] = {} if lease_floor is None else lease_floor

    def admit(self, event: Telemetry, record_ts_ms: int | None, key: bytes | str | None) -> None:
        """InvalidEvent for telemetry not to decide on (`check_admission`)."""
        check_admission(event, record_ts_ms, key, self.cfg)

    def view_for(self, gpu: str) -> GpuView | None:
        """The view `decide` meets next for `gpu`: its own, or for a GPU without one, the view
        its lease floor starts it from (None: neither)."""
        v = self.views.get(gpu)
        if v is None:
            floor = self.lease_floor.get(gpu)
            if floor is not None:
                v = observe_lease_state(None, floor, self.cfg)
        return v

    def decide(self, event: Telemetry, before: dict[str, GpuView | None] | None = None) -> Decision:
        """One policy step for the event's GPU; the new views are kept. `before`, when given,
        gets the previous view of every GPU the step changes (unless it holds one already)."""
        old = self.view_for(event.gpu)
        if before is not None and event.gpu not in before:
            before[event.gpu] = self.views.get(event.gpu)
        d = decide(old, event, self.cfg)
        if self.cfg.group_size > 1 and d.explain.action != "ignored":
            d = _gang_step(self.views, old, event, d, self.cfg)
            for v in d.others:
                if before is not None and v.gpu not in before:
                    before[v.gpu] = self.views.get(v.gpu)
                self.views[v.gpu] = v
        self.views[event.gpu] = d.view
        return d

    def observe(self, state: LeaseState) -> tuple[GpuView, GpuView] | None:
        """One lease state: it becomes its GPU's floor and is folded into the GPU's view, if
        there is one: then (view before, view after), else None."""
        self.lease_floor[state.gpu] = state
        v = self.views.get(state.gpu)
        if v is None:
            return None
        nv = observe_lease_state(v, state, self.cfg)
        if nv.lease_id is None and nv.group_id:
            nv = replace(nv, group_id="", group_size=0)
        self.views[state.gpu] = nv
        return v, nv

    def restore(self, views: Iterable[GpuView], lease_states: Iterable[LeaseState]) -> None:
        """After a (re)assignment: `views` as last committed (a later one of a GPU wins), the
        floor re-read from the whole lease-state log, and each GPU's floor folded into its view."""
        for v in views:
            self.views[v.gpu] = v
        self.lease_floor.clear()
        for ls in lease_states:
            self.lease_floor[ls.gpu] = ls
        for gpu, ls in self.lease_floor.items():
            view = self.views.get(gpu)
            if view is not None:
                self.views[gpu] = observe_lease_state(view, ls, self.cfg)


# ---- gang leases (docs/policy.md "Gang leases") ------------------------------------------------

_NO_LEASE: dict[str, Any] = {
    "lease_id": None,
    "lease_expires_at": 0.0,
    "lease_mem_bytes": 0,
    "lease_compute_share": 0.0,
    "lease_granted_at": 0.0,
    "paused_since": NEVER,
    "group_id": "",
    "group_size": 0,
}


def _gang_step(
    views: dict[str, GpuView], old: GpuView | None, event: Telemetry, d: Decision, cfg: PolicyConfig
) -> Decision:
    """`decide()` judges each GPU alone; with `group_size` k > 1 a lease spans k GPUs of one
    node. This step turns the one GPU's decision into the gang's: a grant waits until k GPUs of
    the node would each be granted (then all k at once, in this step's commands: one
    transaction); a pause or revoke of one member pauses or revokes every member; a resume
    waits until every member would resume, at the smallest share any of them would take."""
    k, ts, gpu, node = cfg.group_size, event.ts, event.gpu, event.node
    v = replace(d.view, node=node)
    held = old is not None and old.lease_id is not None and old.group_id != ""
    if old is not None and held and v.lease_id == old.lease_id:  # decide() keeps the lease, not its group
        v = replace(v, group_id=old.group_id, group_size=old.group_size)
    cmds = list(d.commands)
    others: list[GpuView] = []
    explain = d.explain

    def siblings(group_id: str) -> list[GpuView]:
        return sorted(
            (w for g, w in views.items() if g != gpu and w.group_id == group_id and w.lease_id is not None),
            key=lambda w: w.gpu,
        )

    def command(w: GpuView, kind: str, mem: int, share: float, expires: float, why: str) -> Command:
        assert w.lease_id is not None
        return Command(
            command_id(event.event_id, kind, w.gpu, w.epoch),
            ts,
            kind,
            w.gpu,
            w.lease_id,
            w.epoch,
            mem,
            share,
            expires,
            why,
            event.event_id,
            w.group_id,
            w.group_size,
        )

    if held:
        assert old is not None
        if v.lease_id != old.lease_id:  # revoked here, or expired without renewal: the gang ends
            why = f"gang {old.group_id}: member {gpu} ended ({explain.reason})"
            for w in siblings(old.group_id):
                cmds.append(command(w, "revoke", 0, 0.0, ts, why))
                others.append(
                    replace(w, cooldown_until=max(w.cooldown_until, v.cooldown_until), ready_mem_bytes=0, **_NO_LEASE)
                )
            cmds = [c if c.group_id or c.gpu != gpu or c.kind != "revoke" else _in_group(c, old) for c in cmds]
            held = False

    grant = next((c for c in cmds if c.kind == "grant"), None)
    if grant is not None:  # a lone GPU qualifies: it waits for its node's other GPUs
        cmds.remove(grant)
        v = replace(
            v, epoch=grant.epoch - 1, ready_mem_bytes=grant.mem_bytes, ready_share=grant.compute_share, **_NO_LEASE
        )
        busy = {w.gpu for w in others}
        ready = sorted(
            (
                w
                for g, w in views.items()
                if g != gpu
                and g not in busy
                and w.node == node
                and w.lease_id is None
                and w.ready_mem_bytes > 0
                and w.last_ts >= ts - cfg.ttl_s
                and ts >= w.cooldown_until
            ),
            key=lambda w: w.gpu,
        )[: k - 1]
        if len(ready) < k - 1:
            explain = replace(
                explain,
                action="none",
                reason=f"gang: {len(ready) + 1} of {k} GPUs of {node} qualify; " + explain.reason,
            )
        else:
            members = [v, *ready]
            share = min(w.ready_share for w in members)
            group_id = f"{node}#{lease_id_for(gpu, v.epoch + 1)}"
            why = f"gang {group_id}: {k} GPUs of {node} qualify; share {share:g}; " + grant.reason
            granted = []
            for w in members:
                epoch = w.epoch + 1
                w = replace(
                    w,
                    epoch=epoch,
                    lease_id=lease_id_for(w.gpu, epoch),
                    lease_expires_at=ts + cfg.ttl_s,
                    lease_mem_bytes=w.ready_mem_bytes,
                    lease_compute_share=share,
                    lease_granted_at=ts,
                    group_id=group_id,
                    group_size=k,
                    ready_mem_bytes=0,
                    ready_share=0.0,
                )
                cmds.append(command(w, "grant", w.lease_mem_bytes, share, w.lease_expires_at, why))
                granted.append(w)
            v = granted[0]
            others += granted[1:]
            explain = replace(explain, action="grant", reason=why)
        return Decision(v, tuple(cmds), explain, tuple(others))

    if not held:
        return Decision(v, tuple(cmds), explain, tuple(others))
    assert old is not None
    group_id = old.group_id
    pause = any(c.kind == "throttle" and c.compute_share == 0.0 for c in cmds)
    resume = next((c for c in cmds if c.kind == "throttle" and c.compute_share > 0.0), None)
    if pause:
        why = f"gang {group_id}: member {gpu} paused ({explain.reason})"
        for w in siblings(group_id):
            if w.lease_compute_share > 0.0:
                exp = ts + cfg.ttl_s
                cmds.append(command(w, "throttle", w.lease_mem_bytes, 0.0, exp, why))
                others.append(replace(w, lease_compute_share=0.0, paused_since=ts, lease_expires_at=exp))
    elif resume is not None:  # this member would resume: the gang resumes once all would
        cmds.remove(resume)
        v = replace(
            v,
            lease_compute_share=0.0,
            paused_since=old.paused_since,
            lease_expires_at=old.lease_expires_at,
            ready_share=resume.compute_share,
        )
        sibs = siblings(group_id)
        if len(sibs) == old.group_size - 1 and all(w.lease_compute_share == 0.0 and w.ready_share > 0.0 for w in sibs):
            share = min([resume.compute_share] + [w.ready_share for w in sibs])
            why = f"gang {group_id}: every member would resume; share {share:g}; " + resume.reason
            exp = ts + cfg.ttl_s
            members = [v, *sibs]
            resumed = []
            for w in members:
                w = replace(w, lease_compute_share=share, paused_since=NEVER, lease_expires_at=exp, ready_share=0.0)
                cmds.append(command(w, "throttle", w.lease_mem_bytes, share, exp, why))
                resumed.append(w)
            v, others = resumed[0], resumed[1:]
            explain = replace(explain, reason=why)
        else:
            explain = replace(explain, action="hold", reason=f"gang {group_id}: waiting for every member to resume")
            if v.lease_expires_at - ts < cfg.renew_before_s:
                exp = ts + cfg.ttl_s
                v = replace(v, lease_expires_at=exp)
                cmds.append(command(v, "renew", v.lease_mem_bytes, 0.0, exp, explain.reason))
                explain = replace(explain, action="renew")
    # every command of a member carries the group
    cmds = [c if c.group_id else _in_group(c, old) for c in cmds]
    return Decision(v, tuple(cmds), explain, tuple(others))


def _in_group(c: Command, held: GpuView) -> Command:
    return replace(c, group_id=held.group_id, group_size=held.group_size)
