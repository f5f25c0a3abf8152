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

_erfc = np.frompyfunc(math.erfc, 1, 1)


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
        # an episode's duration at each batch, s; re-prefilling one episode's mean context, s of
        # the replica; one staggered episode's context, standard deviation (its stage uniform)
        self.dur_by_batch = np.array([b / r if r > 0 else 0.0 for b, r in enumerate(self.rate_by_batch * self.tp)])
        self.refill_s = ep.ctx_mean * sim.p_tok
        self.ctx_sd = ep.turns * (ep.gen_tokens + ep.obs_tokens) / math.sqrt(12.0)

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
        """Episodes/s per GPU with `mem_bytes` and compute `share` on each GPU of the replica: the
        batch's rate, each turn of an episode slowed by the KV recompute it expects
        (`overflow`: the chance its context is preempted, times its re-prefill)."""
        b = self.replica_batch(mem_bytes)
        dur = self.dur_by_batch[b]
        extra = self.ep.turns * self.overflow(mem_bytes, b) * self.refill_s
        slow = np.divide(dur, dur + extra, out=np.ones_like(dur, dtype=np.float64), where=dur > 0)
        return self.rate_by_batch[b] * slow * share

    def overflow(self, mem_bytes, b) -> np.ndarray:
        """The chance that B staggered contexts need more KV than the replica's room holds, at a
        turn's end (a normal approximation of their sum, B × ctx_mean ± sqrt(B) × ctx_sd): an
        engine with paged KV then preempts a sequence and recomputes it later (vLLM's recompute
        preemption), re-prefilling its context."""
        room = (np.asarray(mem_bytes, dtype=np.float64) - self.weights - self.reserve) / self.sim.kv
        b = np.asarray(b, dtype=np.float64)
        z = (room - b * self.ep.ctx_mean) / np.maximum(np.sqrt(b) * self.ctx_sd, 1e-9)
        return np.where(b > 0, 0.5 * np.asarray(_erfc(z / math.sqrt(2.0)), dtype=np.float64), 0.0)

    @property
    def reprefill_units(self) -> float:
        """Episode work per GPU one continuation's re-prefill costs the worker that resumes it:
        the replica's seconds re-prefilling its mean context, at the dedicated per-GPU rate × tp
        (the work the replica would have done meanwhile, over its GPUs)."""
        return self.refill_s * self.tp * self.dedicated_rate

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
