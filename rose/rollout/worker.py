"""The rollout worker: the loop of the process the executor starts inside a lease (or on a
dedicated rollout GPU) that runs agentic episodes from the task queue.

    python -m rose.rollout.worker_process --config-fd N      (rose.rollout.launcher.launch(WorkerConfig))

runs `rose.rollout.worker_process.main`, which reads the worker's `WorkerConfig`, builds its
engine, task queue and weight source and protects serving, then runs `Worker.run`. One loop,
one decode step per iteration (continuous batching). The pause flag is read before every
forward and between the model's layers, so PAUSE launches nothing more after at most one layer;
STOP or SIGTERM drains (unfinished episodes go back as continuation tasks). A worker takes tasks
only while its policy is fresh enough (`fresh_enough`).
The loop step by step and the protections in full: docs/rollout.md.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from typing import TYPE_CHECKING

from rose.contract.records import Heartbeat, WorkerRegistry
from rose.rollout.episode import DONE, GENERATE, Episode
from rose.rollout.launcher import WorkerConfig
from rose.rollout.pause_flag import PAUSE, RUN, STOP, PauseFlag
from rose.rollout.placement import STAY, PlacementConfig, WorkerView, place

if TYPE_CHECKING:
    from rose.rollout.tasks import Claimed


def fresh_enough(applied: int, newest: int | None, max_staleness: int) -> bool:
    """Weight-version gating: a worker takes rollout tasks only with a policy at most
    `max_staleness` versions behind the newest committed one (None: none committed yet)."""
    return newest is None or applied >= newest - max_staleness


def apply_version(engine, weights, flag: PauseFlag | None, stats: dict, verify: bool, first: bool = False) -> None:
    """Load the weight source's visible version into the engine when it is new, or when it is the
    `first` (between two decode steps); with `verify`, check it bit-exact (`weights_match`),
    counting the versions that were not in `stats`."""
    v, sd = weights.current()
    if v == engine.version and not first:
        return
    engine.load_weights(v, sd)
    if flag is not None and v is not None:
        flag.set_version(v)
    if v is None or v < 1 or not sd:  # the engine's initial policy, not a trainer's version
        return
    stats["versions_applied"] = stats.get("versions_applied", 0) + 1
    if verify:
        bad = engine.weights_match(sd)
        stats["versions_verified"] = stats.get("versions_verified", 0) + 1
        if bad:
            stats["versions_mismatched"] = stats.get("versions_mismatched", 0) + 1
            print(f"rose-worker: version {v} not bit-exact in {len(bad)} tensors, first {bad[0]}", file=sys.stderr)


class Worker:
    HEARTBEAT_S = 0.2
    VIEW_S = 0.25
    WEIGHTS_S = 0.05
    STEP_WINDOW = 512  # decode steps the heartbeat's step_ms_p50/p99 cover
    # a task whose min_version this worker has not applied waits this long for it, then goes back
    # to the shared stream for another worker (docs/rollout.md, the task queue's `min_version`)
    MIN_VERSION_WAIT_S = 5.0

    def __init__(self, config: WorkerConfig, r, queue, engine, weights, flag: PauseFlag | None):
        self.config, self.r, self.q, self.engine, self.weights, self.flag = config, r, queue, engine, weights, flag
        self.registry = WorkerRegistry(r, config.redis.key, queue.workers_key)
        self.pcfg = PlacementConfig(
            long_tail_tokens=config.long_tail_tokens,
            straggler_frac=config.straggler_frac,
            affinity_grace_ms=config.affinity_grace_ms,
        )
        self.directed = queue.register_worker(config.worker_id)
        self.active: dict[str, tuple] = {}  # seq id -> (Claimed, Episode)
        self.stop_requested = False
        self.paused = False
        self._marked = False  # this PAUSE/STOP's sighting is recorded in the flag
        self._tokened = False  # a token was produced since the start or the last pause
        self._fresh = True  # the applied policy is within max_staleness of the newest: take tasks
        self.stats = {"episodes": 0, "turns": 0, "tokens": 0, "moved": 0, "requeued": 0, "lost": 0, "duplicates": 0}
        self.stats["carried"] = 0  # tokens handed on, in trajectories or continuations
        # versions applied, and of those checked bit-exact (`verify_weights`) how many were not
        self.stats.update(versions_applied=0, versions_verified=0, versions_mismatched=0)
        self._next = {"hb": 0.0, "view": 0.0, "weights": 0.0, "reclaim": 0.0, "touch": 0.0, "read": 0.0}
        self._views: list = []
        d = engine.describe()
        self._engine_fields = {"engine": d["name"], "engine_library": d["version"], "device": d["device"]}
        from rose.rollout.turn_spans import TurnSpans

        self.spans = TurnSpans(config, d["name"], getattr(queue, "group", "rollout"))
        self._progress: dict[int, tuple[float, float]] = {}
        # wall time of the last decode steps that produced tokens: a pause waits for the step in
        # flight and a resume's first token takes one, so this bounds both (heartbeat step_ms_*)
        self._step_ms: deque[float] = deque(maxlen=self.STEP_WINDOW)
        from rose.rollout.token_stream import TokenStreamer

        self.streamer = TokenStreamer(r, config.worker_id)
        self._version_wait: dict[str, float] = {}  # seq id -> when it started waiting for its min_version

    # helpers -----------------------------------------------------------------------------
    def _due(self, name: str, now: float, every: float) -> bool:
        if now >= self._next[name]:
            self._next[name] = now + every
            return True
        return False

    def _state(self) -> int:
        if self.stop_requested:
            return STOP
        return self.flag.beat() if self.flag is not None else RUN

    def _should_pause(self) -> bool:
        """The engine's pause_check, before every forward: records the first sighting."""
        st = self.flag.effective() if self.flag is not None else RUN
        if self.stop_requested or st != RUN:
            self._mark()
            return True
        return False

    def _mark(self) -> None:
        if self.flag is not None and not self._marked:
            self.flag.mark_paused()
            self._marked = True
            self._tokened = False

    def publish(self, state: str) -> None:
        s, st = self.config, self.stats
        self.registry.beat(
            Heartbeat(
                worker_id=s.worker_id,
                gpu=s.gpu,
                job=s.job,
                dedicated=s.dedicated,
                state=state,
                pid=os.getpid(),
                ts=time.time(),
                version=self.engine.version,
                active=len(self.active),
                free_slots=self.engine.free_slots(),
                slots=self.engine.n_slots,
                episodes_done=st["episodes"],
                turns=st["turns"],
                tokens=st["tokens"],
                moved=st["moved"],
                requeued=st["requeued"],
                tokens_carried=st["carried"],
                tokens_interrupted=self.engine.interrupted_tokens,
                duplicates=st["duplicates"],
                lost=st["lost"],
                **self._engine_fields,
                versions_applied=st["versions_applied"],
                versions_verified=st["versions_verified"],
                versions_mismatched=st["versions_mismatched"],
                **self._step_fields(),
            )
        )

    def _views_now(self, now: float):
        if self._due("view", now, self.VIEW_S):
            beats = self.registry.heartbeats()
            self._views = [WorkerView(w, hb.dedicated, hb.free_slots, hb.running()) for w, hb in beats.items()]
        return self._views

    def _step_done_frac(self, step: int, now: float) -> float:
        t, frac = self._progress.get(step, (0.0, 0.0))
        if now - t > self.VIEW_S:
            sub, done = self.q.progress(step)
            frac = done / sub if sub else 0.0
            self._progress[step] = (now, frac)
        return frac

    def _here(self):
        return WorkerView(self.config.worker_id, self.config.dedicated, self.engine.free_slots())

    def _decide(self, ep, now: float):
        if self.config.dedicated:
            return STAY
        return place(
            ep.remaining_tokens,
            ep.task.moves,
            self._here(),
            self._views_now(now),
            self._step_done_frac(ep.task.step, now) if ep.task.in_step else 0.0,
            self.pcfg,
        )

    def _step_fields(self) -> dict:
        from rose.obs.stats import percentile

        if not self._step_ms:
            return {}
        ms = list(self._step_ms)
        return {"step_ms_p50": percentile(ms, 0.5, 3), "step_ms_p99": percentile(ms, 0.99, 3), "step_ms_n": len(ms)}

    # the loop ----------------------------------------------------------------------------
    def run(self) -> int:
        """The worker loop; a Redis outage pauses it (episodes stay in memory, their entries
        stay pending in the stream) until Redis answers again, instead of killing the worker."""
        from rose.weights.clients import unavailable_errors

        backoff = 0.0
        while True:
            try:
                return self._run()
            except unavailable_errors() as e:  # or a weights' cluster node (worker_process.TASKS_ON_URL)
                if self.stop_requested or self._state() == STOP:
                    return 0  # cannot hand episodes back without Redis; XAUTOCLAIM recovers them
                backoff = min(2.0, backoff * 2 or 0.1)
                print(
                    f"rose-worker: redis unavailable ({type(e).__name__}); retrying in {backoff:.1f}s",
                    file=sys.stderr,
                    flush=True,
                )
                time.sleep(backoff)

    def _run(self) -> int:
        self.publish("running")
        while True:
            state = self._state()
            if state == STOP:
                self._mark()
                self.drain()
                return 0
            if state == PAUSE:
                self._mark()
                if not self.paused:
                    self.paused = True
                    self.publish("paused")
                elif self._due("hb", time.monotonic(), self.HEARTBEAT_S):
                    self.publish("paused")
                time.sleep(0.0005)
                continue
            self._marked = False
            if self.paused:
                self.paused = False
                self.publish("running")
            now = time.monotonic()
            self._housekeeping(now)
            worked = self._tools(now)
            t_step = time.monotonic()
            stepped = self._decode_step(now)
            if self.config.max_episodes and self.stats["episodes"] >= self.config.max_episodes:
                self.drain()
                return 0
            if stepped:
                self._keep_duty_cycle(time.monotonic() - t_step)
            elif not worked:
                time.sleep(0.001)

    def _keep_duty_cycle(self, busy_s: float) -> None:
        """Leave `busy_s * (1 - share) / share` idle after a step of `busy_s`, so the worker
        uses its lease's compute share; the idle time is cut short the moment the flag says
        PAUSE or STOP (the wait is sliced at 1 ms)."""
        flag = self.flag
        share = flag.share if flag is not None else 1.0
        if flag is None or share >= 1.0 or share <= 0.0:
            return
        until = time.monotonic() + busy_s * (1.0 - share) / share
        while not self.stop_requested and flag.effective() == RUN:
            left = until - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.001))

    def _housekeeping(self, now: float) -> None:
        s = self.config
        if self._due("weights", now, self.WEIGHTS_S):
            if self.weights.poll() is not None:  # a complete version; loaded between decode steps
                apply_version(self.engine, self.weights, self.flag, self.stats, s.verify_weights)
            self._fresh = fresh_enough(self.engine.version, self.weights.newest(), s.max_staleness)
        if self._due("hb", now, self.HEARTBEAT_S):
            self.publish("running")
        if self.active and self._due("touch", now, s.min_idle_ms / 3000):
            for c in self.q.touch(s.worker_id, [c for c, _ in self.active.values()]):
                self._drop(c, "lost")
        # an admitted episode takes its slot at its first decode step (one waiting on a tool call
        # of a continuation takes it later): count active episodes, not the engine's free slots
        free = min(self.engine.free_slots(), self.engine.n_slots - len(self.active))
        if free > 0 and self._fresh and self._due("read", now, 0.005):
            got = self.q.read(s.worker_id, count=free, directed=self.directed)
            if len(got) < free and self._due("reclaim", now, s.reclaim_every_ms / 1000):
                got += self.q.reclaim(s.worker_id, s.min_idle_ms, count=free - len(got))
                if len(got) < free:
                    got += self._steal(free - len(got))
            for c in got:
                self._admit(c, now)
        if self._version_wait:
            self._overdue_versions(now)

    def _steal(self, n: int) -> list[Claimed]:
        g = self.config.affinity_grace_ms
        out: list[Claimed] = []
        for v in self._views_now(time.monotonic()):
            if len(out) >= n or v.worker_id == self.config.worker_id:
                continue
            # a leased worker leaves a live dedicated worker's turns alone longer: they are long tails
            grace = g * 10 if (v.dedicated and v.alive and not self.config.dedicated) else g
            out += self.q.steal(self.config.worker_id, self.q.directed(v.worker_id), grace, count=n - len(out))
        return out

    def _admit(self, c, now: float) -> None:
        s = self.config
        why = None
        if c.task.total_tokens > self.engine.max_seq:
            why = f"task: {c.task.total_tokens} tokens > max_seq {self.engine.max_seq}"
        elif max(c.task.prompt) >= self.engine.vocab_size:
            why = f"prompt: token {max(c.task.prompt)} outside the engine's vocabulary of {self.engine.vocab_size}"
        key = c.stream + "/" + c.entry_id
        ep = Episode(c.task, s.worker_id, s.gpu, s.dedicated, now)
        self.spans.start(key, c, ep)
        if why is not None:
            self.q.dead_letter(c.stream, c.entry_id, json.dumps(c.task.to_dict()).encode(), why)
            self.spans.end(key, ep, "dead", why)
            return
        if ep.state == DONE:
            self._complete(c, ep)
            return
        d = self._decide(ep, now)
        if d.move:
            if self.q.requeue(c, s.worker_id, ep.continuation(), to=d.to):
                self.stats["moved"] += 1
                self.stats["carried"] += ep.decoded
            self.spans.end(key, ep, "moved")
            return
        self.active[key] = (c, ep)
        if c.task.min_version > self.engine.version:
            self._version_wait[key] = now

    def _tools(self, now: float) -> bool:
        worked = False
        for key, (c, ep) in list(self.active.items()):
            if not ep.tool_ready(now):
                continue
            worked = True
            ep.finish_tool()
            d = self._decide(ep, now)
            if d.move:  # route the next turn elsewhere (per-turn placement)
                self.streamer.finish(key)
                self.engine.release(key)
                del self.active[key]
                if self.q.requeue(c, self.config.worker_id, ep.continuation(), to=d.to):
                    self.stats["moved"] += 1
                    self.stats["carried"] += ep.decoded
                self.spans.end(key, ep, "moved")
        return worked

    def _decode_step(self, now: float) -> bool:
        from rose.rollout.engine import GenRequest

        self._finish_done()
        v = self.engine.version
        ready = [(k, c, ep) for k, (c, ep) in self.active.items() if ep.state == GENERATE and ep.task.min_version <= v]
        if not ready:
            return False
        reqs = [GenRequest(k, ep.to_feed(), ep.sampler_seed()) for k, _c, ep in ready]
        t0 = time.monotonic()
        out = self.engine.generate(reqs, 1, pause_check=self._should_pause)
        if any(out):
            self._step_ms.append((time.monotonic() - t0) * 1000)
        if self.flag is not None and any(out):
            self.flag.count_steps()
            if not self._tokened:
                self.flag.mark_first_token()
                self._tokened = True
        v = self.engine.version
        t = time.monotonic()
        logprobs = self.engine.last_logprobs
        for i, ((k, c, ep), toks) in enumerate(zip(ready, out)):
            turns_before = len(ep.turns)
            key = self.q.token_stream(c.task.task_id) if ep.task.stream else ""
            lps: list[float | None] = [None] * len(toks)
            if i < len(logprobs) and len(logprobs[i]) == len(toks):
                lps = list(logprobs[i])
            for tok, lp in zip(toks, lps):
                if key:
                    self.streamer.add(k, key, len(ep.turns), len(ep.action), [tok], [v], t, lp)
                ep.on_token(tok, v, t, lp)
            self.stats["tokens"] += len(toks)
            self.stats["turns"] += len(ep.turns) - turns_before
        self.streamer.step(t)
        self._finish_done()
        return True

    def _overdue_versions(self, now: float) -> None:
        """Tasks that waited `MIN_VERSION_WAIT_S` for a policy version this worker has not
        applied go back, unchanged, to the shared stream; those it has applied start."""
        for key, since in list(self._version_wait.items()):
            entry = self.active.get(key)
            if entry is None or entry[1].task.min_version <= self.engine.version:
                del self._version_wait[key]
            elif now - since >= self.MIN_VERSION_WAIT_S:
                del self._version_wait[key]
                del self.active[key]
                self.engine.release(key)
                if self.q.requeue(entry[0], self.config.worker_id, entry[0].task) is None:
                    self.stats["lost"] += 1
                self.spans.end(key, entry[1], "returned")

    def _finish_done(self) -> None:
        """Complete every finished episode. One whose completion failed (Redis went away
        mid-call) stays active, its entry still touched, and the next pass completes it: a
        finished episode never waits in memory for a reclaim that touching prevents."""
        for k, (c, ep) in list(self.active.items()):
            if ep.state == DONE:
                self.streamer.finish(k)
                self._complete(c, ep)
                self.engine.release(k)
                del self.active[k]

    def _complete(self, c, ep) -> None:
        if self.q.complete(c, ep.trajectory()):
            self.stats["episodes"] += 1
            self.stats["carried"] += ep.decoded
            self.spans.end(c.stream + "/" + c.entry_id, ep, "completed")
        else:
            self.stats["duplicates"] += 1
            self.spans.end(c.stream + "/" + c.entry_id, ep, "duplicate")

    def _drop(self, c, why: str) -> None:
        key = c.stream + "/" + c.entry_id
        entry = self.active.pop(key, None)
        self.spans.end(key, entry[1] if entry else None, why)
        self.streamer.finish(key)
        self.engine.release(key)
        self.stats[why] += 1

    def drain(self) -> None:
        """Push every unfinished episode back as a continuation (acked atomically)."""
        self.publish("draining")
        self.streamer.flush()
        for key, (c, ep) in list(self.active.items()):
            self.streamer.finish(key)
            if self.q.requeue(c, self.config.worker_id, ep.continuation()):
                self.stats["requeued"] += 1
                self.stats["carried"] += ep.decoded
                self.spans.end(key, ep, "requeued")
            else:
                self.stats["lost"] += 1  # another worker already holds it
                self.spans.end(key, ep, "lost")
            self.engine.release(key)
            del self.active[key]
        self.q.retire_worker(self.config.worker_id)
        self.publish("stopped")


if __name__ == "__main__":  # the contract's older entry point: run the process module (no import of it here)
    import runpy

    runpy.run_module("rose.rollout.worker_process", run_name="__main__", alter_sys=True)
