"""A lease command and its id: apart from `decide()` because the gang, pool and replica-intent
decisions build the same commands, with ids hashed from their cause."""

from __future__ import annotations

import hashlib
from typing import Protocol

from rose.contract.events import Command


def command_id(cause_event_id: str, kind: str, gpu: str, epoch: int) -> str:
    """Deterministic from the cause: a replay of the same log gives the same id."""
    return hashlib.sha256(f"{cause_event_id}\x1f{kind}\x1f{gpu}\x1f{epoch}".encode()).hexdigest()[:32]


class Cause(Protocol):
    """What a command is decided on: a telemetry event, or a pool intent's cause."""

    @property
    def event_id(self) -> str: ...
    @property
    def ts(self) -> float: ...


def lease_command(
    cause: Cause,
    kind: str,
    gpu: str,
    lease_id: str,
    epoch: int,
    *,
    mem_bytes: int,
    compute_share: float,
    expires_at: float,
    reason: str,
    group_id: str = "",
    group_size: int = 0,
    lease_kind: str = "coresident",
) -> Command:
    """A command about lease `lease_id` (epoch `epoch`) of `gpu`, decided on telemetry `cause`:
    its time is the event's, its id a hash of the cause (`command_id`)."""
    return Command(
        command_id=command_id(cause.event_id, kind, gpu, epoch),
        ts=cause.ts,
        kind=kind,
        gpu=gpu,
        lease_id=lease_id,
        epoch=epoch,
        mem_bytes=mem_bytes,
        compute_share=compute_share,
        expires_at=expires_at,
        reason=reason,
        cause_event_id=cause.event_id,
        group_id=group_id,
        group_size=group_size,
        lease_kind=lease_kind,
    )


def lease_id_for(gpu: str, epoch: int) -> str:
    return f"{gpu}#{epoch}"
