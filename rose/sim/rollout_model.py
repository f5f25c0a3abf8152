"""The episode rate of a GPU running rollout (`RolloutModel`), from the serving roofline
(rose.sim.serving_model) at the rollout's tensor parallel and the agentic episode
(rose.sim.models.EpisodeModel).

The model: docs/simulator.md "The agentic RL job".
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from rose.sim.models import EpisodeModel
from rose.sim.serving_model import ServingSim


class RolloutModel:
    """Episode rate of a GPU running rollout, from the serving roofline at the rollout's TP.

    A rollout replica spans `tp` GPUs (gang leases when tp > 1) and runs B concurrent episodes
    with paged KV (docs/simulator.md "The agentic RL job"). Batches are the replica's; rates and
    `batch_for` are per GPU (the replica's over tp), so pools and leases compare GPU for GPU."""

    def __init__(self, sim: ServingSim, ep: EpisodeModel, reserve_bytes: int, tp: int = 0):
        self.tp = tp or sim.tp
        if self.tp != sim.tp:  # the RL policy sharded otherwise than the served model
            sim = ServingSim(sim.gpu, replace(sim.model, tp=self.tp), self.tp, engine=sim.engine)
        self.ep, self.sim = ep, sim
        self.weights = sim.model.weight_bytes_per_gpu
        self.reserve = reserve_bytes
        self.kv_episode = ep.ctx_mean * sim.kv  # per GPU of the replica, time-averaged (paged)
        self.kv_growth = (ep.ctx_max - ep.ctx_mean) * sim.kv  # one episode at its end, over the mean
        self.max_batch = ep.batch * self.tp
        self.rate_by_batch = np.array([self._rate(b) for b in range(self.max_batch + 1)]) / self.tp

    def _rate(self, b: int) -> float:
        """Episodes/s of a replica running b episodes."""
        if b <= 0:
            return 0.0
        ep, sim = self.ep, self.sim
        prefill = (ep.prompt_tokens / ep.turns + ep.obs_tokens) * sim.p_tok
        f = 0.5
        for _ in range(30):  # fixed point of the share of episodes decoding
            bd = max(1.0, b * f)
            step = float(sim.step_time(np.array([bd]), np.array([bd * ep.ctx_mean]))[0])
            dec = ep.gen_tokens * step
            f = (dec + prefill) / (dec + prefill + ep.tool_s)
        return b / (ep.turns * (prefill + dec + ep.tool_s))

    def replica_batch(self, mem_bytes):
        """Concurrent episodes of a replica whose GPUs each have `mem_bytes` (0: cannot run
        rollout): B - 1 episodes at their mean context and one at its end fit beside the weights."""
        room = np.asarray(mem_bytes, dtype=np.float64) - self.weights - self.reserve - self.kv_growth
        return np.clip(np.floor(room / self.kv_episode), 0, self.max_batch).astype(np.int64)

    def batch_for(self, mem_bytes):
        """Episodes per GPU (the replica's over tp) that fit `mem_bytes` on each of its GPUs."""
        return self.replica_batch(mem_bytes) / self.tp

    def rate(self, mem_bytes, share=1.0):
        """Episodes/s per GPU with `mem_bytes` and compute `share` on each GPU of the replica."""
        return self.rate_by_batch[self.replica_batch(mem_bytes)] * share

    @property
    def min_lease_bytes(self) -> int:
        """The smallest memory per GPU that runs rollout: the weight shard, the reserve and one
        episode at its end."""
        return int(math.ceil(self.weights + self.reserve + self.kv_growth + self.kv_episode))

    @property
    def dedicated_batch(self) -> float:
        return float(self.batch_for(self.sim.gpu.mem_bytes))

    @property
    def dedicated_rate(self) -> float:
        return float(self.rate(self.sim.gpu.mem_bytes))
