"""What the simulated hardware, served model and RL job are: GPU and model presets, the serving
engine's settings, the agentic episode and the episode rate of a GPU running rollout.

Sources of the presets and the KV arithmetic: docs/simulator.md "The serving model"; the
episode and rollout-rate model: docs/simulator.md "The agentic RL job".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rose.config import GiB

if TYPE_CHECKING:
    from rose.sim.serving_model import ServingSim

MiB = 1 << 20


@dataclass(frozen=True)
class ModelSize:
    """Shape of a served model: what sets weight memory, KV memory and FLOPs."""

    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    tp: int = 1  # GPUs per replica (tensor parallel)
    bytes_per_param: int = 2  # bf16

    @property
    def weight_bytes(self) -> int:
        return int(self.params * self.bytes_per_param)

    @property
    def weight_bytes_per_gpu(self) -> int:
        return self.weight_bytes // self.tp

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param


MODELS: dict[str, ModelSize] = {
    "7B": ModelSize("7B", 6.74e9, layers=32, kv_heads=32, head_dim=128),  # Llama-2-7B
    "14B": ModelSize("14B", 14.17e9, layers=40, kv_heads=40, head_dim=128),  # Qwen-14B
    "32B": ModelSize("32B", 32.76e9, layers=64, kv_heads=8, head_dim=128),  # Qwen2.5-32B
    "70B": ModelSize("70B", 68.98e9, layers=80, kv_heads=8, head_dim=128, tp=2),  # Llama-2-70B
}


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator: memory, peak rates and the fractions of them an engine achieves."""

    name: str
    mem_bytes: int
    hbm_bytes_per_s: float
    bf16_flops: float
    bw_efficiency: float = 0.75
    prefill_mfu: float = 0.45
    decode_mfu: float = 0.45
    allreduce_s: float = 10e-6  # one small NVLink all-reduce (per layer, twice per iteration, tp > 1)


GPUS: dict[str, GpuSpec] = {
    "H100": GpuSpec("H100", 81_559 * MiB, 3.35e12, 989e12),
    "H200": GpuSpec("H200", 143_771 * MiB, 4.8e12, 989e12),
}


@dataclass(frozen=True)
class EngineConfig:
    """The serving engine's scheduler settings (vLLM names in comments)."""

    max_slots: int = 256  # max_num_seqs
    chunk_tokens: int = 2048  # max_num_batched_tokens with chunked prefill (latency setting)
    step_overhead_s: float = 0.002  # scheduling, sampling, launch per iteration
    runtime_reserve_bytes: int = 2 * GiB  # CUDA context, activations, graphs


def model_size(name: str) -> ModelSize:
    """A preset by name ('7B', '14b', ...); ValueError naming the choices otherwise."""
    m = MODELS.get(name.upper())
    if m is None:
        raise ValueError(f"unknown model size {name!r} (known: {', '.join(MODELS)})")
    return m


def gpu_spec(name: str) -> GpuSpec:
    g = GPUS.get(name.upper())
    if g is None:
        raise ValueError(f"unknown GPU {name!r} (known: {', '.join(GPUS)})")
    return g


@dataclass(frozen=True)
class EpisodeModel:
    """One agentic episode (ReAct-style tool use) and the RL step that consumes them."""

    turns: int = 8
    prompt_tokens: int = 1024  # task + system prompt, prefilled once
    gen_tokens: int = 256  # generated per turn (thought + action)
    obs_tokens: int = 384  # tool observation appended per turn, prefilled
    tool_s: float = 2.0  # tool latency per turn (code run, search, API)
    batch: int = 64  # concurrent episodes a dedicated rollout GPU runs at most
    episodes_per_step: int = 256  # e.g. 32 tasks × 8 samples (GRPO group)

    @property
    def ctx_max(self) -> int:
        return self.prompt_tokens + self.turns * (self.gen_tokens + self.obs_tokens)


class RolloutModel:
    """Episode rate of one GPU running B concurrent episodes, from the serving roofline."""

    def __init__(self, sim: ServingSim, ep: EpisodeModel, reserve_bytes: int):
        self.ep, self.sim = ep, sim
        self.weights = sim.model.weight_bytes_per_gpu
        self.reserve = reserve_bytes
        self.kv_episode = ep.ctx_max * sim.kv
        self.rate_by_batch = np.array([self._rate(b) for b in range(ep.batch + 1)])

    def _rate(self, b: int) -> float:
        if b <= 0:
            return 0.0
        ep, sim = self.ep, self.sim
        prefill = (ep.prompt_tokens / ep.turns + ep.obs_tokens) * sim.p_tok
        ctx_avg = ep.prompt_tokens + ep.turns * (ep.gen_tokens + ep.obs_tokens) / 2
        f = 0.5
        for _ in range(30):  # fixed point of the share of episodes decoding
            bd = max(1.0, b * f)
            step = float(sim.step_time(np.array([bd]), np.array([bd * ctx_avg]))[0])
            dec = ep.gen_tokens * step
            f = (dec + prefill) / (dec + prefill + ep.tool_s)
        return b / (ep.turns * (prefill + dec + ep.tool_s))

    def batch_for(self, mem_bytes):
        """Concurrent episodes that fit `mem_bytes` (0: cannot run rollout)."""
        room = np.asarray(mem_bytes, dtype=np.float64) - self.weights - self.reserve
        return np.clip(np.floor(room / self.kv_episode), 0, self.ep.batch).astype(np.int64)

    def rate(self, mem_bytes, share=1.0):
        return self.rate_by_batch[self.batch_for(mem_bytes)] * share

    @property
    def dedicated_batch(self) -> int:
        return int(self.batch_for(self.sim.gpu.mem_bytes))

    @property
    def dedicated_rate(self) -> float:
        return float(self.rate(self.sim.gpu.mem_bytes))
