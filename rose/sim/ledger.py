"""Episode work of one policy, as a fluid and exact ledger: a slot (the dedicated pool, an
external GPU, a lease) holds in-flight work in episode units; a slot that ends parks its
episodes as continuations, which carry every token generated so far (v1.1), losing at most the
decode step in flight. At every window
``produced = completed + in flight + parked + recomputed``, and ``completed = consumed by the
trainer + buffered`` (docs/simulator.md "Work ledger").
"""

from __future__ import annotations

import math

import numpy as np

from rose.sim.models import EpisodeModel


class Ledger:
    """Episode work of one policy: produced = completed + in flight + parked + recomputed."""

    def __init__(self, ep: EpisodeModel):
        self.ep = ep
        self.produced = 0.0
        self.completed = 0
        self.parked = 0.0
        self.recomputed = 0.0

    def progress(self, w: np.ndarray, fill: np.ndarray, gain: np.ndarray) -> None:
        """Add `gain` to slots with in-flight work `w` (in place) and complete whole episodes."""
        self.produced += float(gain.sum())
        w += gain
        done = np.floor(np.maximum(0.0, w - fill))
        w -= done
        self.completed += int(done.sum())

    def park(self, w: np.ndarray, batch: np.ndarray) -> None:
        """Slots ending: their episodes go back as continuations with the tokens generated so far
        (the next slot re-prefills them), losing at most the decode step in flight: one token
        of the `turns * gen_tokens` an episode generates, per running episode."""
        lost = np.minimum(w, batch / float(self.ep.turns * self.ep.gen_tokens))
        self.recomputed += float(lost.sum())
        self.parked += float((w - lost).sum())
        w[...] = 0.0

    def unpark(self, limit: float = math.inf) -> float:
        take = min(self.parked, limit)
        self.parked -= take
        return take

    def steps(self) -> int:
        return self.completed // self.ep.episodes_per_step
