"""Agentic episodes: ReAct-style turns (generate an action, then a simulated tool step that
takes time and appends observation tokens), as pure data and state transitions.

A `Task` is what the trainer submits and what a preempted worker pushes back: the episode
spec plus the turns done so far (a continuation). Everything here is deterministic from
the task: the sampler seed of turn i and the tool latency/observation of turn i derive
from (seed, i), so a continuation resumed on another worker draws what the first worker
would have drawn. No I/O and no torch: the worker owns the clock and the engine.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field

MAX_TOKENS = 1 << 16


class InvalidTask(ValueError):
    """A task that cannot be run; `field` names what is wrong."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field


@dataclass(frozen=True)
class ToolLatency:
    """Tool-call duration in seconds: lognormal exp(N(mu, sigma)), capped at max_s."""

    mu: float = -3.0  # median e^-3 ≈ 50 ms
    sigma: float = 0.5
    max_s: float = 10.0

    def draw(self, rng: random.Random) -> float:
        return (
            min(self.max_s, rng.lognormvariate(self.mu, self.sigma))
            if self.sigma > 0
            else min(self.max_s, 2.718281828459045**self.mu)
        )


@dataclass
class Turn:
    action: list[int]
    observation: list[int] | None  # None: the tool step of this turn has not finished
    version: int  # policy version that generated the first token of the action
    version_end: int  # ... and the last one (versions switch only between decode steps)
    worker: str
    gpu: str
    dedicated: bool
    tool_s: float = 0.0
    versions: list[int] = field(default_factory=list)  # per action token (v1.1); empty in older data
    # per action token, its log-probability under the distribution it was sampled from; empty in older data
    logprobs: list[float] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict, path: str) -> Turn:
        try:
            obs = d.get("observation")
            return cls(
                action=_tokens(d, "action", path),
                observation=None if obs is None else _tokens(d, "observation", path),
                version=int(d["version"]),
                version_end=int(d.get("version_end", d["version"])),
                worker=str(d.get("worker", "")),
                gpu=str(d.get("gpu", "")),
                dedicated=bool(d.get("dedicated", False)),
                tool_s=float(d.get("tool_s", 0.0)),
                versions=_versions(d, "versions", len(d["action"]), path) if "versions" in d else [],
                logprobs=_logprobs(d, "logprobs", len(d["action"]), path) if d.get("logprobs") else [],
            )
        except KeyError as e:
            raise InvalidTask(f"{path}{e.args[0]}", "missing required field") from None
        except InvalidTask:
            raise  # names the turn's field at fault
        except (TypeError, ValueError):
            raise InvalidTask(path.rstrip("."), "malformed turn") from None


# token ids of any vocabulary; the worker checks them against its engine's (`Worker._admit`)
MAX_TOKEN_ID = (1 << 31) - 1


def _tokens(d: dict, key: str, path: str = "") -> list[int]:
    v = d.get(key)
    if (
        not isinstance(v, list)
        or len(v) > MAX_TOKENS
        or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in v)
    ):
        raise InvalidTask(path + key, f"expected a list of token ids (ints 0..{MAX_TOKEN_ID})")
    return v


def _versions(d: dict, key: str, n: int, path: str = "") -> list[int]:
    """Per-token policy versions: one non-negative int per token."""
    v = d.get(key)
    if not isinstance(v, list) or len(v) != n or not all(isinstance(x, int) and x >= 0 for x in v):
        raise InvalidTask(path + key, f"expected {n} policy versions (ints >= 0), one per token")
    return v


def _logprobs(d: dict, key: str, n: int, path: str = "") -> list[float]:
    """Per-token log-probabilities: one finite number <= 0 per token."""
    v = d.get(key)
    if (
        not isinstance(v, list)
        or len(v) != n
        or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and -math.inf < x <= 0 for x in v)
    ):
        raise InvalidTask(path + key, f"expected {n} log-probabilities (finite numbers <= 0), one per token")
    return [float(x) for x in v]


def _int(d: dict, key: str, lo: int, hi: int, default: int | None = None) -> int:
    v = d.get(key, default)
    if v is None:
        raise InvalidTask(key, "missing required field")
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise InvalidTask(key, f"expected an integer in [{lo}, {hi}], got {v!r}")
    return v


@dataclass
class Task:
    task_id: str
    prompt: list[int]
    max_turns: int = 4
    tokens_per_turn: int = 32
    obs_tokens: int = 16
    tool: ToolLatency = field(default_factory=ToolLatency)
    seed: int = 0
    step: int = 0  # the RL step this episode belongs to
    turns: list[Turn] = field(default_factory=list)  # a continuation carries the turns so far
    moves: int = 0  # how many times the episode changed worker
    # a continuation also carries the action in progress (v1.1, no lost tokens): its tokens and
    # the policy version of each; the next worker prefills them and samples on from there
    partial: list[int] = field(default_factory=list)
    partial_versions: list[int] = field(default_factory=list)
    partial_logprobs: list[float] = field(default_factory=list)  # empty when not known (older data)
    # publish each turn's tokens as they are made, to the task's token stream (docs/rollout.md)
    stream: bool = False
    # the turn runs only on a policy of at least this version (the worker waits to apply it)
    min_version: int = 0
    # part of an RL step that ends with its last episode (the straggler rule moves such episodes
    # to dedicated workers as the step nears its end); a gateway turn belongs to no such step
    in_step: bool = True
    # W3C trace context of whoever queued the task (a gateway request's `send` span); kept by a
    # continuation, so every worker that runs a part of it records its span in that one trace
    traceparent: str = ""

    @property
    def total_tokens(self) -> int:
        return len(self.prompt) + self.max_turns * (self.tokens_per_turn + self.obs_tokens)

    @property
    def remaining_turns(self) -> int:
        return self.max_turns - len(self.turns)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Task:
        if not isinstance(d, dict):
            raise InvalidTask("task", "expected a JSON object")
        tid = d.get("task_id")
        if not isinstance(tid, str) or not tid or len(tid) > 256:
            raise InvalidTask("task_id", "expected a non-empty string of at most 256 characters")
        tool = d.get("tool", {})
        if not isinstance(tool, dict):
            raise InvalidTask("tool", "expected an object {mu, sigma, max_s}")
        try:
            tl = ToolLatency(**{k: float(v) for k, v in tool.items()})
        except (TypeError, ValueError):
            raise InvalidTask("tool", "expected numbers mu, sigma >= 0, max_s >= 0") from None
        if tl.sigma < 0 or tl.max_s < 0 or not -20 < tl.mu < 10:
            raise InvalidTask("tool", "expected numbers mu in (-20, 10), sigma >= 0, max_s >= 0")
        raw_turns = d.get("turns", [])
        if not isinstance(raw_turns, list):
            raise InvalidTask("turns", "expected a list")
        t = cls(
            task_id=tid,
            prompt=_tokens(d, "prompt"),
            max_turns=_int(d, "max_turns", 1, 1024, 4),
            tokens_per_turn=_int(d, "tokens_per_turn", 1, MAX_TOKENS, 32),
            obs_tokens=_int(d, "obs_tokens", 0, MAX_TOKENS, 16),
            tool=tl,
            seed=_int(d, "seed", 0, (1 << 63) - 1, 0),
            step=_int(d, "step", 0, (1 << 63) - 1, 0),
            turns=[
                Turn.from_dict(x, f"turns[{i}].") if isinstance(x, dict) else _bad_turn(i)
                for i, x in enumerate(raw_turns)
            ],
            moves=_int(d, "moves", 0, 1 << 31, 0),
            partial=_tokens(d, "partial") if "partial" in d else [],
            stream=_flag(d, "stream"),
            in_step=_flag(d, "in_step", True),
            min_version=_int(d, "min_version", 0, (1 << 63) - 1, 0),
            traceparent=_traceparent(d),
        )
        if t.partial:
            t.partial_versions = _versions(d, "partial_versions", len(t.partial))
            if d.get("partial_logprobs"):
                t.partial_logprobs = _logprobs(d, "partial_logprobs", len(t.partial))
            if len(t.partial) >= t.tokens_per_turn:
                raise InvalidTask("partial", f"{len(t.partial)} tokens >= tokens_per_turn {t.tokens_per_turn}")
        if not t.prompt:
            raise InvalidTask("prompt", "must not be empty")
        if len(t.turns) > t.max_turns:
            raise InvalidTask("turns", f"{len(t.turns)} turns > max_turns {t.max_turns}")
        return t


def _flag(d: dict, key: str, default: bool = False) -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise InvalidTask(key, f"expected true or false, got {v!r}")
    return v


def _traceparent(d: dict) -> str:
    v = d.get("traceparent", "")
    if not isinstance(v, str) or len(v) > 256:
        raise InvalidTask("traceparent", "expected a W3C traceparent string")
    return v


def _bad_turn(i: int):
    raise InvalidTask(f"turns[{i}]", "expected an object")


def turn_seed(seed: int, turn: int) -> int:
    return (seed * 1_000_003 + turn * 7919 + 1) % (1 << 63)


def tool_step(task: Task, turn: int) -> tuple[float, list[int]]:
    """(latency_s, observation tokens) of the tool call after `turn`: deterministic."""
    rng = random.Random(turn_seed(task.seed, turn))
    latency = task.tool.draw(rng)
    head = list(f"\n<obs {turn}>".encode())[: task.obs_tokens]
    body = [rng.randrange(32, 127) for _ in range(task.obs_tokens - len(head))]
    return latency, head + body


GENERATE, TOOL, DONE = "generate", "tool", "done"


class Episode:
    """One episode on one worker: the task, the turns so far and where it stands."""

    def __init__(self, task: Task, worker: str, gpu: str, dedicated: bool, now: float):
        self.task = task
        self.turns: list[Turn] = list(task.turns)
        self.worker, self.gpu, self.dedicated = worker, gpu, dedicated
        self.action: list[int] = []
        self.action_versions: list[int] = []
        self.action_logprobs: list[float] = []
        self.version_first = -1
        self.fed = 0  # context tokens the engine already holds (sampled tokens included)
        self.new_turn = True
        self.tool_until = 0.0
        self.pending_obs: list[int] = []
        self.affinity_hits = 0
        self.decoded = 0  # tokens sampled on this worker: all carried on by trajectory() or continuation()
        if self.turns and self.turns[-1].observation is None and len(self.turns) < task.max_turns:
            self._start_tool(now)  # preempted during its tool call: run the call again
        elif len(self.turns) >= task.max_turns:
            self.state = DONE
        else:
            self.state = GENERATE
            if task.partial:  # resumed mid-action: keep its tokens, prefill them, sample on
                self.action = list(task.partial)
                self.action_versions = list(task.partial_versions)
                self.action_logprobs = list(task.partial_logprobs)
                self.version_first = self.action_versions[0]
        self.resumed_tokens = len(self.action)

    @property
    def remaining_turns(self) -> int:
        return self.task.max_turns - len(self.turns)

    @property
    def remaining_tokens(self) -> int:
        return self.remaining_turns * self.task.tokens_per_turn - len(self.action)

    def context(self) -> list[int]:
        out = list(self.task.prompt)
        for t in self.turns:
            out += t.action
            out += t.observation or []
        return out + self.action

    def to_feed(self) -> list[int]:
        """Tokens to hand the engine before the next sample (all of them on a new worker)."""
        ctx = self.context()
        new = ctx[self.fed :]
        self.fed = len(ctx)
        return new

    def sampler_seed(self) -> int | None:
        """A seed when a turn starts (so the turn's draws depend only on the task), else None."""
        if self.new_turn:
            self.new_turn = False
            seed = turn_seed(self.task.seed, len(self.turns))
            return seed if not self.action else turn_seed(seed, len(self.action))  # resumed mid-action
        return None

    def on_token(self, tok: int, version: int, now: float, logprob: float | None = None) -> None:
        """A sampled token, the policy version that sampled it and its log-probability (None:
        not known; a turn keeps logprobs only when every token of its action has one)."""
        if not self.action:
            self.version_first = version
        if logprob is not None and len(self.action_logprobs) == len(self.action):
            self.action_logprobs.append(logprob)
        self.action.append(tok)
        self.action_versions.append(version)
        self.fed += 1
        self.decoded += 1
        if len(self.action) >= self.task.tokens_per_turn:
            self.turns.append(
                Turn(
                    action=self.action,
                    observation=None,
                    version=self.version_first,
                    version_end=version,
                    worker=self.worker,
                    gpu=self.gpu,
                    dedicated=self.dedicated,
                    versions=self.action_versions,
                    logprobs=self.action_logprobs if len(self.action_logprobs) == len(self.action) else [],
                )
            )
            self.action = []
            self.action_versions = []
            self.action_logprobs = []
            self.new_turn = True
            if len(self.turns) >= self.task.max_turns:
                self.state = DONE
            else:
                self._start_tool(now)

    def _start_tool(self, now: float) -> None:
        latency, obs = tool_step(self.task, len(self.turns) - 1)
        self.turns[-1].tool_s = latency
        self.pending_obs = obs
        self.tool_until = now + latency
        self.state = TOOL

    def tool_ready(self, now: float) -> bool:
        return self.state == TOOL and now >= self.tool_until

    def finish_tool(self) -> None:
        """The tool returned: its observation joins the context; the next turn may start."""
        self.turns[-1].observation = self.pending_obs
        self.pending_obs = []
        self.state = GENERATE

    def continuation(self) -> Task:
        """The task to push back: the turns so far and the action in progress with the policy
        version of each of its tokens (the next worker prefills them, never regenerates them);
        a tool call in flight is re-run by the next worker."""
        return Task(
            **{
                **self.task.__dict__,
                "turns": [Turn(**asdict(x)) for x in self.turns],
                "moves": self.task.moves + 1,
                "partial": list(self.action),
                "partial_versions": list(self.action_versions),
                "partial_logprobs": list(self.action_logprobs) if len(self.action_logprobs) == len(self.action) else [],
            }
        )

    def trajectory(self, now: float | None = None) -> dict:
        """The finished episode as appended to the results stream."""
        return {
            "task_id": self.task.task_id,
            "step": self.task.step,
            "prompt": self.task.prompt,
            "turns": [asdict(t) for t in self.turns],
            "tokens": self.context(),
            "versions": [t.version for t in self.turns],
            # per action token, so the trainer can mask or correct tokens of a stale policy
            "token_versions": [t.versions or [t.version] * len(t.action) for t in self.turns],
            # per action token, its log-probability under the sampling policy (empty for a turn without them)
            "token_logprobs": [t.logprobs for t in self.turns],
            "worker": self.worker,
            "gpu": self.gpu,
            "dedicated": self.dedicated,
            "moves": self.task.moves,
            "finished_at": time.time() if now is None else now,
        }
