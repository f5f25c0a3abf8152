"""Where a worker gets its policy: `current() -> (version, state_dict)`.

The weight engine's follower (`rose.weights`, `WeightFollower.current()` / `poll()`)
satisfies this protocol; a version it returns is complete (all shards committed), and the
worker loads it between two decode steps, so no step runs on a half-updated policy.
`StaticWeights` is the seeded initial policy (version 0), for runs without a trainer.
"""

from __future__ import annotations

from typing import Protocol

from rose.rollout.policy_model import ModelSpec, init_state_dict


class WeightSource(Protocol):
    def current(self) -> tuple[int, dict]: ...


class StaticWeights:
    def __init__(self, spec: ModelSpec, seed: int, version: int = 0):
        self._v = version
        self._sd = init_state_dict(spec, seed)

    def poll(self) -> bool:
        return False

    def current(self) -> tuple[int, dict]:
        return self._v, self._sd

    def publish(self, version: int, state_dict: dict) -> None:
        """Swap in a complete new version (tests and in-process trainers)."""
        self._v, self._sd = version, state_dict
