"""Elastic placement of agentic turns (the elastic rollout scheduler), as a pure policy.

Routing is per TURN, not per episode: after every turn, while the tool call runs, the worker
holding the episode decides where the next turn goes. By default it stays (cache affinity: no
re-prefill); an episode with a long tail still to generate, or every episode once the RL step is
nearly complete (stragglers), moves from a leased (revocable) worker to the live dedicated
worker with the most free slots, at most `max_moves` times. Dedicated workers never move work
away. The rules in order, and how `affinity_hit_rate` and `long_tail_on_dedicated` measure
them: docs/rollout.md.
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
class Placement:
    """Where an episode's next turn runs: here (`move` False), or on worker `to`, and why."""

    move: bool
    to: str | None = None
    reason: str = ""


STAY = Placement(False, None, "affinity")


def place(
    remaining_tokens: int,
    moves: int,
    here: WorkerView,
    others: Iterable[WorkerView],
    step_done_frac: float,
    cfg: PlacementConfig,
) -> Placement:
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
    return Placement(True, best.worker_id, "long-tail" if long_tail else "straggler")


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
