"""Gang leases (docs/policy.md "Gang leases"): with `policy.group_size` k > 1 a lease spans k
GPUs of one node, one tensor-parallel rollout worker.

`decide()` judges one GPU alone. `combine()` turns that lone decision into the gang's: it
reads what the GPU alone would do (grant, pause, resume, renew, end its lease) and combines
it with what the node's other GPUs last decided alone, which their views keep
(`ready_mem_bytes`: the lease one would have been granted, `ready_share`: the share a paused
member would have resumed to), and with the leases they hold:

- a grant waits until k GPUs of the node would each be granted; then all k are granted at
  once, at the smallest share any of them would take, in this step's commands (one
  transaction);
- a pause of one member pauses every member;
- a resume waits until every member would resume, at the smallest share any of them would
  take; meanwhile the member holds (and renews) its paused lease;
- a member whose lease ends (revoked, or expired without renewal) ends the gang: every other
  member is revoked and shares its cooldown;
- so does a member whose lease ended outside a step (its executor rejected the grant, or let
  the lease expire): the next event of a member still holding the lease revokes every one left.

Every command of a member carries the gang (`group_id`, `group_size`). Pure like `decide()`:
no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from rose.config import PolicyConfig
from rose.contract.events import Command, Telemetry
from rose.policy.lease_commands import lease_command, lease_id_for
from rose.policy.lease_policy import NEVER, NO_LEASE, Decision, Explanation, GpuView


def combine(
    views: Mapping[str, GpuView], old: GpuView | None, event: Telemetry, solo: Decision, cfg: PolicyConfig
) -> Decision:
    """The gang's decision for `event`, from `solo` (what `decide()` gave the event's GPU alone,
    from view `old`) and `views` (every GPU's view before this step). The decision's `others`
    are the views of the other members the step changed."""
    gpu = event.gpu
    v = replace(solo.view, node=event.node)
    gang = old if old is not None and old.lease_id is not None and old.group_id else None
    if gang is not None and v.lease_id == gang.lease_id:  # decide() keeps the lease, not its group
        v = replace(v, group_id=gang.group_id, group_size=gang.group_size)
    own = solo.commands
    ended: tuple[Command, ...] = ()
    others: tuple[GpuView, ...] = ()
    explain = solo.explain
    if gang is not None and v.lease_id != gang.lease_id:  # revoked here, or expired without renewal
        own = tuple(_in_group(c, gang) if c.kind == "revoke" and c.gpu == gpu else c for c in own)
        ended, others = _end(views, gang, v, event, solo.explain.reason)
        gang = None
    elif gang is not None and (lost := gang.group_size - 1 - len(_siblings(views, gpu, gang.group_id))) > 0:
        # a member's lease ended outside a step (its executor rejected it, or it expired there)
        why = f"gang {gang.group_id}: {lost} member(s) lost their lease"
        own = (_command(event, v, "revoke", 0, 0.0, event.ts, why),)
        v = replace(v, **NO_LEASE)
        ended, others = _end(views, gang, v, event, why)
        explain = replace(explain, action="revoke", reason=why)
        gang = None
    grant = next((c for c in own if c.kind == "grant"), None)
    if grant is not None:  # a lone GPU qualifies: the gang forms once k GPUs of its node do
        kept = tuple(c for c in own if c is not grant)
        return _form(views, v, grant, event, cfg, kept + ended, others, solo.explain)
    if gang is None:
        return Decision(v, own + ended, explain, others)
    pause = any(c.kind == "throttle" and c.compute_share == 0.0 for c in own)
    resume = next((c for c in own if c.kind == "throttle" and c.compute_share > 0.0), None)
    cmds = own
    if pause:
        paused, others = _pause(views, gang, event, cfg, explain.reason)
        cmds += paused
    elif resume is not None:
        v, resumed, others, explain = _resume(views, gang, v, resume, event, cfg, explain)
        cmds = tuple(c for c in own if c is not resume) + resumed
    return Decision(v, tuple(c if c.group_id else _in_group(c, gang) for c in cmds), explain, others)


def _siblings(views: Mapping[str, GpuView], gpu: str, group_id: str) -> list[GpuView]:
    """The other members of gang `group_id` that still hold their lease, by GPU."""
    return sorted(
        (w for g, w in views.items() if g != gpu and w.group_id == group_id and w.lease_id is not None),
        key=lambda w: w.gpu,
    )


def _command(event: Telemetry, w: GpuView, kind: str, mem: int, share: float, expires: float, why: str) -> Command:
    """A command about member `w`'s lease, in its gang."""
    assert w.lease_id is not None
    return lease_command(
        event,
        kind,
        w.gpu,
        w.lease_id,
        w.epoch,
        mem_bytes=mem,
        compute_share=share,
        expires_at=expires,
        reason=why,
        group_id=w.group_id,
        group_size=w.group_size,
    )


def _in_group(c: Command, gang: GpuView) -> Command:
    return replace(c, group_id=gang.group_id, group_size=gang.group_size)


def _end(
    views: Mapping[str, GpuView], gang: GpuView, v: GpuView, event: Telemetry, reason: str
) -> tuple[tuple[Command, ...], tuple[GpuView, ...]]:
    """Member `event.gpu` of `gang` lost its lease: revoke every other member; each shares the
    member's cooldown."""
    why = f"gang {gang.group_id}: member {event.gpu} ended ({reason})"
    sibs = _siblings(views, event.gpu, gang.group_id)
    cmds = tuple(_command(event, w, "revoke", 0, 0.0, event.ts, why) for w in sibs)
    others = tuple(
        replace(w, cooldown_until=max(w.cooldown_until, v.cooldown_until), ready_mem_bytes=0, **NO_LEASE) for w in sibs
    )
    return cmds, others


def _form(
    views: Mapping[str, GpuView],
    v: GpuView,
    grant: Command,
    event: Telemetry,
    cfg: PolicyConfig,
    cmds: tuple[Command, ...],
    others: tuple[GpuView, ...],
    explain: Explanation,
) -> Decision:
    """`grant` is what the event's GPU alone would be granted: grant it with k - 1 other GPUs of
    its node that would be granted too (live, out of cooldown, no lease), or keep it waiting."""
    k, ts, node = cfg.group_size, event.ts, event.node
    v = replace(v, epoch=grant.epoch - 1, ready_mem_bytes=grant.mem_bytes, ready_share=grant.compute_share, **NO_LEASE)
    busy = {w.gpu for w in others}
    ready = sorted(
        (
            w
            for g, w in views.items()
            if g != event.gpu
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
        why = f"gang: {len(ready) + 1} of {k} GPUs of {node} qualify; " + explain.reason
        return Decision(v, cmds, replace(explain, action="none", reason=why), others)
    members = [v, *ready]
    share = min(w.ready_share for w in members)
    group_id = f"{node}#{lease_id_for(event.gpu, v.epoch + 1)}"
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
        cmds += (_command(event, w, "grant", w.lease_mem_bytes, share, w.lease_expires_at, why),)
        granted.append(w)
    return Decision(granted[0], cmds, replace(explain, action="grant", reason=why), others + tuple(granted[1:]))


def _pause(
    views: Mapping[str, GpuView], gang: GpuView, event: Telemetry, cfg: PolicyConfig, reason: str
) -> tuple[tuple[Command, ...], tuple[GpuView, ...]]:
    """Member `event.gpu` paused: pause every other member still running."""
    ts = event.ts
    why = f"gang {gang.group_id}: member {event.gpu} paused ({reason})"
    cmds: tuple[Command, ...] = ()
    others: tuple[GpuView, ...] = ()
    for w in _siblings(views, event.gpu, gang.group_id):
        if w.lease_compute_share > 0.0:
            exp = ts + cfg.ttl_s
            cmds += (_command(event, w, "throttle", w.lease_mem_bytes, 0.0, exp, why),)
            others += (replace(w, lease_compute_share=0.0, paused_since=ts, lease_expires_at=exp),)
    return cmds, others


def _resume(
    views: Mapping[str, GpuView],
    gang: GpuView,
    v: GpuView,
    resume: Command,
    event: Telemetry,
    cfg: PolicyConfig,
    explain: Explanation,
) -> tuple[GpuView, tuple[Command, ...], tuple[GpuView, ...], Explanation]:
    """Member `event.gpu` would resume (`resume`): every member resumes once all would, at the
    smallest share; until then the member stays paused and renews its lease when due."""
    ts = event.ts
    v = replace(
        v,
        lease_compute_share=0.0,
        paused_since=gang.paused_since,
        lease_expires_at=gang.lease_expires_at,
        ready_share=resume.compute_share,
    )
    sibs = _siblings(views, event.gpu, gang.group_id)
    if len(sibs) == gang.group_size - 1 and all(w.lease_compute_share == 0.0 and w.ready_share > 0.0 for w in sibs):
        share = min([resume.compute_share] + [w.ready_share for w in sibs])
        why = f"gang {gang.group_id}: every member would resume; share {share:g}; " + resume.reason
        exp = ts + cfg.ttl_s
        resumed = [
            replace(w, lease_compute_share=share, paused_since=NEVER, lease_expires_at=exp, ready_share=0.0)
            for w in [v, *sibs]
        ]
        cmds = tuple(_command(event, w, "throttle", w.lease_mem_bytes, share, exp, why) for w in resumed)
        return resumed[0], cmds, tuple(resumed[1:]), replace(explain, reason=why)
    explain = replace(explain, action="hold", reason=f"gang {gang.group_id}: waiting for every member to resume")
    if v.lease_expires_at - ts >= cfg.renew_before_s:
        return v, (), (), explain
    v = replace(v, lease_expires_at=ts + cfg.ttl_s)
    renew = _command(event, v, "renew", v.lease_mem_bytes, 0.0, v.lease_expires_at, explain.reason)
    return v, (renew,), (), replace(explain, action="renew")
