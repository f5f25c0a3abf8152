"""The records that join the scheduler's GPU stage and its pool stage (docs/scheduler.md "Pool
decisions and partitioning"): a pool sample (one telemetry event of a pool, key = pool) and a
pool intent (one GPU's part of a replica to lend or reclaim, key = gpu), their bytes, and the
intent's id, a hash of its cause, replica and action.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from rose.contract.events import InvalidEvent
from rose.contract.immutable import immutable
from rose.contract.wire import load_object

LEND, RECLAIM = "lend", "reclaim"
ACTIONS = (LEND, RECLAIM)


@immutable
class PoolSample:
    """One telemetry event of a pool with replica leases, as the GPU stage writes it to
    `<prefix>pool-samples` (key = pool) in the transaction that commits the event's offset."""

    event_id: str
    ts: float
    pool: str
    gpu: str
    replica: str  # the event's replica id (the GPU itself when it names none)
    serving_state: str
    rps: float
    headroom_ok: bool  # serving, and every SLO metric had the pool's grant headroom
    mem_total_bytes: int
    epoch: int  # the GPU's epoch floor in its view
    lease_id: str  # the GPU's live replica lease ("": none)
    lease_epoch: int  # its epoch (0: none)

    @property
    def replica_id(self) -> str:
        return self.replica

    def to_bytes(self) -> bytes:
        return orjson.dumps(_fields(self), option=orjson.OPT_SORT_KEYS)

    @classmethod
    def from_bytes(cls, raw: bytes) -> PoolSample:
        return cls(**_parse(raw, _SAMPLE_TYPES, "pool-sample"))


@immutable
class PoolIntent:
    """One GPU's part of a replica to lend or reclaim, written by the pool stage to
    `<prefix>pool-intents` (key = gpu). Every GPU of the replica carries the same `intent_id`."""

    intent_id: str
    ts: float  # the cause sample's event time
    pool: str
    cause_event_id: str
    replica: str
    action: str  # one of ACTIONS
    gpu: str
    group_size: int  # GPUs of the replica
    mem_total_bytes: int
    epoch: int  # lend: the gang's epoch, above every member's floor; reclaim: the lease's
    lease_id: str  # reclaim: the live replica lease to revoke ("" none known); lend: ""
    reason: str  # the pool decision's explanation

    def to_bytes(self) -> bytes:
        return orjson.dumps(_fields(self), option=orjson.OPT_SORT_KEYS)

    @classmethod
    def from_bytes(cls, raw: bytes) -> PoolIntent:
        d = _parse(raw, _INTENT_TYPES, "pool-intent")
        if d["action"] not in ACTIONS:
            raise InvalidEvent("action", f"{d['action']!r} is not one of {ACTIONS}")
        return cls(**d)


_SAMPLE_TYPES: dict[str, tuple[type, ...]] = {
    "event_id": (str,), "ts": (float, int), "pool": (str,), "gpu": (str,), "replica": (str,),
    "serving_state": (str,), "rps": (float, int), "headroom_ok": (bool,), "mem_total_bytes": (int,),
    "epoch": (int,), "lease_id": (str,), "lease_epoch": (int,),
}  # fmt: skip
_INTENT_TYPES: dict[str, tuple[type, ...]] = {
    "intent_id": (str,), "ts": (float, int), "pool": (str,), "cause_event_id": (str,), "replica": (str,),
    "action": (str,), "gpu": (str,), "group_size": (int,), "mem_total_bytes": (int,), "epoch": (int,),
    "lease_id": (str,), "reason": (str,),
}  # fmt: skip


def _fields(record: object) -> dict[str, Any]:
    return {name: getattr(record, name) for name in record.__slots__}  # type: ignore[attr-defined]


def _parse(raw: bytes, types: dict[str, tuple[type, ...]], what: str) -> dict[str, Any]:
    """The record's fields, checked: InvalidEvent naming the first bad field."""
    d = load_object(raw)
    out: dict[str, Any] = {}
    for name, ok in types.items():
        v: Any = d.get(name)
        if not isinstance(v, ok) or (bool not in ok and isinstance(v, bool)):
            raise InvalidEvent(name, f"{what} field {name!r} is missing or not {ok[0].__name__}")
        out[name] = float(d[name]) if ok[0] is float else d[name]
    return out


def intent_id(cause_event_id: str, replica: str, action: str) -> str:
    """Deterministic from the cause: a re-decided sample gives the same id."""
    return hashlib.sha256(f"{cause_event_id}\x1f{replica}\x1f{action}".encode()).hexdigest()[:32]
