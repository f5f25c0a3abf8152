"""What the scheduler says about a command it decided: the attributes of its `lease.decide`
span (the decision's why) and its `lease.decision` log line."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rose.contract.events import Command
from rose.policy.lease_policy import POLICY_VERSION, Decision

if TYPE_CHECKING:
    from opentelemetry.util.types import AttributeValue


def decision_attrs(cmd: Command, d: Decision) -> dict[str, AttributeValue]:
    ex = d.explain
    attrs: dict[str, AttributeValue] = {
        "rose.gpu": cmd.gpu,
        "rose.kind": cmd.kind,
        "rose.epoch": cmd.epoch,
        "rose.lease_id": cmd.lease_id,
        "rose.command_id": cmd.command_id,
        "rose.reason": cmd.reason,
        "rose.free_mem_bytes": ex.free_mem_bytes,
        "rose.policy_version": POLICY_VERSION,
        "rose.cause_event_id": cmd.cause_event_id,
    }
    for metric, h in ex.headroom.items():
        attrs[f"rose.headroom.{metric}"] = h
    return attrs


def log_decision(log: Any, cmd: Command) -> None:
    log.info(
        "lease.decision",
        gpu=cmd.gpu,
        kind=cmd.kind,
        epoch=cmd.epoch,
        lease_id=cmd.lease_id,
        command_id=cmd.command_id,
        reason=cmd.reason,
        mem_bytes=cmd.mem_bytes,
        compute_share=cmd.compute_share,
    )


def log_nth(log: Any, cmds: list[Command], i: int) -> None:
    """The log line of `cmds[i]` (a `SpanPlan`'s per-span callback)."""
    log_decision(log, cmds[i])
