"""Where a worker gets its policy: `current() -> (version, state_dict)`.

The weight engine's follower (`rose.weights`, `WeightFollower.current()` / `poll()`)
satisfies this protocol; a version it returns is complete (all shards committed), and the
worker loads it between two decode steps, so no step runs on a half-updated policy.
`StaticWeights` is the seeded initial policy (version 0), for runs without a trainer;
`FollowedWeights` wraps the follower. `current()` may build a full state dict, so the
worker calls it only when `poll()` reports a new version.
"""

from __future__ import annotations

from typing import Protocol

from rose.rollout.policy_model import ModelSpec, init_state_dict


class WeightSource(Protocol):
    def poll(self) -> int | None:
        """Take in what has arrived; the newest version that became visible, or None."""

    def current(self) -> tuple[int | None, dict]:
        """The visible version and its full state dict (None before the first commit)."""

    def newest(self) -> int | None:
        """The newest version committed at the source (applied or not), None before the first:
        a worker takes tasks only while its policy is within `max_staleness` of it."""


class StaticWeights:
    def __init__(self, spec: ModelSpec, seed: int, version: int = 0):
        self._v = version
        self._sd = init_state_dict(spec, seed)
        self._new: int | None = None

    def poll(self) -> int | None:
        v, self._new = self._new, None
        return v

    def current(self) -> tuple[int, dict]:
        return self._v, self._sd

    def newest(self) -> int | None:
        return self._v

    def publish(self, version: int, state_dict: dict) -> None:
        """Swap in a complete new version (tests and in-process trainers)."""
        self._v, self._sd, self._new = version, state_dict, version


class FollowedWeights:
    """The weight engine's `WeightFollower`, starting from the seeded policy (version -1)
    until the trainer's first version commits."""

    def __init__(self, follower, spec: ModelSpec, seed: int):
        self.follower = follower
        self._seeded = init_state_dict(spec, seed)

    def poll(self) -> int | None:
        return self.follower.poll()

    def current(self) -> tuple[int, dict]:
        v, sd = self.follower.current()
        return (-1, self._seeded) if v is None else (v, sd)

    def newest(self) -> int | None:
        return self.follower.newest()
