"""Turns in, results out: each gateway request is one single-turn Task on the job's task queue,
and one background reader hands each result to the request waiting for it, by task id.

A turn goes through the same queue as any episode, so placement, continuation after a revoke
(the next worker prefills the tokens already made and samples on) and exactly-once completion
apply to it unchanged: the result is the whole turn, with the policy version of every token.
The reader also follows the queue's dead stream, so a turn no worker can run (a prompt token
outside the vocabulary, a turn longer than `max_model_len`) fails its request with the reason
instead of waiting out its deadline.

Session affinity: placement has no per-task key, so the dispatcher remembers the worker of a
session's last turn and sends the next turn to that worker's directed stream while its heartbeat
is fresh and it is running (any worker may still take it after the affinity grace). The same
heartbeats tell how long no worker of the job has been running (`no_worker_running_s`) and
which policy version each has applied (`GET /v1/weights`, `min_weight_version`).

Each submit is a `send {stream}` span (kind PRODUCER) whose W3C context the task carries
(`Task.traceparent`), so the worker's `process {stream}` span joins the request's trace.

A streamed turn's task is flagged `stream`: its worker publishes the tokens as it makes them to
the task's token stream (`rose.rollout.token_stream`), which `chunks` reads. When the turn is
answered, the reader appends an end marker (`end`) to that stream before it resolves the turn's
future, so the request's pending read of the stream returns at once and need not be cancelled
(redis-py's asyncio client drops the connection of a cancelled read).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, cast

import orjson
import redis
import redis.asyncio as aredis

from rose.config import Config
from rose.contract.records import Heartbeat, Trajectory, WorkerRegistry, as_text
from rose.gateway.api import TurnResult
from rose.obs.logs import get_logger
from rose.obs.tracing import queue_send_span, traceparent, tracer
from rose.rollout.episode import Task
from rose.rollout.tasks import TaskQueue
from rose.rollout.token_stream import MAX_CHUNKS
from rose.weights.stream import weight_keys

READ_BLOCK_MS = 200  # the reader's XREAD wait; heartbeats are refreshed between reads
HEARTBEATS_S = 0.25
MAX_SESSIONS = 100_000  # sessions remembered, least recently used dropped first
TASK_PREFIX = "gw-"
GATEWAY_STEP = 0  # the RL step gateway turns are counted under in the queue's stats
END_FIELD = b"end"  # the field of a token stream's end marker; a worker's chunks never carry it
END_TTL_S = 30  # a token stream expires this soon after its end marker (the answer deletes it before)


class TurnFailed(Exception):
    """A turn no worker can run (its task went to the dead stream); `field` names the cause."""

    def __init__(self, field: str, reason: str):
        super().__init__(reason)
        self.field = field


@dataclass
class PendingTurn:
    """A submitted turn: where its entry is (to withdraw it) and the future its result resolves."""

    task_id: str
    stream: str
    entry_id: str
    future: asyncio.Future
    session: str | None
    submitted: float = field(default_factory=time.monotonic)
    tokens_key: str = ""  # the task's token stream, for a streamed turn


@dataclass(frozen=True)
class Chunk:
    """Tokens `index`.. of a streamed turn, as a worker published them."""

    index: int
    tokens: list[int]
    versions: list[int]
    worker: str
    logprobs: list[float] = field(default_factory=list)  # per token; empty when not published


@dataclass(frozen=True)
class WorkerWeights:
    worker: str
    state: str
    version: int
    heartbeat_age_s: float


@dataclass
class _Waiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    session: str | None
    tokens_key: str = ""  # where the end marker goes, for a streamed turn


def _resolve(fut: asyncio.Future, value: Any) -> None:
    if fut.done():
        return
    if isinstance(value, BaseException):
        fut.set_exception(value)
    else:
        fut.set_result(value)


class Dispatcher:
    def __init__(self, cfg: Config, job: str | None = None):
        self.cfg = cfg
        self.job = job or cfg.executor.job
        self.r = redis.Redis.from_url(cfg.redis.url)
        self.queue = TaskQueue(self.r, cfg.redis, self.job)
        self._lock = threading.Lock()
        self._waiters: dict[str, _Waiter] = {}
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self.registry = WorkerRegistry(self.r, cfg.redis.key, self.queue.workers_key)
        self._workers: dict[str, Heartbeat] = {}  # the job's workers' heartbeats at the last refresh
        self.ar = aredis.Redis.from_url(cfg.redis.url)  # the token streams' reads, on the event loop
        self.weights_meta = weight_keys(cfg.redis, cfg.executor.model).meta
        self._last_running = time.monotonic()  # start-up counts as running: patience starts here
        self.redis_ok = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._log = get_logger("rose.gateway", job=self.job)
        self._tracer = tracer("rose.gateway")

    # -- life ------------------------------------------------------------------------------
    def start(self) -> None:
        self.queue.ensure_group()
        cursors = {s: self._tail(s) for s in (self.queue.results_stream, self.queue.dead_stream)}
        self._refresh_workers()
        self._thread = threading.Thread(target=self._read, args=(cursors,), daemon=True, name="rose-gateway-reader")
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * READ_BLOCK_MS / 1000 + 1)
        self.r.close()

    def _tail(self, stream: str) -> str:
        last = cast("list[tuple[bytes, Any]]", self.r.xrevrange(stream, count=1))
        return as_text(last[0][0]) if last else "0-0"

    # -- turns -----------------------------------------------------------------------------
    async def submit(
        self,
        prompt: list[int],
        max_tokens: int,
        seed: int,
        session: str | None,
        stream: bool = False,
        min_version: int = 0,
        exact: bool = False,
    ) -> PendingTurn:
        """Queue one turn (to the session's worker while it is live and has applied `min_version`,
        else, with a `min_version`, to a running worker that has; `exact`: to one at that very
        version, while one is); its result resolves the future."""
        task = Task(
            task_id=f"{TASK_PREFIX}{uuid.uuid4().hex}",
            prompt=prompt,
            max_turns=1,
            tokens_per_turn=max_tokens,
            obs_tokens=0,
            seed=seed,
            step=GATEWAY_STEP,
            in_step=False,  # no RL step waits on it: the straggler rule does not send it to dedicated
            stream=stream,
            min_version=min_version,
        )
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        key = self.queue.token_stream(task.task_id) if task.stream else ""
        with self._lock:
            self._waiters[task.task_id] = _Waiter(loop, fut, session, key)
        to = self.session_worker(session)
        if min_version > 0 or exact:
            at = self.workers_at(min_version, exact)
            if to not in at:
                to = random.choice(at) if at else None
        dst = self.queue.directed(to) if to else self.queue.stream
        with queue_send_span(self._tracer, dst, {"rose.task_id": task.task_id}) as span:
            task.traceparent = traceparent()  # the task carries this span's context
            try:
                entry = await asyncio.to_thread(self.queue.submit, task, to)
            except BaseException:
                self.forget(task.task_id)
                raise
            span.set_attribute("messaging.message.id", entry)
        return PendingTurn(task.task_id, dst, entry, fut, session, tokens_key=key)

    async def chunks(self, key: str, cursor: str, block_ms: int) -> tuple[list[Chunk], str, bool]:
        """The chunks of token stream `key` after `cursor` (XREAD, waiting up to `block_ms`), and
        whether its end marker came (the turn is answered: nothing more is worth reading)."""
        got = await self.ar.xread({key: cursor}, count=256, block=block_ms)
        out, ended = [], False
        for _stream, entries in cast("list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]", got or []):
            for eid, f in entries:
                cursor = as_text(eid)
                if END_FIELD in f:
                    ended = True
                    continue
                if int(f.get(b"turn", 0)) != 0:
                    continue
                toks, vs = orjson.loads(f[b"tokens"]), orjson.loads(f[b"versions"])
                lps = orjson.loads(f.get(b"logprobs", b"[]"))
                out.append(Chunk(int(f[b"index"]), list(toks), list(vs), as_text(f.get(b"worker", b"")), list(lps)))
        return out, cursor, ended

    async def drop_chunks(self, key: str) -> None:
        """The turn is answered: its token stream goes (it would expire anyway)."""
        try:
            await self.ar.delete(key)
        except redis.RedisError as e:
            self._log.warning("gateway.token_stream_not_deleted", key=key, error=str(e))

    def forget(self, task_id: str) -> None:
        with self._lock:
            self._waiters.pop(task_id, None)

    def withdraw(self, turn: PendingTurn) -> None:
        """The request is gone (disconnected, past its deadline): withdraw its task, on a thread
        of the loop's executor, so that a request being cancelled need not await it."""
        self.forget(turn.task_id)
        asyncio.get_running_loop().run_in_executor(None, self._cancel, turn)

    def _cancel(self, turn: PendingTurn) -> None:
        try:
            self.queue.cancel(turn.stream, turn.entry_id)
        except redis.RedisError as e:
            self._log.warning("gateway.withdraw_failed", task_id=turn.task_id, error=str(e))

    # -- sessions and workers --------------------------------------------------------------
    def session_worker(self, session: str | None) -> str | None:
        """The worker of the session's last turn, while it runs with a fresh heartbeat."""
        if not session:
            return None
        with self._lock:
            w = self._sessions.get(session)
            hb = self._workers.get(w) if w else None
        return w if hb is not None and hb.running() else None

    def _remember(self, session: str, worker: str) -> None:
        with self._lock:
            self._sessions[session] = worker
            self._sessions.move_to_end(session)
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)

    def workers_running(self) -> list[str]:
        """Running workers (fresh heartbeat) at any policy version."""
        return self.workers_at(None)

    def workers_at(self, min_version: int | None, exact: bool = False) -> list[str]:
        """Running workers (fresh heartbeat) that have applied policy version `min_version` or
        newer (`exact`: that very version; None: at any version)."""
        now = time.time()
        with self._lock:
            return sorted(
                w
                for w, hb in self._workers.items()
                if hb.running(now)
                and (min_version is None or (hb.version == min_version if exact else hb.version >= min_version))
            )

    def weights(self) -> tuple[list[WorkerWeights], int | None]:
        """Each worker's applied version, as its last heartbeat says (workers whose heartbeat
        is fresh), and the newest version published on the model's weight stream (None: none).
        The heartbeats are read here, not taken from the reader's table, which lags by up to a
        refresh and can be overwritten by an older read still in flight: a caller that has just
        seen a worker apply a version gets an answer that agrees."""
        now = time.time()
        ws = [
            WorkerWeights(w, hb.state, hb.version, round(hb.age_s(now), 3))
            for w, hb in self.registry.heartbeats().items()
            if hb.fresh(now)
        ]
        latest = self.r.hget(self.weights_meta, "version")
        return ws, None if latest is None else int(cast(bytes, latest))

    def no_worker_running_s(self) -> float:
        """Seconds since a worker of the job last ran (0 while one does)."""
        return 0.0 if self.workers_running() else time.monotonic() - self._last_running

    def _refresh_workers(self) -> None:
        seen = self.registry.heartbeats()  # an unreadable heartbeat is left out, as none
        with self._lock:
            self._workers = seen
        if self.workers_running():
            self._last_running = time.monotonic()

    # -- the reader ------------------------------------------------------------------------
    def _read(self, cursors: dict[str, str]) -> None:
        next_hb = 0.0
        backoff = 0.0
        while not self._stop.is_set():
            try:
                if time.monotonic() >= next_hb:
                    self._refresh_workers()
                    next_hb = time.monotonic() + HEARTBEATS_S
                got = self.r.xread(cast(Any, cursors), count=256, block=READ_BLOCK_MS)
                self.redis_ok, backoff = True, 0.0
            except redis.RedisError as e:
                self.redis_ok = False
                backoff = min(2.0, backoff * 2 or 0.1)
                self._log.warning("gateway.redis_unavailable", error=str(e), retry_s=backoff)
                self._stop.wait(backoff)
                continue
            answered = []
            for stream, entries in cast("list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]", got or []):
                name = as_text(stream)
                for eid, fields in entries:
                    cursors[name] = as_text(eid)
                    one = self._on_dead(fields) if name == self.queue.dead_stream else self._on_result(fields)
                    if one is not None:
                        answered.append(one)
            self._answer(answered)

    def _take(self, task_id: str) -> _Waiter | None:
        with self._lock:
            return self._waiters.pop(task_id, None)

    def _answer(self, answered: list[tuple[_Waiter, Any]]) -> None:
        """Resolve each answered turn's future, after the end marker of every streamed one (one
        round trip for the batch): the request's pending read of the token stream then returns
        within milliseconds instead of being cancelled."""
        self._mark_ends([w.tokens_key for w, _v in answered if w.tokens_key])
        for w, value in answered:
            w.loop.call_soon_threadsafe(_resolve, w.future, value)

    def _mark_ends(self, keys: list[str]) -> None:
        """Append the end marker to each token stream, capped and with a short expiry in the same
        transaction, so a stream already deleted or expired is not made again to live forever.
        On failure the request cancels its read after `END_WAIT_S` instead (rose.gateway.app)."""
        if not keys:
            return
        pipe = self.r.pipeline(transaction=True)
        for k in keys:
            pipe.xadd(k, {END_FIELD: 1}, maxlen=MAX_CHUNKS, approximate=True)
            pipe.expire(k, END_TTL_S)
        try:
            pipe.execute()
        except redis.RedisError as e:
            self._log.warning("gateway.token_stream_end_not_marked", streams=len(keys), error=str(e))

    def _on_result(self, fields: dict[bytes, bytes]) -> tuple[_Waiter, Any] | None:
        task_id = as_text(fields.get(b"task_id", b""))
        if not task_id.startswith(TASK_PREFIX):
            return None
        w = self._take(task_id)
        if w is None:
            return None  # withdrawn, or another gateway's turn
        try:
            value: Any = TurnResult.from_trajectory(Trajectory.from_fields(fields).body)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            value = TurnFailed("trajectory", f"the worker's result is unreadable: {e}")
        if isinstance(value, TurnResult) and w.session:
            self._remember(w.session, value.worker)
        return w, value

    def _on_dead(self, fields: dict[bytes, bytes]) -> tuple[_Waiter, Any] | None:
        try:
            task_id = str(orjson.loads(fields.get(b"raw", b"")).get("task_id", ""))
        except (orjson.JSONDecodeError, AttributeError):
            return None
        w = self._take(task_id) if task_id.startswith(TASK_PREFIX) else None
        if w is None:
            return None
        reason = as_text(fields.get(b"reason", b"refused by the worker"))
        cause = reason.partition(":")[0]
        return w, TurnFailed("prompt" if cause == "prompt" else "max_tokens", reason)
