"""The GPU stage's side of pool intents (docs/scheduler.md "Pool decisions and partitioning",
step 3): an intent turned into its GPU's commands with the GPU's own epoch, applied once per
intent id, and the step that holds a replica lease while its replica is lent.

The GPU stage stays the one writer of commands for its GPU, so epochs stay strictly increasing
per GPU however replica and co-resident leases interleave. While a GPU's view holds a replica
lease, `decide()` (the co-resident rule) does not run on it: no co-resident lease is granted on a
GPU whose replica an intent lends. Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from rose.config import PolicyConfig
from rose.contract.events import Command, Telemetry
from rose.contract.immutable import immutable
from rose.policy.lease_commands import lease_command
from rose.policy.lease_policy import NO_LEASE, Decision, Explanation, GpuView
from rose.policy.pool import LEASE_REPLICA, replica_grant, replica_revoke
from rose.policy.pool_records import LEND, PoolIntent

_NO_LEASE: dict[str, Any] = {**NO_LEASE, "lease_kind": "coresident"}


@immutable
class IntentCause:
    """An intent as the cause of its commands: their ids hash the intent id, their time is the
    intent's (its sample's event time)."""

    event_id: str
    ts: float


def holds_replica_lease(view: GpuView | None) -> bool:
    return view is not None and view.lease_id is not None and view.lease_kind == LEASE_REPLICA


def apply_intent(view: GpuView | None, intent: PoolIntent, cfg: PolicyConfig) -> tuple[GpuView, tuple[Command, ...]]:
    """The GPU's view after the intent, and its commands. An intent already applied (the view's
    `intent_id`) gives none. A lend revokes a co-resident lease first, then grants the replica
    lease at an epoch above the GPU's own and the gang's (`intent.epoch`); a lend of a GPU that
    holds a replica lease already gives none. A reclaim revokes the held replica lease, if any
    (none held: the executor readmits a replica without a lease by itself)."""
    v = GpuView(gpu=intent.gpu) if view is None else view
    if v.intent_id == intent.intent_id:
        return v, ()
    cause = IntentCause(intent.intent_id, intent.ts)
    applied = replace(v, intent_id=intent.intent_id)
    if intent.action != LEND:
        if not holds_replica_lease(v):
            return applied, ()
        assert v.lease_id is not None
        revoke = replica_revoke(cause, v.gpu, v.lease_id, v.epoch, intent.reason)
        return replace(applied, **_NO_LEASE), (revoke,)
    if holds_replica_lease(v):
        return applied, ()
    out: list[Command] = []
    if v.lease_id is not None:  # a co-resident lease leaves before the replica is lent
        out.append(
            lease_command(
                cause, "revoke", v.gpu, v.lease_id, v.epoch, mem_bytes=0, compute_share=0.0,
                expires_at=intent.ts, reason=f"revoked for a replica lease: {intent.reason}",
            )
        )  # fmt: skip
    epoch = max(v.epoch + 1, intent.epoch)
    group = f"{intent.replica}#{intent.epoch}"
    grant = replica_grant(
        cause, v.gpu, intent.mem_total_bytes, epoch, group, intent.group_size, intent.reason, cfg
    )  # fmt: skip
    out.append(grant)
    lease: dict[str, Any] = dict(_NO_LEASE, lease_id=grant.lease_id, lease_expires_at=grant.expires_at)
    lease.update(lease_mem_bytes=grant.mem_bytes, lease_compute_share=1.0, lease_granted_at=intent.ts)
    lease.update(group_id=group, group_size=intent.group_size, lease_kind=LEASE_REPLICA)
    return replace(applied, epoch=epoch, **lease), tuple(out)


def replica_step(view: GpuView, event: Telemetry, cfg: PolicyConfig) -> Decision:
    """A telemetry event of a GPU whose view holds a replica lease: the lease is renewed as a
    co-resident one would be (less than `renew_before_s` left), and ends in the view once expired
    (the executor's fail-safe has readmitted the replica). Stale events are ignored."""
    if event.ts <= view.last_ts:
        nv = replace(view, ignored_stale=view.ignored_stale + 1)
        return Decision(nv, (), _why("ignored", "stale or duplicate event"))
    seen = replace(view, last_ts=event.ts, last_event_id=event.event_id)
    assert view.lease_id is not None
    if event.ts >= view.lease_expires_at:
        return Decision(replace(seen, **_NO_LEASE), (), _why("none", f"replica lease {view.lease_id} expired"))
    if view.lease_expires_at - event.ts >= cfg.renew_before_s:
        return Decision(seen, (), _why("hold", f"replica lease {view.lease_id} held"))
    expires = event.ts + cfg.ttl_s
    renew = lease_command(
        event, "renew", view.gpu, view.lease_id, view.epoch, mem_bytes=view.lease_mem_bytes, compute_share=1.0,
        expires_at=expires, reason="replica lease renewed: its replica is lent",
        group_id=view.group_id, group_size=view.group_size, lease_kind=LEASE_REPLICA,
    )  # fmt: skip
    return Decision(replace(seen, lease_expires_at=expires), (renew,), _why("renew", renew.reason))


def _why(action: str, reason: str) -> Explanation:
    return Explanation({}, {}, 0, action, reason)
