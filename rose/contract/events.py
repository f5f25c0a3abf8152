"""The three event types of the contract, as typed values, with strict decoding.

schemas/*.json is the single source of truth; these types mirror it and
tests/test_schemas.py proves that they agree. Decoding is hand-written rather than
run through a JSON Schema validator because it sits on the scheduler's hot path
(≥ 100k events/s); it checks everything the schema checks, plus the cross-field rules
a schema cannot express (used ≤ total, rollout ≤ used).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from rose.contract.immutable import immutable

TELEMETRY_SCHEMA = "rose.telemetry.v1"
COMMAND_SCHEMA = "rose.command.v1"
LEASE_STATE_SCHEMA = "rose.lease_state.v1"

COMMAND_KINDS = ("grant", "renew", "throttle", "revoke")  # throttle: v1.1
# the kinds that state a live lease: its compute share and a new expiry (a throttle renews too, §2.2)
LEASE_SETTING_KINDS = ("grant", "renew", "throttle")
# paused: v1.1; draining, reclaiming: v1.3 (a replica lease leaving and re-entering its router, §7)
LEASE_STATES = ("active", "paused", "revoking", "revoked", "expired", "rejected", "draining", "reclaiming")
# v1.3 (§7): what a serving replica is doing; absent on the wire = "serving"
SERVING_STATES = ("serving", "draining", "lent", "reclaiming")
# v1.3 (§7): a co-resident lease shares a GPU with a serving engine; a replica lease takes a whole
# replica out of its router; absent on the wire = "coresident"
LEASE_KINDS = ("coresident", "replica")

MAX_ID_LEN = 256
MAX_REASON_LEN = 1024
MAX_BYTES = 1 << 50  # 1 PiB: no GPU of this decade holds more; larger is corrupt input
MAX_TS = 1e11  # year ~5138; a larger event time is garbage, not a clock
MAX_QUEUE = 1 << 31
MAX_RPS = 1e9
MAX_MS = 1e9
MAX_GROUP_SIZE = 64  # GPUs in one gang lease: a tensor-parallel degree; no node of this decade has more


class InvalidEvent(ValueError):
    """A message that does not satisfy its schema; `field` names what is wrong."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def _get(d: dict[str, Any], key: str, path: str = "") -> Any:
    try:
        return d[key]
    except KeyError:
        raise InvalidEvent(path + key, "missing required field") from None


def _str(d: dict[str, Any], key: str, max_len: int = MAX_ID_LEN, path: str = "") -> str:
    v = _get(d, key, path)
    if not isinstance(v, str):
        raise InvalidEvent(path + key, f"expected string, got {type(v).__name__}")
    if not v:
        raise InvalidEvent(path + key, "must not be empty")
    if len(v) > max_len:
        raise InvalidEvent(path + key, f"longer than {max_len} characters ({len(v)})")
    return v


def _num(d: dict[str, Any], key: str, lo: float, hi: float, path: str = "", lo_open: bool = False) -> float:
    v = _get(d, key, path)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidEvent(path + key, f"expected number, got {type(v).__name__}")
    if not math.isfinite(v):
        raise InvalidEvent(path + key, "must be finite")
    if v < lo or v > hi or (lo_open and v == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise InvalidEvent(path + key, f"{v} outside {bound}")
    return float(v)


def _int(d: dict[str, Any], key: str, lo: int, hi: int, path: str = "") -> int:
    v = _get(d, key, path)
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise InvalidEvent(path + key, f"expected integer, got {type(v).__name__}")
    if v < lo or v > hi:
        raise InvalidEvent(path + key, f"{v} outside [{lo}, {hi}]")
    return v


def _schema(d: Any, expected: str) -> None:
    """`d` is a JSON object of schema `expected`."""
    if not isinstance(d, dict):
        raise InvalidEvent("$", f"expected JSON object, got {type(d).__name__}")
    s = _get(d, "schema")
    if s != expected:
        raise InvalidEvent("schema", f"expected {expected!r}, got {s!r}")


def _plain(event: Any, schema: str) -> dict[str, Any]:
    """What dataclasses.asdict gives (schema first, then the fields in order), without its
    recursive deep copies, which cost more than the encoding on the scheduler's hot path."""
    d: dict[str, Any] = {"schema": schema}
    for name in event.__slots__:
        v = getattr(event, name)
        d[name] = {"ttft_p99": v.ttft_p99, "tpot_p99": v.tpot_p99} if type(v) is Latency else v
    return d


@immutable
class Latency:
    """p99 serving latencies of one window, in milliseconds."""

    ttft_p99: float
    tpot_p99: float

    METRICS: ClassVar[tuple[str, ...]] = ("ttft_p99", "tpot_p99")

    @classmethod
    def from_dict(cls, d: Any, path: str, positive: bool) -> Latency:
        if not isinstance(d, dict):
            raise InvalidEvent(path.rstrip("."), f"expected object, got {type(d).__name__}")
        return cls(
            ttft_p99=_num(d, "ttft_p99", 0.0, MAX_MS, path, lo_open=positive),
            tpot_p99=_num(d, "tpot_p99", 0.0, MAX_MS, path, lo_open=positive),
        )


@immutable
class Telemetry:
    """rose.telemetry.v1: one window of one serving GPU."""

    event_id: str
    ts: float
    node: str
    gpu: str
    pool: str
    gpu_util: float
    mem_total_bytes: int
    mem_used_bytes: int
    rollout_mem_bytes: int
    latency_ms: Latency
    slo_ms: Latency
    rps: float
    queue_depth: int
    # optional: the serving engine's KV-cache usage 0..1 (e.g. vllm:kv_cache_usage_perc); None when
    # the engine does not report it, and then absent on the wire (the event's bytes are v1's)
    kv_cache_usage: float | None = None
    # optional, v1.3 (§7): the serving replica this GPU belongs to ("" = the GPU itself, and then
    # absent on the wire) and what that replica is doing ("serving", and then absent on the wire)
    replica: str = ""
    serving_state: str = "serving"

    schema: ClassVar[str] = TELEMETRY_SCHEMA

    @property
    def key(self) -> str:
        return self.gpu

    @property
    def replica_id(self) -> str:
        """The replica this GPU serves in: a GPU that names none is a replica of its own."""
        return self.replica or self.gpu

    def to_dict(self) -> dict[str, Any]:
        d = _plain(self, TELEMETRY_SCHEMA)
        if self.kv_cache_usage is None:
            del d["kv_cache_usage"]
        if not self.replica:  # a v1.2 event's bytes stay what they were
            del d["replica"]
        if self.serving_state == "serving":
            del d["serving_state"]
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Telemetry:
        return _telemetry_fast(d) or cls.checked(d)

    @classmethod
    def checked(cls, d: Any) -> Telemetry:
        """Field by field, naming the first thing wrong."""
        _schema(d, TELEMETRY_SCHEMA)
        total = _int(d, "mem_total_bytes", 0, MAX_BYTES)
        used = _int(d, "mem_used_bytes", 0, MAX_BYTES)
        rollout = _int(d, "rollout_mem_bytes", 0, MAX_BYTES)
        if used > total:
            raise InvalidEvent("mem_used_bytes", f"{used} exceeds mem_total_bytes {total}")
        if rollout > used:
            raise InvalidEvent("rollout_mem_bytes", f"{rollout} exceeds mem_used_bytes {used}")
        return cls(
            event_id=_str(d, "event_id"),
            ts=_num(d, "ts", 0.0, MAX_TS),
            node=_str(d, "node"),
            gpu=_str(d, "gpu"),
            pool=_str(d, "pool"),
            gpu_util=_num(d, "gpu_util", 0.0, 1.0),
            mem_total_bytes=total,
            mem_used_bytes=used,
            rollout_mem_bytes=rollout,
            latency_ms=Latency.from_dict(_get(d, "latency_ms"), "latency_ms.", positive=False),
            slo_ms=Latency.from_dict(_get(d, "slo_ms"), "slo_ms.", positive=True),
            rps=_num(d, "rps", 0.0, MAX_RPS),
            queue_depth=_int(d, "queue_depth", 0, MAX_QUEUE),
            kv_cache_usage=_num(d, "kv_cache_usage", 0.0, 1.0) if "kv_cache_usage" in d else None,
            replica=_str(d, "replica") if "replica" in d else "",
            serving_state=_enum(d, "serving_state", SERVING_STATES) if "serving_state" in d else "serving",
        )


def _enum(d: dict[str, Any], key: str, allowed: tuple[str, ...]) -> str:
    v = _str(d, key)
    if v not in allowed:
        raise InvalidEvent(key, f"expected one of {allowed}, got {v!r}")
    return v


_NUMBER = (float, int)  # exact types: bool is neither


def _telemetry_fast(d: Any) -> Telemetry | None:
    """The scheduler's hot path: a well-formed telemetry object (exact JSON types, every
    value in range) checked in one pass, about twice as fast as the field-by-field path.
    None sends anything else (malformed, or valid in an unusual form such as 2.0 for an
    integer) to Telemetry.checked, which name what is wrong. It accepts a
    subset of what they accept and builds the same value (tests/test_schemas.py)."""
    if type(d) is not dict:
        return None
    try:
        if d["schema"] != TELEMETRY_SCHEMA:
            return None
        eid, node, gpu, pool = d["event_id"], d["node"], d["gpu"], d["pool"]
        ts, util, rps = d["ts"], d["gpu_util"], d["rps"]
        total, used, rollout, queue = (
            d["mem_total_bytes"],
            d["mem_used_bytes"],
            d["rollout_mem_bytes"],
            d["queue_depth"],
        )
        lat, slo = d["latency_ms"], d["slo_ms"]
        if type(lat) is not dict or type(slo) is not dict:
            return None
        lt, lp, st, sp = lat["ttft_p99"], lat["tpot_p99"], slo["ttft_p99"], slo["tpot_p99"]
    except KeyError:
        return None
    kv = None
    if "kv_cache_usage" in d:  # optional; present means a number in [0, 1] (null is not absent)
        kv = d["kv_cache_usage"]
        if type(kv) not in _NUMBER or not 0.0 <= kv <= 1.0:
            return None
        kv = float(kv)
    replica, serving_state = d.get("replica", ""), d.get("serving_state", "serving")
    if "replica" in d and (type(replica) is not str or not 0 < len(replica) <= MAX_ID_LEN):
        return None
    if serving_state not in SERVING_STATES:  # also any non-string: the full checks name it
        return None
    for v in (eid, node, gpu, pool):
        if type(v) is not str or not 0 < len(v) <= MAX_ID_LEN:
            return None
    # NaN fails every comparison and ±inf every bound: both fall through to the full checks
    if not (
        type(ts) in _NUMBER
        and 0.0 <= ts <= MAX_TS
        and type(util) in _NUMBER
        and 0.0 <= util <= 1.0
        and type(rps) in _NUMBER
        and 0.0 <= rps <= MAX_RPS
        and type(total) is int
        and type(used) is int
        and type(rollout) is int
        and type(queue) is int
        and 0 <= rollout <= used <= total <= MAX_BYTES
        and 0 <= queue <= MAX_QUEUE
        and type(lt) in _NUMBER
        and type(lp) in _NUMBER
        and type(st) in _NUMBER
        and type(sp) in _NUMBER
        and 0.0 <= lt <= MAX_MS
        and 0.0 <= lp <= MAX_MS
        and 0.0 < st <= MAX_MS
        and 0.0 < sp <= MAX_MS
    ):
        return None
    return Telemetry(
        eid,
        float(ts),
        node,
        gpu,
        pool,
        float(util),
        total,
        used,
        rollout,
        Latency(float(lt), float(lp)),
        Latency(float(st), float(sp)),
        float(rps),
        queue,
        kv,
        replica,
        serving_state,
    )


@immutable
class Command:
    """rose.command.v1: what the scheduler tells one GPU's executor."""

    command_id: str
    ts: float
    kind: str
    gpu: str
    lease_id: str
    epoch: int
    mem_bytes: int
    compute_share: float
    expires_at: float
    reason: str
    cause_event_id: str
    # v1.1 gang lease (docs/contract.md §2): `group_size` grants on GPUs of one node, one
    # tensor-parallel worker; "" and 0 on a lease of one GPU, and then absent on the wire
    group_id: str = ""
    group_size: int = 0
    # v1.3 (§7): "replica" lends a whole serving replica; "coresident" (the default, and then
    # absent on the wire) is every lease before it
    lease_kind: str = "coresident"

    schema: ClassVar[str] = COMMAND_SCHEMA

    @property
    def key(self) -> str:
        return self.gpu

    def to_dict(self) -> dict[str, Any]:
        d = _plain(self, COMMAND_SCHEMA)
        if not self.group_id:  # a v1 command's bytes stay what they were
            del d["group_id"], d["group_size"]
        if self.lease_kind == "coresident":  # so do a v1.2 command's
            del d["lease_kind"]
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Command:
        _schema(d, COMMAND_SCHEMA)
        kind = _enum(d, "kind", COMMAND_KINDS)
        return cls(
            command_id=_str(d, "command_id"),
            ts=_num(d, "ts", 0.0, MAX_TS),
            kind=kind,
            gpu=_str(d, "gpu"),
            lease_id=_str(d, "lease_id"),
            epoch=_int(d, "epoch", 0, 1 << 62),
            mem_bytes=_int(d, "mem_bytes", 0, MAX_BYTES),
            compute_share=_num(d, "compute_share", 0.0, 1.0),
            expires_at=_num(d, "expires_at", 0.0, MAX_TS),
            reason=_str(d, "reason", MAX_REASON_LEN),
            cause_event_id=_str(d, "cause_event_id"),
            **_group(d),
            lease_kind=_enum(d, "lease_kind", LEASE_KINDS) if "lease_kind" in d else "coresident",
        )


def _group(d: dict[str, Any]) -> dict[str, Any]:
    """The optional gang fields of a command: both or neither."""
    has_id, has_size = "group_id" in d, "group_size" in d
    if not has_id and not has_size:
        return {}
    if has_id != has_size:
        raise InvalidEvent("group_size" if has_id else "group_id", "missing: group_id and group_size go together")
    return {"group_id": _str(d, "group_id"), "group_size": _int(d, "group_size", 1, MAX_GROUP_SIZE)}


@immutable
class LeaseState:
    """rose.lease_state.v1: the executor's word on one GPU's lease (compacted by gpu)."""

    gpu: str
    lease_id: str
    epoch: int
    state: str
    ts: float
    rollout_mem_bytes: int
    command_id: str
    reason: str = ""  # v1.3, optional: why a grant was rejected or a lease ended; absent when ""

    schema: ClassVar[str] = LEASE_STATE_SCHEMA

    @property
    def key(self) -> str:
        return self.gpu

    def to_dict(self) -> dict[str, Any]:
        d = _plain(self, LEASE_STATE_SCHEMA)
        if not self.reason:  # a v1.2 lease state's bytes stay what they were
            del d["reason"]
        return d

    @classmethod
    def from_dict(cls, d: Any) -> LeaseState:
        _schema(d, LEASE_STATE_SCHEMA)
        state = _enum(d, "state", LEASE_STATES)
        return cls(
            gpu=_str(d, "gpu"),
            lease_id=_str(d, "lease_id"),
            epoch=_int(d, "epoch", 0, 1 << 62),
            state=state,
            ts=_num(d, "ts", 0.0, MAX_TS),
            rollout_mem_bytes=_int(d, "rollout_mem_bytes", 0, MAX_BYTES),
            command_id=_str(d, "command_id"),
            reason=_str(d, "reason", MAX_REASON_LEN) if "reason" in d else "",
        )


Event = Telemetry | Command | LeaseState
EVENT_TYPES: dict[str, type[Event]] = {t.schema: t for t in (Telemetry, Command, LeaseState)}
