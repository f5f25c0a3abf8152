"""The scheduling core: per-GPU views, the executors' lease states folded into them, admission,
and the calls to `decide()`. The scheduler service (Kafka records in, commands out), `rose
replay` (a recorded log) and `rose simulate` (a simulated fleet and its executors) run this
one fold; they differ only in where events come from and where commands go.

Pure like the policy: no I/O, no clock. The folding rules are docs/policy.md "Folding lease
states" (and docs/contract.md §4).
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from rose.config import PolicyConfig
from rose.contract.events import InvalidEvent, LeaseState, Telemetry
from rose.policy import gang
from rose.policy.lease_policy import Decision, GpuView, cooldown_for, decide

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


@dataclass(frozen=True)
class BatchStep:
    """A batch decided over an overlay of the views (`SchedulingCore.step`)."""

    decisions: tuple[Decision, ...]  # one per event, in order
    views: dict[str, GpuView]  # every view the batch changed, as the batch left it


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

    def decide(self, event: Telemetry) -> Decision:
        """One policy step for the event's GPU; the new views are kept at once."""
        return self._decide(event, self.views)

    def step(self, events: Iterable[Telemetry]) -> BatchStep:
        """A batch of policy steps, in order, over an overlay of the views: each step meets the
        views the steps before it left, and the core's own views stay as they were until
        `commit(batch)` (a batch that is not committed is simply dropped)."""
        overlay: dict[str, GpuView] = {}
        return BatchStep(tuple(self._decide(ev, overlay) for ev in events), overlay)

    def commit(self, batch: BatchStep) -> None:
        """Keep the views a batch left."""
        self.views.update(batch.views)

    def _decide(self, event: Telemetry, into: dict[str, GpuView]) -> Decision:
        """One step: it reads `into` over the core's views and writes every view it changes to
        `into` (the core's views themselves, or a batch's overlay)."""
        gpu = event.gpu
        old = into[gpu] if gpu in into else self.view_for(gpu)
        d = decide(old, event, self.cfg)
        if self.cfg.group_size > 1 and d.explain.action != "ignored":
            d = gang.combine(into if into is self.views else ChainMap(into, self.views), old, event, d, self.cfg)
            for v in d.others:
                into[v.gpu] = v
        into[gpu] = d.view
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

    def forget(self, gpus: Iterable[str]) -> None:
        """Drop the views of GPUs no longer decided for here (their partitions went elsewhere)."""
        for gpu in gpus:
            self.views.pop(gpu, None)

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
