"""The records passed through Redis, each defined once: a rollout worker's heartbeat (a hash,
`workers:<worker_id>`) and a trajectory (an entry of the job's results stream). Every writer
and reader goes through `to_fields`/`from_fields` here, so a field is named, typed and
defaulted in one place; `WorkerRegistry` is the heartbeat's one Redis adapter.

Field dicts are as redis-py returns them: bytes keys and values from the project's clients
(none sets decode_responses), str from a client that does; both are read. A record that cannot
be read raises `ValueError` naming the field; readers treat such a heartbeat as absent and such
a trajectory as an unreadable result, never as a crash further in.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import orjson

# A heartbeat is rewritten every 0.2 s (`Worker.HEARTBEAT_S`); one older than this belongs to a
# worker that is gone or hung. 15 missed beats: a niced worker on a loaded host misses a few
# without being gone. The one bound the gateway, the client and rollout placement judge by.
HEARTBEAT_FRESH_S = 3.0
HEARTBEAT_TTL_S = 60  # the hash expires this long after a worker's last beat
# States of a worker that holds its engine at its version: it runs turns, or it is paused by the
# guard or a lease (and resumes at that version). `draining` and `stopped` are on their way out.
LIVE_STATES = frozenset({"running", "paused"})
# The version of a worker that has applied none (the engine's seeded policy); also what a
# heartbeat without a version reads as, so a reader never credits a worker with a version it
# did not report (0 is a follower's checkpoint, a real version that `min_version=0` accepts).
NO_VERSION = -1


def live(state: str, age_s: float) -> bool:
    """The liveness rule: a fresh heartbeat, and an engine held at its version (running or
    paused). Gating on a version (`RoseClient.wait_applied`) counts a paused worker: it resumes
    at that version. Dispatch wants `Heartbeat.running`, the live workers taking work now."""
    return state in LIVE_STATES and age_s < HEARTBEAT_FRESH_S


Fields = Mapping[Any, Any]  # bytes -> bytes from redis-py's default clients, str -> str otherwise


def as_text(v: Any) -> str:
    """A value read from Redis as str (redis-py's default clients give bytes)."""
    return v.decode() if isinstance(v, bytes) else str(v)


def _get(f: Fields, name: str) -> Any:
    """The field `name`, under a str or a bytes key; None when absent."""
    v = f.get(name)
    return f.get(name.encode()) if v is None else v


def _number(f: Fields, name: str, kind: Callable[[float], Any], default: Any) -> Any:
    v = _get(f, name)
    if v is None or v == b"" or v == "":
        return default
    try:
        x = float(as_text(v))
    except ValueError:
        raise ValueError(f"{name}: {as_text(v)!r} is not a number") from None
    if kind is int and not math.isfinite(x):
        raise ValueError(f"{name}: {as_text(v)!r} is not a whole number")
    return kind(x)


@dataclass(frozen=True)
class Heartbeat:
    """A rollout worker's state, as it publishes it every `Worker.HEARTBEAT_S`. Counters are the
    worker's totals since it started; `step_ms_*` cover its last decode steps (absent before
    its first)."""

    worker_id: str
    state: str  # running | paused | draining | stopped
    ts: float  # wall-clock time of the beat
    version: int = NO_VERSION  # the weight version its engine runs
    gpu: str = ""
    job: str = ""
    dedicated: bool = False
    pid: int = 0
    active: int = 0
    free_slots: int = 0
    slots: int = 0
    episodes_done: int = 0
    turns: int = 0
    tokens: int = 0
    moved: int = 0
    requeued: int = 0
    tokens_carried: int = 0
    tokens_interrupted: int = 0
    duplicates: int = 0  # episodes it completed after another worker had
    lost: int = 0  # episodes another worker took over while it held them
    engine: str = ""
    engine_library: str = ""
    device: str = ""
    versions_applied: int = 0
    versions_verified: int = 0
    versions_mismatched: int = 0
    step_ms_p50: float | None = None
    step_ms_p99: float | None = None
    step_ms_n: int = 0

    # -- the one freshness and liveness rule ------------------------------------------------
    def age_s(self, now: float | None = None) -> float:
        return max(0.0, (time.time() if now is None else now) - self.ts)

    def fresh(self, now: float | None = None) -> bool:
        return self.age_s(now) < HEARTBEAT_FRESH_S

    def live(self, now: float | None = None) -> bool:
        """Fresh, and holding its engine at `version` (running or paused): `live`."""
        return live(self.state, self.age_s(now))

    def running(self, now: float | None = None) -> bool:
        """Live and taking work now (what turns are dispatched to)."""
        return self.state == "running" and self.fresh(now)

    # -- fields ------------------------------------------------------------------------------
    def to_fields(self) -> dict[str, str | int | float]:
        """The hash's fields (redis-py encodes the numbers); unset step times are left out."""
        out: dict[str, str | int | float] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None:
                out[f.name] = int(v) if isinstance(v, bool) else v
        return out

    @classmethod
    def from_fields(cls, f: Fields) -> Heartbeat:
        """The heartbeat a hash holds. `state` and `ts` are required; any other field may be
        absent (older or partial writers) and reads as its default. ValueError names a field
        that is missing or not a number."""
        for name in ("state", "ts"):
            if _get(f, name) is None:
                raise ValueError(f"heartbeat: missing field {name!r}")
        kw: dict[str, Any] = {}
        for fd in fields(cls):
            default = fd.default
            if fd.type in ("str",):
                v = _get(f, fd.name)
                kw[fd.name] = "" if v is None else as_text(v)
            elif fd.type == "bool":
                kw[fd.name] = as_text(_get(f, fd.name) or "0") in ("1", "True", "true")
            elif fd.type == "int":
                kw[fd.name] = _number(f, fd.name, int, default)
            else:  # float, float | None
                kw[fd.name] = _number(f, fd.name, float, default)
        return cls(**kw)


@dataclass(frozen=True)
class Trajectory:
    """One entry of a job's results stream: the task's id and its trajectory, a JSON object
    (`rose.rollout.episode` builds it; `rose.client.Trajectory` and the gateway's `TurnResult`
    type its contents)."""

    task_id: str
    body: dict[str, Any]

    def to_fields(self) -> dict[str, str | bytes]:
        """The entry's fields, in the order of the stream entry (task_id, trajectory)."""
        return {"task_id": self.task_id, "trajectory": orjson.dumps(self.body)}

    @classmethod
    def from_fields(cls, f: Fields) -> Trajectory:
        """ValueError names what is wrong: a missing field, JSON that is not, or not an object."""
        raw = _get(f, "trajectory")
        if raw is None:
            raise ValueError("trajectory: missing field 'trajectory'")
        try:
            body = orjson.loads(raw)
        except (orjson.JSONDecodeError, TypeError) as e:
            raise ValueError(f"trajectory: not JSON ({e})") from None
        if not isinstance(body, dict):
            raise ValueError(f"trajectory: a JSON {type(body).__name__}, not an object")
        task_id = _get(f, "task_id")
        return cls(as_text(task_id) if task_id is not None else str(body.get("task_id", "")), body)


class WorkerRegistry:
    """The workers' heartbeats in Redis (redis-py client `r`, bytes or str replies): a worker
    `beat`s; anyone `read`s one, the heartbeats of a set of ids, or the ids `running`.
    `key` is `RedisConfig.key`; `members`, when given, is the Redis set of a job's workers
    (`TaskQueue.workers_key`)."""

    def __init__(self, r: Any, key: Callable[..., str], members: str | None = None):
        self.r, self._key, self.members = r, key, members

    def key(self, worker_id: str) -> str:
        return self._key("workers", worker_id)

    def beat(self, hb: Heartbeat) -> None:
        k = self.key(hb.worker_id)
        p = self.r.pipeline(transaction=False)
        p.hset(k, mapping=hb.to_fields())
        p.expire(k, HEARTBEAT_TTL_S)
        p.execute()

    def read(self, worker_id: str) -> Heartbeat | None:
        """The worker's heartbeat; None when it has none (expired) or it cannot be read."""
        return self.read_many([worker_id]).get(worker_id)

    def read_many(self, ids: Iterable[str]) -> dict[str, Heartbeat]:
        """worker id -> heartbeat, for those of `ids` with a readable one (one round trip)."""
        ids = list(ids)
        p = self.r.pipeline(transaction=False)
        for w in ids:
            p.hgetall(self.key(w))
        out = {}
        for w, f in zip(ids, p.execute(raise_on_error=False)):
            if not f or isinstance(f, Exception):  # none, or a key of another type
                continue
            try:
                out[w] = replace(Heartbeat.from_fields(f), worker_id=w)  # the key names the worker
            except ValueError:
                continue
        return out

    def registered(self) -> list[str]:
        """The ids in the job's set of workers, sorted."""
        if self.members is None:
            raise ValueError("WorkerRegistry: no job's set of workers to read (members=None)")
        return sorted(as_text(w) for w in self.r.smembers(self.members))

    def heartbeats(self) -> dict[str, Heartbeat]:
        """The job's registered workers' readable heartbeats."""
        return self.read_many(self.registered())

    def running(self, min_version: int | None = None, now: float | None = None) -> list[str]:
        """The job's workers that take work now (`Heartbeat.running`) with weight version
        `min_version` or newer (None: at any version), sorted."""
        return sorted(
            w
            for w, hb in self.heartbeats().items()
            if hb.running(now) and (min_version is None or hb.version >= min_version)
        )

    def scan(self) -> dict[str, Heartbeat]:
        """Every readable heartbeat under the key prefix, whatever its job."""
        prefix = self.key("")
        ids = [as_text(k)[len(prefix) :] for k in self.r.scan_iter(match=prefix + "*", count=200)]
        return self.read_many(ids)
