"""The scheduling core: per-GPU views, the executors' lease states folded into them, admission,
and the calls to `decide()`. The scheduler service (Kafka records in, commands out), `rose
replay` (a recorded log) and `rose simulate` (a simulated fleet and its executors) run this
one fold through its one entry, `SchedulingCore.apply(Batch) -> Applied` (the shape of
Temporal's workflow activation: one poll's inputs in, its commands out); they differ only in
where events come from and where commands go.

Pure like the policy: no I/O, no clock. The folding rules are docs/policy.md "Folding lease
states" (and docs/contract.md §4).
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rose.config import PolicyConfig
from rose.contract.events import Command, InvalidEvent, LeaseState, Telemetry
from rose.policy import gang
from rose.policy.lease_policy import Decision, GpuView, cooldown_for, decide
from rose.policy.pool import PoolConfig
from rose.policy.pool_records import PoolIntent, PoolSample
from rose.policy.pool_stage import sample_of
from rose.policy.replica_intents import apply_intent, holds_replica_lease, replica_step

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
class Arrival:
    """A telemetry event as it arrived, with what admission checks it against: its Kafka
    record time (ms) and message key (`check_admission`)."""

    event: Telemetry
    record_ts_ms: int | None = None
    key: bytes | str | None = None


@dataclass(frozen=True)
class Batch:
    """One activation of the core, applied in this order: views the caller has committed, GPUs
    it no longer decides for, executors' lease states, pool intents, then telemetry. A bare `Telemetry` in
    `telemetry` is admitted unchecked (it did not come through Kafka)."""

    committed: Mapping[str, GpuView] = field(default_factory=dict)  # an earlier held batch's `Applied.views`
    forget: Iterable[str] = ()  # GPUs whose partitions went elsewhere: their views are dropped
    lease_states: Sequence[LeaseState] = ()
    # the pool stage's intents for these GPUs (docs/scheduler.md "Pool decisions and partitioning")
    intents: Sequence[PoolIntent] = ()
    telemetry: Sequence[Telemetry | Arrival] = ()
    # decide over an overlay of the views and keep none of them: the caller publishes
    # `Applied.views` with its commands and hands them back as `committed` once that commits
    hold: bool = False


@dataclass(frozen=True)
class Applied:
    """What a batch decided: the commands to send are in `decisions`, the views to publish in
    `views`."""

    admitted: tuple[Telemetry | InvalidEvent, ...]  # per arrival: its event, or why not (the dlq)
    decisions: tuple[Decision, ...]  # one per admitted event, in order
    met: tuple[GpuView | None, ...]  # per decision, the view of its GPU it met
    folded: tuple[tuple[GpuView | None, GpuView], ...]  # per lease state: its GPU's next view before, after
    # held: every view the telemetry changed, as the batch left it (else none: the core kept them)
    views: dict[str, GpuView]
    intent_commands: tuple[Command, ...] = ()  # the intents' commands, before the decisions'
    # one per decided event of a pool with replica leases, for `<prefix>pool-samples`
    samples: tuple[PoolSample, ...] = ()

    @property
    def commands(self) -> list[Command]:
        return [*self.intent_commands, *(c for d in self.decisions for c in d.commands)]


class SchedulingCore:
    """The views of the GPUs a caller decides for, and the lease floor: the newest lease state
    each executor published per GPU (any GPU, owned or not). `apply` is the one step, `restore`
    the takeover of a (re)assignment."""

    __slots__ = ("cfg", "views", "lease_floor", "pools")

    def __init__(
        self,
        cfg: PolicyConfig,
        views: dict[str, GpuView] | None = None,
        lease_floor: dict[str, LeaseState] | None = None,
        pools: Mapping[str, PoolConfig] | None = None,
    ):
        self.cfg = cfg
        self.pools: Mapping[str, PoolConfig] = {} if pools is None else pools  # pools with replica leases
        self.views: dict[str, GpuView] = {} if views is None else views
        self.lease_floor: dict[str, LeaseState] = {} if lease_floor is None else lease_floor

    def apply(self, batch: Batch) -> Applied:
        """One batch (`Batch` says in which order its parts apply). Telemetry is decided in
        order, each step meeting the views the steps before it left; with `hold` over an
        overlay, so that a batch whose commands never commit is simply dropped."""
        self.views.update(batch.committed)
        for gpu in batch.forget:
            self.views.pop(gpu, None)
        folded = tuple(self._observe(ls) for ls in batch.lease_states)
        admitted = tuple(self._admit(a) for a in batch.telemetry)
        into: dict[str, GpuView] = {} if batch.hold else self.views
        intent_commands = tuple(c for i in batch.intents for c in self._apply_intent(i, into))
        steps = [self._decide(ev, into) for ev in _decided(admitted)]
        met = tuple(m for m, _ in steps)
        views = into if batch.hold else {}
        decisions = tuple(d for _, d in steps)
        samples = tuple(
            self._sample(ev, d.view)
            for ev, d in zip(_decided(admitted), decisions, strict=True)
            if d.explain.action != "ignored"  # a duplicate or stale event: its sample went before
        )
        kept = tuple(s for s in samples if s is not None)
        return Applied(admitted, decisions, met, folded, views, intent_commands, kept)

    def _sample(self, event: Telemetry, view: GpuView) -> PoolSample | None:
        """The pool sample of a decided event (its GPU's view after it), if its pool lends replicas."""
        pool = self.pools.get(event.pool)
        if pool is None:
            return None
        lease = (view.lease_id, view.epoch) if holds_replica_lease(view) and view.lease_id else None
        return sample_of(event, view.epoch, lease, pool.headroom)

    def _apply_intent(self, intent: PoolIntent, into: dict[str, GpuView]) -> tuple[Command, ...]:
        """One pool intent on its GPU's view (read from `into` over the core's views)."""
        gpu = intent.gpu
        view, commands = apply_intent(into[gpu] if gpu in into else self._view_for(gpu), intent, self.cfg)
        into[gpu] = view
        return commands

    def _admit(self, arrival: Telemetry | Arrival) -> Telemetry | InvalidEvent:
        if not isinstance(arrival, Arrival):
            return arrival
        try:
            check_admission(arrival.event, arrival.record_ts_ms, arrival.key, self.cfg)
        except InvalidEvent as e:
            return e
        return arrival.event

    def _view_for(self, gpu: str) -> GpuView | None:
        """The view a decision meets next for `gpu`: its own, or for a GPU without one, the view
        its lease floor starts it from (None: neither)."""
        v = self.views.get(gpu)
        if v is None:
            floor = self.lease_floor.get(gpu)
            if floor is not None:
                v = observe_lease_state(None, floor, self.cfg)
        return v

    def _decide(self, event: Telemetry, into: dict[str, GpuView]) -> tuple[GpuView | None, Decision]:
        """One step: it reads `into` over the core's views and writes every view it changes to
        `into` (the core's views themselves, or a held batch's overlay). The view it met, and
        the decision."""
        gpu = event.gpu
        old = into[gpu] if gpu in into else self._view_for(gpu)
        if old is not None and holds_replica_lease(old):  # lent: the co-resident rule stays off
            d = replica_step(old, event, self.cfg)
            into[gpu] = d.view
            return old, d
        d = decide(old, event, self.cfg)
        if old is not None and old.intent_id:  # the last intent applied stays known (applied once)
            d = replace(d, view=replace(d.view, intent_id=old.intent_id))
        if self.cfg.group_size > 1 and d.explain.action != "ignored":
            d = gang.combine(into if into is self.views else ChainMap(into, self.views), old, event, d, self.cfg)
            for v in d.others:
                into[v.gpu] = v
        into[gpu] = d.view
        return old, d

    def _observe(self, state: LeaseState) -> tuple[GpuView | None, GpuView]:
        """One lease state: it becomes its GPU's floor and is folded into the GPU's view, if
        there is one. The view the GPU's next decision meets, before and after."""
        gpu = state.gpu
        before = self._view_for(gpu)
        self.lease_floor[gpu] = state
        v = self.views.get(gpu)
        if v is None:
            return before, observe_lease_state(None, state, self.cfg)
        nv = observe_lease_state(v, state, self.cfg)
        if nv.lease_id is None and (nv.group_id or nv.lease_kind != "coresident"):
            nv = replace(nv, group_id="", group_size=0, lease_kind="coresident")
        self.views[gpu] = nv
        return before, nv

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


def _decided(admitted: Iterable[Telemetry | InvalidEvent]) -> list[Telemetry]:
    return [ev for ev in admitted if isinstance(ev, Telemetry)]
