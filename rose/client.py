"""The trainer's API to ROSE: submit episodes, read trajectories, publish weight versions.

    from rose.client import RoseClient

    with RoseClient(job="math", model="policy") as rose:
        ids = rose.submit_many(prompts, max_turns=1, tokens_per_turn=256, obs_tokens=0, seeds=range(8), step=0)
        for traj in rose.results(step=0, count=len(ids), timeout_s=600):
            ...
        v = rose.publish_weights(model.state_dict())
        rose.wait_applied(v, timeout_s=60)

A `RoseClient` holds one Redis connection (the task queue, results and heartbeats at
`redis.url`) and, from its first `publish_weights`, the weight-stream publisher (on the Redis
Cluster of `redis.cluster_nodes` when set). It is not thread-safe: use one per thread. Every
argument a trainer can get wrong raises ValueError naming the argument. The keys it uses, the
wire formats and the guarantees behind them: docs/contract.md §6, docs/rollout.md,
docs/weights.md; this API with a GRPO loop: docs/client.md.

torch is imported only by `publish_weights`, so a process that only submits and reads results
needs the base install alone.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as _field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import orjson
import redis

from rose.config import Config, load_config
from rose.contract import records
from rose.contract.records import NO_VERSION, WorkerRegistry, as_text, live
from rose.obs.logs import get_logger
from rose.rollout.episode import InvalidTask, Task
from rose.rollout.tasks import TaskQueue
from rose.weights.inputs import tensors

if TYPE_CHECKING:
    import torch

    from rose.weights.stream import PublishStats, WeightPublisher

__all__ = ["RoseClient", "Trajectory", "TrajectoryTurn", "WorkerStatus"]

_READ_COUNT = 1000  # results entries per XREAD
_BLOCK_SLICE_MS = 1000  # a blocking read waits at most this long per call (Ctrl-C stays prompt)
# Task fields as the trainer's argument names
_ARG = {"prompt": "prompt_token_ids"}


@dataclass(frozen=True)
class TrajectoryTurn:
    """One turn of a finished episode: the action the policy generated and the tool's reply."""

    action: list[int]
    observation: list[int]  # [] after the last turn (no tool step follows it)
    token_versions: list[int]  # the policy version that generated each action token
    version: int  # ... of the first action token
    version_end: int  # ... of the last one
    worker: str  # where the turn ran (an episode may move between workers)
    gpu: str
    dedicated: bool
    tool_s: float  # the tool step's latency
    # per action token, its log-probability under the distribution it was sampled from (logits
    # over the sampling temperature); [] when the engine did not report them (older data)
    logprobs: list[float] = _field(default_factory=list)


@dataclass(frozen=True)
class Trajectory:
    """A finished episode, as a rollout worker appended it to the results stream.

    `tokens` is the whole sequence: `prompt`, then per turn its action and observation.
    `action_mask`, `token_versions` and `token_logprobs` are aligned with `tokens`."""

    task_id: str
    step: int
    prompt: list[int]
    turns: list[TrajectoryTurn]
    tokens: list[int]
    worker: str  # the worker that finished it
    gpu: str
    dedicated: bool
    moves: int  # how many times the episode changed worker
    finished_at: float  # Unix time
    finish_reason: str | None  # when the worker recorded one, else None
    entry_id: str  # its id in the results stream

    @property
    def action_mask(self) -> list[bool]:
        """Per token of `tokens`: True where the policy generated it (action tokens)."""
        out = [False] * len(self.prompt)
        for t in self.turns:
            out += [True] * len(t.action) + [False] * len(t.observation)
        return out

    @property
    def token_versions(self) -> list[int]:
        """Per token of `tokens`: the policy version that generated it, -1 for prompt and observation tokens."""
        out = [-1] * len(self.prompt)
        for t in self.turns:
            out += t.token_versions + [-1] * len(t.observation)
        return out

    @property
    def token_logprobs(self) -> list[float]:
        """Per token of `tokens`: the log-probability the sampling policy gave it, 0.0 for prompt
        and observation tokens (mask them with `action_mask`), NaN for the action tokens of a turn
        whose logprobs were not reported."""
        out = [0.0] * len(self.prompt)
        for t in self.turns:
            out += (t.logprobs or [math.nan] * len(t.action)) + [0.0] * len(t.observation)
        return out

    @property
    def min_version(self) -> int:
        """The oldest policy version behind any of its action tokens (-1 when it has none)."""
        return min((v for t in self.turns for v in t.token_versions), default=-1)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], entry_id: str = "") -> Trajectory:
        """Parse a results-stream trajectory (`Episode.trajectory()`); ValueError naming the field."""
        field = "trajectory"
        try:
            field = "turns"
            turns = []
            raw_tv = d.get("token_versions")
            raw_lp = d.get("token_logprobs")
            for i, t in enumerate(d["turns"]):
                field = f"turns[{i}]"
                action = _ints(t["action"])
                tv = (
                    t.get("versions")
                    or (raw_tv[i] if raw_tv is not None else None)
                    or [int(t["version"])] * len(action)
                )
                tv = _ints(tv)
                if len(tv) != len(action):
                    raise ValueError(f"{len(tv)} token versions for {len(action)} action tokens")
                lp = [float(x) for x in t.get("logprobs") or (raw_lp[i] if raw_lp else None) or []]
                if lp and len(lp) != len(action):
                    raise ValueError(f"{len(lp)} token logprobs for {len(action)} action tokens")
                turns.append(
                    TrajectoryTurn(
                        action=action,
                        observation=_ints(t.get("observation") or []),
                        token_versions=tv,
                        version=int(t["version"]),
                        version_end=int(t.get("version_end", t["version"])),
                        worker=str(t.get("worker", "")),
                        gpu=str(t.get("gpu", "")),
                        dedicated=bool(t.get("dedicated", False)),
                        tool_s=float(t.get("tool_s", 0.0)),
                        logprobs=lp,
                    )
                )
            field = "trajectory"
            fr = d.get("finish_reason")
            traj = cls(
                task_id=str(d["task_id"]),
                step=int(d["step"]),
                prompt=_ints(d["prompt"]),
                turns=turns,
                tokens=_ints(d["tokens"]),
                worker=str(d.get("worker", "")),
                gpu=str(d.get("gpu", "")),
                dedicated=bool(d.get("dedicated", False)),
                moves=int(d.get("moves", 0)),
                finished_at=float(d.get("finished_at", 0.0)),
                finish_reason=None if fr is None else str(fr),
                entry_id=entry_id,
            )
        except KeyError as e:
            raise ValueError(f"{field}: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError, IndexError) as e:
            raise ValueError(f"{field}: {e}") from None
        expected = len(traj.prompt) + sum(len(t.action) + len(t.observation) for t in turns)
        if len(traj.tokens) != expected:
            raise ValueError(f"tokens: {len(traj.tokens)} tokens, but prompt and turns hold {expected}")
        return traj


@dataclass(frozen=True)
class WorkerStatus:
    """A rollout worker of the job, as its heartbeat hash shows it."""

    worker_id: str
    version: int  # the weight version its engine runs (NO_VERSION, -1: none reported)
    state: str  # running | paused | draining | stopped ("" without a heartbeat)
    age_s: float  # seconds since its last heartbeat (inf without one)
    gpu: str
    dedicated: bool

    @property
    def live(self) -> bool:
        return live(self.state, self.age_s)


def _ints(v: Any) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ValueError("expected a list of integers")
    return v


def _int_arg(name: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name}: expected an integer >= {lo}, got {v!r}")
    return v


def _seconds_arg(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0 or v == float("inf"):
        raise ValueError(f"{name}: expected a finite number of seconds >= 0, got {v!r}")
    return float(v)


def _token_ids(name: str, v: Any) -> list[int]:
    """A prompt as a list of ints >= 0: a sequence of ints, or a 1-D numpy array or torch tensor."""
    if isinstance(v, str | bytes | bytearray | Mapping) or not isinstance(v, Iterable):
        raise ValueError(f"{name}: expected a sequence of token ids (ints >= 0), got {type(v).__name__}")
    if hasattr(v, "tolist"):  # numpy array, torch tensor
        v = v.tolist()
    out = list(v)
    if not out:
        raise ValueError(f"{name}: must not be empty")
    for i, t in enumerate(out):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"{name}: expected token ids (ints >= 0), got {t!r} at index {i}")
    return out


class RoseClient:
    """A trainer's connection to ROSE, for one rollout job and one model's weight stream.

    `config` defaults to `load_config()` (defaults < $ROSE_CONFIG < ROSE_* environment); `job`
    and `model` default to the config's `executor.job` and `executor.model`, what the executors'
    workers serve and follow."""

    def __init__(self, config: Config | None = None, *, job: str | None = None, model: str | None = None):
        self.config = config if config is not None else load_config()
        self.job = self.config.executor.job if job is None else job
        self.model = self.config.executor.model if model is None else model
        if not isinstance(self.job, str) or not self.job:
            raise ValueError(f"job: expected a non-empty string, got {self.job!r}")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model: expected a non-empty string, got {self.model!r}")
        self.redis = redis.Redis.from_url(self.config.redis.url)
        self.queue = TaskQueue(self.redis, self.config.redis, self.job)
        self.workers_registry = WorkerRegistry(self.redis, self.config.redis.key, self.queue.workers_key)
        self.last_publish: PublishStats | None = None  # what the last publish_weights sent
        self._publisher: WeightPublisher | None = None
        self._weights_redis: Any = None
        self._cursor = "0-0"  # the results stream is read up to here ...
        self._unread: list[Trajectory] = []  # ... and these were read but not yet yielded
        self._log = get_logger("rose.client", job=self.job, model=self.model)

    @classmethod
    def from_config(
        cls, path: str | Path | None = None, *, job: str | None = None, model: str | None = None
    ) -> RoseClient:
        """A client for the config file at `path` (else $ROSE_CONFIG), with the environment on top."""
        return cls(load_config(path), job=job, model=model)

    def close(self) -> None:
        """Close the Redis connections (the publisher's view of the receivers' weights goes with it)."""
        if self._weights_redis is not None and self._weights_redis is not self.redis:
            self._weights_redis.close()
        self._weights_redis = self._publisher = None
        self.redis.close()

    def __enter__(self) -> RoseClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- episodes -------------------------------------------------------------------------

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        *,
        max_turns: int,
        tokens_per_turn: int,
        obs_tokens: int,
        seed: int,
        step: int,
        task_id: str | None = None,
    ) -> str:
        """Queue one episode of RL step `step`; returns its task_id (a new unique one when not given).

        The worker's sampling derives from `seed` alone: episodes with the same prompt and seed
        generate the same tokens, so give each sample of a group its own seed. A task_id must be
        unique within the job: a second result for an id is dropped as a duplicate."""
        task = self._task(prompt_token_ids, max_turns, tokens_per_turn, obs_tokens, seed, step, task_id, "")
        self.queue.submit(task)
        return task.task_id

    def submit_many(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_turns: int,
        tokens_per_turn: int,
        obs_tokens: int,
        seeds: Sequence[int],
        step: int,
        task_ids: Sequence[str] | None = None,
    ) -> list[str]:
        """`submit` for a batch, in one round trip (one MULTI/EXEC): episode i has prompt
        `prompts[i]` and seed `seeds[i]`. All are validated before any is queued."""
        if isinstance(prompts, str | bytes) or not isinstance(prompts, Iterable):
            raise ValueError(f"prompts: expected a sequence of token id sequences, got {type(prompts).__name__}")
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts: must not be empty")
        if isinstance(seeds, str | bytes) or not isinstance(seeds, Iterable):
            raise ValueError(f"seeds: expected a sequence of ints, one per prompt, got {type(seeds).__name__}")
        seeds = list(seeds)
        if len(seeds) != len(prompts):
            raise ValueError(f"seeds: {len(seeds)} seeds for {len(prompts)} prompts (one per prompt)")
        ids: list[str | None] = [None] * len(prompts)
        if task_ids is not None:
            if isinstance(task_ids, str) or not isinstance(task_ids, Iterable):
                raise ValueError("task_ids: expected a sequence of strings, one per prompt")
            ids = list(task_ids)
            if len(ids) != len(prompts):
                raise ValueError(f"task_ids: {len(ids)} ids for {len(prompts)} prompts (one per prompt)")
            seen: set[str | None] = set()
            for t in ids:
                if t in seen:
                    raise ValueError(f"task_ids: {t!r} appears more than once")
                seen.add(t)
        tasks = [
            self._task(p, max_turns, tokens_per_turn, obs_tokens, s, step, t, f"[{i}]")
            for i, (p, s, t) in enumerate(zip(prompts, seeds, ids))
        ]
        self.queue.ensure_group()
        pipe = self.redis.pipeline(transaction=True)
        for task in tasks:  # the entries TaskQueue.submit writes
            pipe.xadd(self.queue.stream, {"task_id": task.task_id, "task": orjson.dumps(task.to_dict())})
        pipe.hincrby(self.queue.stats_key, f"submitted:{step}", len(tasks))
        pipe.execute()
        return [t.task_id for t in tasks]

    def _task(
        self,
        prompt: Any,
        max_turns: Any,
        tokens_per_turn: Any,
        obs_tokens: Any,
        seed: Any,
        step: Any,
        task_id: Any,
        where: str,
    ) -> Task:
        """A Task checked as a worker will check it (Task.from_dict); ValueError naming the argument."""
        p_arg, s_arg, t_arg = ("prompts" + where, "seeds" + where, "task_ids" + where) if where else ("", "", "")
        prompt_ids = _token_ids(p_arg or "prompt_token_ids", prompt)
        if task_id is None:
            task_id = f"{step}-{uuid.uuid4().hex}"
        d = {
            "task_id": task_id,
            "prompt": prompt_ids,
            "max_turns": max_turns,
            "tokens_per_turn": tokens_per_turn,
            "obs_tokens": obs_tokens,
            "seed": seed,
            "step": step,
        }
        try:
            return Task.from_dict(d)
        except InvalidTask as e:
            arg = {"prompt": p_arg, "seed": s_arg, "task_id": t_arg}.get(e.field) or _ARG.get(e.field, e.field)
            raise ValueError(f"{arg}: {str(e).removeprefix(e.field + ': ')}") from None

    def progress(self, step: int) -> tuple[int, int]:
        """(submitted, completed) episodes of RL step `step`."""
        return self.queue.progress(_int_arg("step", step, 0))

    def results(
        self, step: int | None = None, *, timeout_s: float | None = None, count: int | None = None
    ) -> Iterator[Trajectory]:
        """Finished episodes, in the order workers completed them, each yielded once per client.

        Reading resumes where the previous call stopped. With `step`, only that step's
        trajectories are yielded; others read on the way are kept (in this client's memory) for
        a later call that asks for their step, or for all. Stops after `count` trajectories,
        or once `timeout_s` has passed (a total, not per trajectory), whichever comes first;
        with neither, yields those already there without waiting; with `count` alone, waits
        as long as it takes. Stopping at `timeout_s` raises nothing: compare how many came.
        A trajectory is taken off the client's cursor as it is yielded, so leaving the loop
        early loses nothing."""
        if step is not None:
            _int_arg("step", step, 0)
        if count is not None:
            _int_arg("count", count, 1)
        if timeout_s is not None:
            deadline: float | None = time.monotonic() + _seconds_arg("timeout_s", timeout_s)
        else:
            deadline = None if count is not None else time.monotonic()  # count alone: no limit; neither: no wait
        return self._results(step, count, deadline)

    def _results(self, step: int | None, count: int | None, deadline: float | None) -> Iterator[Trajectory]:
        n = 0
        caught_up = False  # past the deadline: read on without waiting until the stream's end, once
        while count is None or n < count:
            t = self._take(step)
            if t is not None:
                n += 1
                yield t
                continue
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                if caught_up:
                    return
                caught_up = self._fetch(None) < _READ_COUNT
                continue
            self._fetch(_BLOCK_SLICE_MS if left is None else max(1, min(_BLOCK_SLICE_MS, int(left * 1000))))

    def _take(self, step: int | None) -> Trajectory | None:
        for i, t in enumerate(self._unread):
            if step is None or t.step == step:
                return self._unread.pop(i)
        return None

    def _fetch(self, block_ms: int | None) -> int:
        """Read the next results entries into the unread list; how many were read."""
        got = cast(
            "list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]] | None",
            self.redis.xread({self.queue.results_stream: self._cursor}, count=_READ_COUNT, block=block_ms),
        )
        n = 0
        for _stream, entries in got or []:
            for eid, fields in entries:
                n += 1
                self._cursor = as_text(eid)
                try:
                    body = records.Trajectory.from_fields(fields).body
                    self._unread.append(Trajectory.from_dict(body, self._cursor))
                except ValueError as e:
                    self._log.warning("results_entry_unreadable", entry_id=self._cursor, error=str(e))
        return n

    # -- weights --------------------------------------------------------------------------

    def publish_weights(
        self,
        weights: Mapping[str, Any] | str | os.PathLike,
        *,
        version: int | None = None,
        dtype: torch.dtype | str | None = "bfloat16",
    ) -> int:
        """Publish a weight version; returns its number (the last published + 1 unless `version`).

        `weights` is a state dict of torch tensors (or numpy arrays), on any device, or a path to
        a .safetensors file or to a checkpoint directory holding them (an HF `save_pretrained`
        directory, sharded or not). Floating-point tensors are cast to `dtype` (torch.bfloat16,
        torch.float16 or torch.float32, or their names; None publishes each as it is); others
        are published as they are. Sends what changed since the previous version (a keyframe
        first and every `keyframe_every` versions) and returns once the version is committed."""
        if version is not None:
            _int_arg("version", version, 1)
        specs, arrays = tensors(weights, dtype)
        stats = self._weights_publisher().publish_raw(specs, arrays, version=version)
        self.last_publish = stats
        return stats.version

    def _weights_publisher(self) -> WeightPublisher:
        if self._publisher is None:
            from rose.weights.clients import weights_client
            from rose.weights.stream import WeightPublisher

            self._weights_redis = weights_client(self.config.redis, self.redis)
            self._publisher = WeightPublisher(
                self._weights_redis,
                self.config.redis,
                self.model,
                hmac_key=self.config.security.weights_hmac_key,
            )
        return self._publisher

    def workers(self) -> list[WorkerStatus]:
        """The job's rollout workers (those that registered with its task queue), by id."""
        ids = self.workers_registry.registered()
        beats = self.workers_registry.read_many(ids)
        now = time.time()
        out = []
        for w in ids:
            hb = beats.get(w)  # none, or unreadable: no heartbeat
            if hb is None:
                out.append(WorkerStatus(w, NO_VERSION, "", float("inf"), "", False))
            else:
                out.append(WorkerStatus(w, hb.version, hb.state, hb.age_s(now), hb.gpu, hb.dedicated))
        return out

    def wait_applied(self, version: int, *, timeout_s: float, min_workers: int = 1) -> list[str]:
        """Wait until at least `min_workers` live workers of the job (fresh heartbeat, running or
        paused) run weight version `version` or a newer one; returns the ids of those that do.
        TimeoutError after `timeout_s`, naming the workers behind and the version each runs."""
        _int_arg("version", version, 0)
        _int_arg("min_workers", min_workers, 1)
        deadline = time.monotonic() + _seconds_arg("timeout_s", timeout_s)
        while True:
            ws = self.workers()
            ready = [w.worker_id for w in ws if w.live and w.version >= version]
            if len(ready) >= min_workers:
                return ready
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(self._not_applied(version, ws, ready, min_workers, timeout_s))
            time.sleep(min(0.05, left))

    def _not_applied(
        self, version: int, ws: list[WorkerStatus], ready: list[str], min_workers: int, timeout_s: float
    ) -> str:
        live = [w for w in ws if w.live]
        said = (
            f"weight version {version} of model {self.model!r}: {len(ready)} of {len(live)} live workers "
            f"of job {self.job!r} run it after {timeout_s:g}s (wanted {min_workers})"
        )
        behind = [f"{w.worker_id} at version {w.version} ({w.state})" for w in live if w.version < version]
        gone = [
            f"{w.worker_id} ({f'heartbeat {w.age_s:.1f}s old' if w.age_s != float('inf') else 'no heartbeat'}, "
            f"{w.state or 'no state'}, version {w.version})"
            for w in ws
            if not w.live
        ]
        if behind:
            said += "; behind: " + ", ".join(behind)
        if gone:
            said += "; not live: " + ", ".join(gone)
        if not ws:
            said += f"; no worker has registered with the job's task queue ({self.queue.workers_key})"
        return said
