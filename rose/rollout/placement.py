"""Elastic placement of agentic turns (the elastic rollout scheduler), as a pure policy.

Routing is per TURN, not per episode: after every turn, while the tool call runs, the
worker holding the episode decides where the next turn goes. The policy, in order:

1. Cache affinity by default: the next turn stays on the worker that already holds the
   episode's prefix in its KV cache (no re-prefill). A moved turn goes to one worker's
   directed stream, so the prefix it rebuilds there is reused for the turns after it; a
   directed turn not taken within `affinity_grace_ms` may be taken by any worker.
2. Long tail on dedicated workers: an episode with ≥ `long_tail_tokens` still to
   generate that sits on a leased (revocable) worker moves to the dedicated worker with
   the most free slots; a leased worker that reads such an episode from the shared
   stream forwards it before generating anything. Short turns stay on leased workers,
   whose capacity comes and goes with serving load.
3. Stragglers off revocable workers: once `straggler_frac` of the RL step's episodes are
   complete, every episode still on a leased worker moves to a dedicated one, so a revoke
   near the end of the step cannot hold the step back.
4. A move needs somewhere to go: no live dedicated worker with a free slot → stay. An
   episode moves at most `max_moves` times (no ping-pong on stale capacity figures).
Dedicated workers never move work away. Measured by `affinity_hit_rate` and
`long_tail_on_dedicated` over the results stream (tests/test_rollout_placement.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PlacementConfig:
    long_tail_tokens: int = 192
    straggler_frac: float = 0.8
    affinity_grace_ms: int = 500
    max_moves: int = 2


@dataclass(frozen=True)
class WorkerView:
    """What a worker publishes in its heartbeat hash, as placement needs it."""

    worker_id: str
    dedicated: bool
    free_slots: int
    alive: bool = True  # heartbeat fresh and state running


@dataclass(frozen=True)
class Decision:
    move: bool
    to: str | None = None
    reason: str = ""


STAY = Decision(False, None, "affinity")


def place(
    remaining_tokens: int,
    moves: int,
    here: WorkerView,
    others: Iterable[WorkerView],
    step_done_frac: float,
    cfg: PlacementConfig,
) -> Decision:
    """Where the next turn of an episode runs: stay here, or move to one named worker."""
    if here.dedicated or moves >= cfg.max_moves:
        return STAY
    long_tail = remaining_tokens >= cfg.long_tail_tokens
    straggler = step_done_frac >= cfg.straggler_frac
    if not (long_tail or straggler):
        return STAY
    targets = [w for w in others if w.dedicated and w.alive and w.free_slots > 0 and w.worker_id != here.worker_id]
    if not targets:
        return STAY
    best = max(targets, key=lambda w: (w.free_slots, w.worker_id))
    return Decision(True, best.worker_id, "long-tail" if long_tail else "straggler")


def affinity_hit_rate(trajectories: Sequence[dict]) -> float:
    """Fraction of turns (after an episode's first) generated on the previous turn's worker."""
    hits = total = 0
    for t in trajectories:
        ws = [x["worker"] for x in t["turns"]]
        for a, b in zip(ws, ws[1:]):
            total += 1
            hits += a == b
    return hits / total if total else 1.0


def long_tail_on_dedicated(trajectories: Sequence[dict], min_tokens: int) -> float:
    """Of the episodes with ≥ min_tokens of generation, the fraction of their generated
    tokens produced on dedicated workers."""
    on = total = 0
    for t in trajectories:
        gen = sum(len(x["action"]) for x in t["turns"])
        if gen < min_tokens:
            continue
        for x in t["turns"]:
            total += len(x["action"])
            on += len(x["action"]) if x["dedicated"] else 0
    return on / total if total else 1.0
