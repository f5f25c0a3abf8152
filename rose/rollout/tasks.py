"""The agentic task queue on Redis Streams: the trainer submits episodes, rollout workers
take them through one consumer group, and finished trajectories go to a results stream.

Keys (`RedisConfig.key`): docs/contract.md §6.1. No trajectory is lost or duplicated: `complete`
(append, record the task_id, ack) and `requeue` (continuation and ack, only while the caller
still owns the entry) are each one Lua script, and `reclaim` takes entries idle for
`min_idle_ms` from crashed consumers with XAUTOCLAIM while `touch` keeps a live worker's entries
from going idle. An episode completed a second time (its first holder stalled, was taken over
and finished anyway) appends nothing and is counted in the stats hash as `duplicates:{step}`,
next to `submitted:{step}` and `completed:{step}`. Each guarantee, and Redis Cluster hash
slots: docs/rollout.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import cast

import orjson
import redis

from rose.config import RedisConfig
from rose.contract.records import Trajectory, as_text
from rose.rollout.episode import InvalidTask, Task

GROUP = "rollout"

# A stream's entries as this client reads them (RESP2, bytes): redis-py's types also cover RESP3
# replies and decode_responses=True.
_Entries = list[tuple[bytes, dict[bytes, bytes]]]

_COMPLETE = """
local added = 0
if redis.call('HEXISTS', KEYS[3], ARGV[3]) == 0 then
  local id = redis.call('XADD', KEYS[2], '*', 'task_id', ARGV[3], 'trajectory', ARGV[4])
  redis.call('HSET', KEYS[3], ARGV[3], id)
  redis.call('HINCRBY', KEYS[4], 'completed:' .. ARGV[5], 1)
  added = 1
else
  redis.call('HINCRBY', KEYS[4], 'duplicates:' .. ARGV[5], 1)
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return added
"""

_REQUEUE = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1, ARGV[3])
if #p == 0 then return false end
redis.pcall('XGROUP', 'CREATE', KEYS[2], ARGV[1], '0', 'MKSTREAM')
if ARGV[6] ~= '' then redis.call('SADD', KEYS[3], ARGV[6]) end
local id = redis.call('XADD', KEYS[2], '*', 'task_id', ARGV[4], 'task', ARGV[5])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return id
"""

_RETIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 and redis.call('XLEN', KEYS[1]) > 0 then return 0 end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
return 1
"""

_TOUCH = """
local lost = {}
for i = 2, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 0 or p[1][2] ~= KEYS[2] then
    table.insert(lost, ARGV[i])
  else
    redis.call('XCLAIM', KEYS[1], ARGV[1], KEYS[2], 0, ARGV[i], 'JUSTID')
  end
end
return lost
"""

_DEAD = """
redis.call('XADD', KEYS[2], '*', 'stream', KEYS[1], 'entry_id', ARGV[2], 'reason', ARGV[3], 'raw', ARGV[4])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
"""


@dataclass(frozen=True)
class Claimed:
    """A task this consumer holds: where it came from, so it can be completed or requeued."""

    stream: str
    entry_id: str
    task: Task


class TaskQueue:
    def __init__(self, r: redis.Redis, rcfg: RedisConfig, job: str, group: str = GROUP):
        self.r, self.rcfg, self.job, self.group = r, rcfg, job, group
        self.stream = rcfg.key("tasks", job)
        self.results_stream = rcfg.key("results", job)
        self.done_key = rcfg.key("results", job, "done")
        self.stats_key = rcfg.key("tasks", job, "stats")
        self.dead_stream = rcfg.key("tasks", job, "dead")
        self.workers_key = rcfg.key("tasks", job, "workers")
        self._complete = r.register_script(_COMPLETE)
        self._requeue = r.register_script(_REQUEUE)
        self._touch = r.register_script(_TOUCH)
        self._dead = r.register_script(_DEAD)
        self._retire = r.register_script(_RETIRE)
        self._groups: set[str] = set()

    def directed(self, worker_id: str) -> str:
        return self.rcfg.key("tasks", self.job, "to", worker_id)

    def token_stream(self, task_id: str) -> str:
        """Where a streaming task's tokens are published as they are made (`rose.rollout.token_stream`)."""
        return self.rcfg.key("tasks", self.job, "tokens", task_id)

    # set up ----------------------------------------------------------------------------
    def ensure_group(self, stream: str | None = None) -> None:
        stream = stream or self.stream
        if stream in self._groups:
            return
        try:
            self.r.xgroup_create(stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._groups.add(stream)

    def register_worker(self, worker_id: str) -> str:
        """Create this worker's directed stream and list it, so others can reclaim from it."""
        d = self.directed(worker_id)
        self.ensure_group(d)
        self.r.sadd(self.workers_key, worker_id)
        return d

    def retire_worker(self, worker_id: str) -> bool:
        """Drop a stopped worker's directed stream from the set, if nothing is left in it
        (a later requeue to it lists it again), so reclaim scans stay short."""
        return bool(self._retire(keys=[self.directed(worker_id), self.workers_key], args=[worker_id]))

    # trainer side ----------------------------------------------------------------------
    def submit(self, task: Task, to: str | None = None) -> str:
        """Queue a task on the shared stream, or on worker `to`'s directed stream (listed in the
        workers set, so any worker may still take it once it has waited the affinity grace);
        returns its entry id."""
        dst = self.directed(to) if to else self.stream
        self.ensure_group(dst)
        p = self.r.pipeline(transaction=True)
        if to:
            p.sadd(self.workers_key, to)
        p.xadd(dst, {"task_id": task.task_id, "task": orjson.dumps(task.to_dict())})
        p.hincrby(self.stats_key, f"submitted:{task.step}", 1)
        return as_text(p.execute()[-2])

    def cancel(self, stream: str, entry_id: str) -> bool:
        """Withdraw a submitted task: its entry is acked and deleted, so no worker reads it any
        more, and a worker already holding it finds it gone at its next `touch` and drops the
        episode (a `requeue` of it pushes nothing; a `complete` before that touch still appends
        its result). False: the entry was already gone."""
        p = self.r.pipeline(transaction=True)
        p.xack(stream, self.group, entry_id)
        p.xdel(stream, entry_id)
        return bool(p.execute()[1])

    def progress(self, step: int) -> tuple[int, int]:
        """(submitted, completed) episodes of an RL step."""
        a, b = self.r.hmget(self.stats_key, f"submitted:{step}", f"completed:{step}")
        return int(a or 0), int(b or 0)

    def results(self, last_id: str = "0-0", count: int = 1000, block_ms: int | None = None) -> list[tuple[str, dict]]:
        got = cast(
            "list[tuple[bytes, _Entries]] | None",
            self.r.xread({self.results_stream: last_id}, count=count, block=block_ms),
        )
        out = []
        for _stream, entries in got or []:
            for eid, fields in entries:
                out.append((as_text(eid), Trajectory.from_fields(fields).body))
        return out

    def all_results(self) -> list[dict]:
        return [Trajectory.from_fields(f).body for _i, f in cast(_Entries, self.r.xrange(self.results_stream))]

    # worker side -----------------------------------------------------------------------
    def read(
        self, consumer: str, count: int, block_ms: int | None = None, directed: str | None = None
    ) -> list[Claimed]:
        """At most `count` new tasks for `consumer`: its directed stream first, then the shared one.
        (XREADGROUP's COUNT is per stream, so the two are read one after the other.)"""
        self.ensure_group()
        out: list[Claimed] = []
        if directed:
            out = self._decode(self.r.xreadgroup(self.group, consumer, {directed: ">"}, count=count))
        if len(out) < count:
            out += self._decode(
                self.r.xreadgroup(
                    self.group,
                    consumer,
                    {self.stream: ">"},
                    count=count - len(out),
                    block=block_ms if not out else None,
                )
            )
        return out

    def reclaim(self, consumer: str, min_idle_ms: int, count: int = 16) -> list[Claimed]:
        """XAUTOCLAIM entries idle ≥ min_idle_ms, on the shared and every directed stream."""
        out: list[Claimed] = []
        for stream in [self.stream] + [self.directed(as_text(w)) for w in self.r.smembers(self.workers_key)]:
            if len(out) >= count:
                break
            try:
                res = self.r.xautoclaim(stream, self.group, consumer, min_idle_ms, "0-0", count=count - len(out))
            except redis.ResponseError:  # stream or group gone
                continue
            out += self._decode([(stream, res[1])])
        return out

    def steal(self, consumer: str, stream: str, grace_ms: int, count: int = 1) -> list[Claimed]:
        """Take undelivered entries of another worker's directed stream once the oldest has
        waited ≥ grace_ms (its target is busy or gone: affinity is a preference, not a wait)."""
        try:
            groups = self.r.xinfo_groups(stream)
        except redis.ResponseError:
            return []
        last = next((as_text(g["last-delivered-id"]) for g in groups if as_text(g["name"]) == self.group), None)
        if last is None:
            return []
        head = self.r.xrange(stream, min=f"({last}", count=1)
        if not head or time.time() * 1000 - int(as_text(head[0][0]).split("-")[0]) < grace_ms:
            return []
        return self._decode(self.r.xreadgroup(self.group, consumer, {stream: ">"}, count=count))

    def touch(self, consumer: str, held: list[Claimed]) -> list[Claimed]:
        """Reset the idle time of entries still ours; return those another consumer took."""
        lost: list[Claimed] = []
        by_stream: dict[str, list[Claimed]] = {}
        for c in held:
            by_stream.setdefault(c.stream, []).append(c)
        for stream, cs in by_stream.items():
            gone = {
                as_text(x) for x in self._touch(keys=[stream, consumer], args=[self.group] + [c.entry_id for c in cs])
            }
            lost += [c for c in cs if c.entry_id in gone]
        return lost

    def complete(self, c: Claimed, trajectory: dict) -> bool:
        """Append the trajectory (once per task_id) and ack the task, atomically.
        Returns False when the task_id already had a result (the append was skipped, the
        step's `duplicates` counter counts it)."""
        entry = Trajectory(c.task.task_id, trajectory).to_fields().values()  # task_id, trajectory: ARGV[3..4]
        return bool(
            self._complete(
                keys=[c.stream, self.results_stream, self.done_key, self.stats_key],
                args=[self.group, c.entry_id, *entry, c.task.step],
            )
        )

    def requeue(self, c: Claimed, consumer: str, continuation: Task, to: str | None = None) -> str | None:
        """Push the continuation (to worker `to`'s directed stream, else the shared one) and
        ack the original, atomically; None (nothing done) when `consumer` no longer owns it."""
        dst = self.directed(to) if to else self.stream
        res = self._requeue(
            keys=[c.stream, dst, self.workers_key],
            args=[
                self.group,
                c.entry_id,
                consumer,
                continuation.task_id,
                orjson.dumps(continuation.to_dict()),
                to or "",
            ],
        )
        return as_text(res) if res else None

    def dead_letter(self, stream: str, entry_id: str, raw: bytes, reason: str) -> None:
        self._dead(keys=[stream, self.dead_stream], args=[self.group, entry_id, reason, raw])

    def _decode(self, got) -> list[Claimed]:
        out = []
        for stream, entries in got or []:
            stream = as_text(stream)
            for eid, fields in entries:
                eid = as_text(eid)
                if not fields:  # deleted while pending
                    continue
                raw = fields.get(b"task", b"")
                try:
                    task = Task.from_dict(orjson.loads(raw))
                except orjson.JSONDecodeError:
                    self.dead_letter(stream, eid, raw, "task: not valid JSON")
                    continue
                except InvalidTask as e:
                    self.dead_letter(stream, eid, raw, str(e))
                    continue
                out.append(Claimed(stream, eid, task))
        return out
