"""Where a worker gets its policy: `current() -> (version, state_dict)`.

The weight engine's follower (`rose.weights`, `WeightFollower.current()` / `poll()`)
satisfies this protocol; a version it returns is complete (all shards committed), and the
worker loads it between two decode steps, so no step runs on a half-updated policy.
`StaticWeights` is a fixed policy (version 0): the seeded reference policy, or a checkpoint's
own weights (an empty state dict: the engine keeps what it loaded); `FollowedWeights` wraps the
follower, starting from that policy, as version 0 too, until the trainer's first version (the
publisher numbers from 1) commits: a task's default `min_version` 0 is met before it. `current()`
may build a full state dict, so the worker calls it only when `poll()` reports a new version.
"""

from __future__ import annotations

from typing import Protocol


class WeightSource(Protocol):
    def poll(self) -> int | None:
        """Take in what has arrived; the newest version that became visible, or None."""

    def current(self) -> tuple[int | None, dict]:
        """The visible version and its full state dict (None before the first commit)."""

    def newest(self) -> int | None:
        """The newest version committed at the source (applied or not), None before the first:
        a worker takes tasks only while its policy is within `max_staleness` of it."""


class StaticWeights:
    """A fixed policy: `initial` (the seeded reference weights, or {} for a checkpoint engine,
    which keeps the weights it loaded) as `version`."""

    def __init__(self, initial: dict, version: int = 0):
        self._v = version
        self._sd = initial
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
    """The weight engine's `WeightFollower`, starting from `initial` (version 0, as a static
    policy is) until the trainer's first version commits."""

    def __init__(self, follower, initial: dict):
        self.follower = follower
        self._initial = initial

    def poll(self) -> int | None:
        return self.follower.poll()

    def current(self) -> tuple[int, dict]:
        v, sd = self.follower.current()
        return (0, self._initial) if v is None else (v, sd)

    def newest(self) -> int | None:
        return self.follower.newest()
