"""Rollout engines behind `rose.rollout.engine.RolloutEngine`, one module per engine:
`vllm_engine` (vLLM's V1 engine core, stepped in the worker's thread), `hf_engine` (Hugging Face
transformers), and the reference toy engine (`rose.rollout.engine.TorchEngine`, a test double).
`build_engine` picks one from a worker's configuration; docs/engines.md says how each maps the
lease's commands (pause, resume, revoke, weights) onto its engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rose.rollout.engine import RolloutEngine
    from rose.rollout.launcher import WorkerConfig
    from rose.rollout.policy_model import ModelSpec


def build_engine(config: WorkerConfig, device: str, mem_bytes: int, stream=None) -> RolloutEngine:
    """The engine `config.engine` names, on `device` within `mem_bytes` (0: a warm engine that
    has no lease yet). Raises rose.rollout.engine.BudgetError when the budget cannot hold the
    model and one sequence, ValueError naming what is wrong with the configuration, ImportError
    when the engine's library is not installed."""
    from rose.rollout.compute_dtype import resolve_dtype

    dtype = resolve_dtype(config.dtype, device)
    if config.engine == "vllm":
        from rose.rollout.engines.vllm_engine import CUDA_ACTIVATION_MARGIN, VllmEngine, checkpoint_bytes

        kv = config.kv_cache_bytes
        if device != "cpu" and mem_bytes:  # the lease's memory, less weights and activations, is KV
            kv = mem_bytes - checkpoint_bytes(config.checkpoint) - CUDA_ACTIVATION_MARGIN
            if kv <= 0:
                from rose.rollout.engine import BudgetError

                raise BudgetError(f"mem_bytes {mem_bytes} cannot hold {config.checkpoint} and a KV cache")
        return VllmEngine(
            config.checkpoint,
            max_batch=config.max_batch,
            max_model_len=config.max_model_len,
            dtype=dtype,
            device=device,
            kv_cache_bytes=kv,
            threads=config.threads,
            temperature=config.temperature,
            seed=config.seed,
            step_tokens=config.step_tokens,
        )
    if config.engine == "hf":
        from rose.rollout.engines.hf_engine import HF_PREFILL_CHUNK, HFEngine

        return HFEngine(
            config.checkpoint,
            max_batch=config.max_batch,
            max_seq=config.max_model_len,
            dtype=dtype,
            device=device,
            stream=stream,
            temperature=config.temperature,
            prefill_chunk=config.step_tokens or HF_PREFILL_CHUNK,
        )
    from rose.rollout.engine import MemoryBudget, TorchEngine

    spec = reference_spec(config)
    return TorchEngine(
        spec,
        MemoryBudget(mem_bytes, spec),
        max_batch=config.max_batch,
        device=device,
        stream=stream,
        temperature=config.temperature,
    )


def initial_weights(config: WorkerConfig) -> dict:
    """The policy before the trainer's first version: the seeded reference weights, or {} for a
    checkpoint engine (it keeps the checkpoint's weights)."""
    if config.engine != "reference":
        return {}
    from rose.rollout.policy_model import init_state_dict

    return init_state_dict(reference_spec(config), config.seed)


def reference_spec(config: WorkerConfig) -> ModelSpec:
    """The reference engine's model shape from `config.model_spec`; ValueError names the key."""
    from rose.rollout.policy_model import ModelSpec

    try:
        return ModelSpec(**config.model_spec)
    except (TypeError, ValueError) as e:
        raise ValueError(f"model_spec: {e}") from None
