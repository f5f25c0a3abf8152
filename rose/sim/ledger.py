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


def trainer_rate(episodes_per_step: int, train_step_s: float) -> float:
    """The most episodes a second the trainer consumes: a step's episodes per step's training
    (inf when training is free, `train_step_s` 0). The bound on every policy's RL throughput."""
    return math.inf if train_step_s <= 0.0 else episodes_per_step / train_step_s


class Ledger:
    """Episode work of one policy: produced = completed + in flight + parked + recomputed."""

    def __init__(self, ep: EpisodeModel, reprefill_units: float = 0.0, train_step_s: float = 0.0):
        self.ep = ep
        self.train_step_s = train_step_s  # one RL step's training, s (0: the trainer keeps up with anything)
        self.trained = 0.0  # completed episodes the trainer has consumed (fluid)
        self.reprefill_units = reprefill_units  # work one continuation's re-prefill costs (RolloutModel)
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
        """Slots ending: their episodes go back as continuations with the tokens generated so far,
        losing the decode step in flight (one token of the `turns * gen_tokens` an episode
        generates, per running episode) and the re-prefill of each continuation's context by the
        worker that resumes it (`reprefill_units` each; min(batch, 2 w) episodes, as staggered
        episodes are half done on average); never more than the slot held."""
        episodes = np.minimum(batch, 2.0 * w)
        lost = np.minimum(w, batch / float(self.ep.turns * self.ep.gen_tokens) + episodes * self.reprefill_units)
        self.recomputed += float(lost.sum())
        self.parked += float((w - lost).sum())
        w[...] = 0.0

    def unpark(self, limit: float = math.inf) -> float:
        take = float(min(self.parked, limit))  # a numpy limit must not turn the tally into numpy
        self.parked -= take
        return take

    def train(self, dt: float) -> None:
        """The trainer over `dt` s, beside rollout (the trainer's loop steps on what has arrived
        while the workers keep rolling out: docs/simulator.md "Training"): it consumes completed
        episodes at most at `episodes_per_step / train_step_s` a second."""
        rate = trainer_rate(self.ep.episodes_per_step, self.train_step_s)
        if math.isinf(rate):
            self.trained = float(self.completed)
        else:
            self.trained = min(float(self.completed), self.trained + dt * rate)

    def steps(self) -> int:
        """RL steps trained."""
        return int(self.trained + 1e-9) // self.ep.episodes_per_step
