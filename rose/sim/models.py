"""What the simulated hardware, served model and RL job are: GPU and model presets, the serving
engine's settings and the agentic episode (the episode rate of a GPU running rollout:
rose.sim.rollout_model).

Sources of the presets and the KV arithmetic: docs/simulator.md "The serving model"; the
episode and rollout-rate model: docs/simulator.md "The agentic RL job".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rose.config import GiB

MiB = 1 << 20


@dataclass(frozen=True)
class ModelSize:
    """Shape of a served model, from its `config.json` on the Hugging Face hub (`repo`; field
    names in the comments): what sets weight memory, KV memory and FLOPs. `tp` is the tensor
    parallel degree it is served with (0: `serving_tp` picks it for the GPU)."""

    name: str
    repo: str  # hub repo id whose config.json gives the fields below
    layers: int  # num_hidden_layers
    hidden: int  # hidden_size
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads (GQA)
    intermediate: int  # intermediate_size (SwiGLU MLP: gate, up and down projections)
    vocab: int  # vocab_size
    max_context: int  # max_position_embeddings
    tied_embeddings: bool = False  # tie_word_embeddings
    qkv_bias: bool = False  # q/k/v projections with a bias (Qwen2: "Attention QKV bias", model card)
    tp: int = 0
    bytes_per_param: int = 2  # bf16 (torch_dtype)

    @property
    def head_dim(self) -> int:
        """hidden_size / num_attention_heads (none of the presets sets head_dim apart)."""
        return self.hidden // self.heads

    @property
    def params(self) -> float:
        """Parameters counted from the shape: per layer q/o (hidden²), k/v (hidden × KV width),
        the three MLP projections and two RMSNorms; the embedding and, untied, the LM head."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attn = 2 * h * h + 2 * h * kv + (h + 2 * kv if self.qkv_bias else 0)
        layer = attn + 3 * h * self.intermediate + 2 * h
        emb = self.vocab * h * (1 if self.tied_embeddings else 2)
        return float(self.layers * layer + emb + h)

    @property
    def flop_params(self) -> float:
        """Parameters a token multiplies through (2 FLOPs each): all but the input embedding,
        a table lookup (Kaplan et al. 2020, "Scaling Laws", C_forward ≈ 2N)."""
        return self.params - (0 if self.tied_embeddings else self.vocab * self.hidden)

    @property
    def weight_bytes(self) -> int:
        return int(self.params * self.bytes_per_param)

    @property
    def weight_bytes_per_gpu(self) -> int:
        return self.weight_bytes // max(1, self.tp)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over every layer, the whole model."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    def kv_bytes_per_token_per_gpu(self, tp: int) -> int:
        """What one GPU of a TP group holds per token: its share of the KV heads, or one
        replicated head when tp > kv_heads (vLLM replicates KV heads then)."""
        return 2 * self.layers * max(1, self.kv_heads // tp) * self.head_dim * self.bytes_per_param


# Shapes from each repo's config.json (fields named in ModelSize); parameter counts computed from
# them agree with the model cards' within 1% (tests/test_serving_model.py). Llama-3.1 for 8B and
# 70B, Qwen2.5 (base) for 7B, 14B and 32B: the grouped-query-attention models RL post-training
# starts from. docs/simulator.md "Model sizes" lists them.
MODELS: dict[str, ModelSize] = {
    m.name: m
    for m in (
        ModelSize("7B", "Qwen/Qwen2.5-7B", 28, 3584, 28, 4, 18944, 152064, 131072, qkv_bias=True),
        ModelSize("8B", "meta-llama/Llama-3.1-8B", 32, 4096, 32, 8, 14336, 128256, 131072),
        ModelSize("14B", "Qwen/Qwen2.5-14B", 48, 5120, 40, 8, 13824, 152064, 131072, qkv_bias=True),
        ModelSize("32B", "Qwen/Qwen2.5-32B", 64, 5120, 40, 8, 27648, 152064, 131072, qkv_bias=True),
        ModelSize("70B", "meta-llama/Llama-3.1-70B", 80, 8192, 64, 8, 28672, 128256, 131072),
    )
}
TP_CHOICES = (1, 2, 4, 8)  # within one 8-GPU NVLink node


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
    # pinned host -> device copy: `rose bench weights` in the H200's GPU check measured 55.3 GB/s
    # (docs/measured/h200/weights.json; PCIe Gen5 x16, 64 GB/s a direction on the datasheet);
    # the H100 SXM has the same link
    h2d_bytes_per_s: float = 55.3e9


# NVIDIA datasheets: H100 SXM5 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s dense BF16 (1,979 with
# sparsity); H200 SXM 141 GB HBM3e, 4.8 TB/s, the same 989 TFLOP/s. Memory as NVML reports it
# (the total telemetry carries): 81,559 MiB and 143,771 MiB.
GPUS: dict[str, GpuSpec] = {
    "H100": GpuSpec("H100", 81_559 * MiB, 3.35e12, 989e12),
    "H200": GpuSpec("H200", 143_771 * MiB, 4.8e12, 989e12),
}


# A lease's start: the executor hands it to a warm worker, whose model waits in host memory
# (docs/executor.md "The warm pool"; on CUDA a warm worker does not touch the device), so starting
# is the weights' copy to the GPU. vLLM measured level-1 wake-ups of 0.1-6 s from 0.6B to 235B
# (blog.vllm.ai/2025/10/26/sleep-mode.html); 0.1 s, its smallest model's, is the part that does
# not grow with the weights. A lease that finds no ready warm worker on its node starts cold
# (`cold_start_s`), and a warm worker handed a lease is replaced by one that takes `warm_build_s`
# to be ready.
WAKE_FLOOR_S = 0.1
WAKE_SOURCE = "0.1 s (vLLM sleep-mode blog, 2025-10-26: level-1 wake-ups 0.1-6 s) + weights per GPU / host->device copy rate (55.3 GB/s, docs/measured/h200/weights.json)"
# A throttled lease resuming: `rose bench coelastic --engine hf` on the CPU measured throttle ->
# resume -> next token at p99 46 ms (docs/measured/cpu/coelastic-hf.json); on the GPU the pause
# flag's own path is sub-millisecond (docs/measured/h200/pause.json).
RESUME_S = 0.046
RESUME_SOURCE = "p99 throttle -> resume -> next token, rose bench coelastic --engine hf on CPU (docs/measured/cpu/coelastic-hf.json)"


def wake_s(weight_bytes_per_gpu: int, gpu: GpuSpec) -> float:
    """Seconds from a lease's grant to its worker decoding: a warm worker's weights copied to the GPU."""
    return WAKE_FLOOR_S + weight_bytes_per_gpu / gpu.h2d_bytes_per_s


# A cold start: a new worker process, its imports and engine, then the weights from disk. The
# engine part is what `rose bench coelastic --engine vllm` measured from a cold grant to the first
# token with a 2-layer model on the CPU, p50 17.8 s (docs/measured/cpu/coelastic-vllm.json): no
# weights to speak of, no CUDA graphs and no compilation, so a lower bound for a GPU engine. The
# weights come from local disk at DISK_BYTES_PER_S, an assumption (a local NVMe SSD reads a few
# GB/s; safetensors are read sequentially), swept in `python -m rose.sim.sweep`. With them a cold
# start of 8B takes 26 s and of 70B over 4 GPUs 36 s, the low end of the 30-100+ s per reload the
# vLLM sleep-mode post reports (blog.vllm.ai/2025/10/26/sleep-mode.html).
COLD_ENGINE_S = 17.8
DISK_BYTES_PER_S = 2.0e9
COLD_SOURCE = (
    "17.8 s (vLLM cold grant -> first token p50, CPU, docs/measured/cpu/coelastic-vllm.json) + weights per GPU "
    "/ 2 GB/s from local disk (assumption) + the warm wake-up"
)
# warm workers each executor (one per node of NODE_GPUS GPUs) keeps: ExecutorConfig.warm_workers
NODE_GPUS = 8


def warm_build_s(weight_bytes_per_gpu: int) -> float:
    """Seconds a new warm worker takes to be ready: its process, engine and weights in host memory."""
    return COLD_ENGINE_S + weight_bytes_per_gpu / DISK_BYTES_PER_S


def cold_start_s(weight_bytes_per_gpu: int, gpu: GpuSpec) -> float:
    """Seconds from a lease's grant to its worker decoding when no warm worker is ready: a warm
    worker's build, then its wake-up."""
    return warm_build_s(weight_bytes_per_gpu) + wake_s(weight_bytes_per_gpu, gpu)


# Training one RL step: a forward and a backward pass over every token of its episodes, 6 FLOPs
# a parameter a token (Kaplan et al. 2020, "Scaling Laws for Neural Language Models": C ≈ 6N per
# token), on `train_gpus` GPUs of the run's kind at TRAIN_MFU. 0.40: Llama 3's pre-training on
# H100s ran at 38-43 % BF16 MFU (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4, 405B);
# the same figure is applied to every size (an assumption for the smaller ones, swept). The
# reference model's forward for a KL term (2N a token more) is not charged: the workers return
# the sampling log-probabilities, and the KL term is optional in GRPO-style RL.
TRAIN_MFU = 0.40
TRAIN_SOURCE = (
    "6 N FLOPs a token (Kaplan et al. 2020) over episodes_per_step × ctx_max tokens, at 0.40 MFU "
    "(Llama 3 on H100, 38-43 %, Dubey et al. 2024) on train_gpus GPUs (assumption: as many as the dedicated pool)"
)


def train_step_s(model: ModelSize, ep: EpisodeModel, gpu: GpuSpec, train_gpus: int, mfu: float = TRAIN_MFU) -> float:
    """Seconds one RL step trains: 6 × the model's parameters × the step's tokens (every token of
    `episodes_per_step` episodes at their end context), over `train_gpus` GPUs at `mfu`."""
    tokens = ep.episodes_per_step * ep.ctx_max
    return 6.0 * model.flop_params * tokens / (max(1, train_gpus) * gpu.bf16_flops * mfu)


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


def check_tp(model: ModelSize, tp: int) -> None:
    """ValueError unless `model` can run tensor parallel over `tp` GPUs: one node (at most 8),
    the attention heads split evenly, and the KV heads split or replicated evenly (vLLM's checks)."""
    if tp not in TP_CHOICES:
        raise ValueError(f"tensor parallel {tp} not in {TP_CHOICES} (one 8-GPU node)")
    if model.heads % tp or (model.kv_heads % tp and tp % model.kv_heads):
        raise ValueError(
            f"model {model.name} ({model.heads} heads, {model.kv_heads} KV heads) does not split over tp={tp}"
        )


def serving_tp(model: ModelSize, gpu: GpuSpec, reserve_bytes: int = EngineConfig.runtime_reserve_bytes) -> int:
    """The default serving TP: the fewest GPUs that host the model, i.e. whose KV room after the
    weight shard and the runtime reserve holds one sequence of its full context (vLLM refuses to
    start otherwise; NVIDIA NIM's throughput profiles use the fewest GPUs that host a model)."""
    for tp in TP_CHOICES:
        try:
            check_tp(model, tp)
        except ValueError:
            continue
        room = gpu.mem_bytes - model.weight_bytes // tp - reserve_bytes
        if room >= model.max_context * model.kv_bytes_per_token_per_gpu(tp):
            return tp
    raise ValueError(f"model {model.name} does not fit one node of {gpu.name}")


def deployed(
    model: ModelSize, gpu: GpuSpec, tp: int = 0, reserve_bytes: int = EngineConfig.runtime_reserve_bytes
) -> ModelSize:
    """`model` with its serving TP: `tp`, or (0) the default for `gpu` (`serving_tp`)."""
    tp = tp or model.tp or serving_tp(model, gpu, reserve_bytes)
    check_tp(model, tp)
    return replace(model, tp=tp)


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
        """The context at the episode's end."""
        return self.prompt_tokens + self.turns * (self.gen_tokens + self.obs_tokens)

    @property
    def ctx_mean(self) -> float:
        """The context an episode holds on average over its life: the prompt plus half of what
        its turns add (turns of equal length). With paged KV an episode holds its current
        context, so this is its time-averaged KV."""
        return self.prompt_tokens + self.turns * (self.gen_tokens + self.obs_tokens) / 2
