"""The `hf` engine: a `RolloutEngine` over a Hugging Face transformers causal LM.

`HFEngine` loads `AutoModelForCausalLM` from a local checkpoint directory (never a download) and
runs it on CPU or CUDA with continuous batching of its own: every sequence keeps its own KV cache
(a transformers `DynamicCache`); each `generate` step first prefills the sequences that have new
tokens (a new prompt, observation tokens after a tool call), one sequence at a time in chunks of
at most `prefill_chunk` tokens, then runs one decode forward for all the sequences that feed a
single token. That decode forward batches caches of different lengths by left-padding them into
one temporary cache, with an attention mask over the padding and each row's own position ids;
the new key/value column is then appended to each sequence's own cache. Models whose cache is not
plain full attention (sliding-window or linear-attention layers) decode one sequence at a time
instead, as does `batch_decode=False`.

`pause_check()` is called before every forward (each prefill chunk, each decode forward); when
it returns True nothing more is launched: what was fed stays fed, the rest stays pending, and the
next `generate` call resumes from there. A forward is never cut short, so `interrupted_tokens`
stays 0.

Sampling is per sequence: a CPU `torch.Generator` reseeded from `GenRequest.seed`, so a
sequence's draws depend only on its seed and its logits, never on what it is batched with.
`last_logprobs` holds, for the tokens the last `generate` returned, each one's float32
log_softmax of logits / temperature at the sampled id.
`load_weights` takes a state dict keyed by the checkpoint's tensor names and copies it into the
model in place (strict; tied embeddings stay tied); `weights_match` says which published tensors
the engine does not hold bit-exactly.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rose.rollout.engine import GenRequest, decode_tokens, tensors_match

# config attributes that hold a model's longest sequence, by architecture family
_MAX_POSITION_ATTRS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


HF_PREFILL_CHUNK = 512  # tokens of one prefill forward unless rollout.step_tokens says otherwise


@dataclass
class _HFSeq:
    seq_id: str
    cache: Any  # transformers DynamicCache
    length: int = 0  # tokens in the cache
    pending: list[int] = field(default_factory=list)  # to feed before the next sample
    logits: torch.Tensor | None = None  # after the last fed token, once pending is empty
    gen: torch.Generator | None = None


class HFEngine:
    """Continuous-batching engine over a transformers causal LM; one instance per worker process.

    `checkpoint_dir`: a local Hugging Face checkpoint (config.json and safetensors).
    `max_batch`: the number of slots (live sequences). `dtype`: "auto" (the checkpoint's),
    a name such as "bfloat16", or a `torch.dtype`. `max_seq`: an optional limit below the
    config's `max_position_embeddings` (None or 0: the config's). `temperature`: 0 is greedy.
    `stream`: on CUDA, the stream every forward runs on. `batch_decode`: one decode forward for
    the batch (True) or one per sequence (False). `prefill_chunk`: the most tokens of one
    sequence fed in one forward (a pause waits for at most one chunk).
    """

    name = "hf"

    def __init__(
        self,
        checkpoint_dir: str | Path,
        max_batch: int = 8,
        device: str = "cpu",
        stream: torch.cuda.Stream | None = None,
        temperature: float = 1.0,
        dtype: str | torch.dtype = "auto",
        max_seq: int | None = None,
        batch_decode: bool = True,
        prefill_chunk: int = HF_PREFILL_CHUNK,
    ):
        from transformers import AutoModelForCausalLM, DynamicCache
        from transformers.cache_utils import DynamicLayer

        if max_batch < 1:
            raise ValueError(f"max_batch {max_batch}: expected at least 1")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk {prefill_chunk}: expected at least 1")
        self.checkpoint_dir = Path(checkpoint_dir)
        if not (self.checkpoint_dir / "config.json").is_file():
            raise FileNotFoundError(f"{self.checkpoint_dir}: not a Hugging Face checkpoint (no config.json)")
        self.device = torch.device(device)
        self.stream = stream
        self.temperature = temperature
        self.prefill_chunk = prefill_chunk
        if isinstance(dtype, str) and dtype != "auto":
            named = getattr(torch, dtype, None)
            if not isinstance(named, torch.dtype):
                raise ValueError(f"dtype {dtype!r}: expected 'auto' or a torch dtype name such as 'bfloat16'")
            dtype = named
        model: Any = AutoModelForCausalLM.from_pretrained(self.checkpoint_dir, dtype=dtype, local_files_only=True)
        self.model: Any = model.to(self.device).eval()
        self.config = self.model.config
        text_config = self.config.get_text_config(decoder=True)

        limit = next((getattr(text_config, a) for a in _MAX_POSITION_ATTRS if getattr(text_config, a, None)), None)
        limits = [int(x) for x in (limit, max_seq) if x]  # max_seq None or 0: the config's
        if not limits:
            raise ValueError(f"{self.checkpoint_dir}: the config names no maximum length; pass max_seq")
        self.max_seq: int = min(limits)
        out_emb = self.model.get_output_embeddings()
        self.vocab_size: int = int(out_emb.weight.shape[0] if out_emb is not None else text_config.vocab_size)

        self._new_cache: Callable[[], Any] = lambda: DynamicCache(config=self.config)
        self._cache_from: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], Any] = DynamicCache
        probe = self._new_cache()
        # left-padded batched decode needs every layer to be a plain growing full-attention cache
        self.batch_decode = batch_decode and all(type(layer) is DynamicLayer for layer in probe.layers)
        self._keep_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters

        self.n_slots = max_batch
        self.max_batch = max_batch
        self.version = -1
        self._seqs: dict[str, _HFSeq] = {}
        self.steps = 0
        self.interrupted_tokens = 0  # a forward is never cut short (see the module docstring)
        self.last_logprobs: list[list[float]] = []  # of the tokens the last `generate` returned

    # description -----------------------------------------------------------------------
    def describe(self) -> dict:
        import transformers

        return {"name": self.name, "version": transformers.__version__, "device": str(self.device)}

    # weights ---------------------------------------------------------------------------
    def load_weights(self, version: int, state_dict: dict) -> None:
        """Copy `state_dict` (checkpoint tensor names) into the model in place, each tensor cast
        to its parameter's dtype; strict: an unknown name or a wrong shape raises ValueError and
        changes nothing. An empty dict keeps the current weights and sets the version."""
        params = self.model.state_dict(keep_vars=True)
        owner: dict[int, str] = {}  # tied tensors (lm_head -> embed_tokens) share one parameter
        for name, t in state_dict.items():
            p = params.get(name)
            if p is None:
                raise ValueError(f"load_weights: tensor {name!r} is not a parameter of the model")
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"load_weights: tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"load_weights: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
            other = owner.setdefault(id(p), name)
            if other != name and not torch.equal(t.to(p.dtype), state_dict[other].to(p.dtype)):
                raise ValueError(f"load_weights: tensor {name!r} is tied to {other!r} but their values differ")
        with self._on_stream(), torch.no_grad():
            for name, t in state_dict.items():
                params[name].copy_(t)  # copy_ casts to the parameter's dtype and device
        self.version = version

    def weights_match(self, state_dict: dict) -> list[str]:
        """The published tensors this engine does not hold bit-exactly (`weights_match`)."""
        return weights_match(self, state_dict)

    # sequences -------------------------------------------------------------------------
    def free_slots(self) -> int:
        return self.n_slots - len(self._seqs)

    def length(self, seq_id: str) -> int:
        s = self._seqs.get(seq_id)
        return 0 if s is None else s.length + len(s.pending)

    def release(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)

    def _admit(self, requests: Sequence[GenRequest]) -> list[_HFSeq]:
        """The requests' sequences, new ones started, tokens appended; checks every request
        first, so a ValueError or a full engine changes nothing."""
        new = {r.seq_id for r in requests if r.seq_id not in self._seqs}
        if len(new) > self.free_slots():
            raise RuntimeError(f"no free slot for {len(new)} new sequences: check free_slots() before admitting")
        added: dict[str, int] = {}
        for r in requests:
            added[r.seq_id] = added.get(r.seq_id, 0) + len(r.tokens)
        for sid, n in added.items():
            total = self.length(sid) + n
            if total > self.max_seq:
                raise ValueError(f"sequence {sid}: {total} tokens > max_seq {self.max_seq}")
        seqs = []
        for r in requests:
            s = self._seqs.get(r.seq_id)
            if s is None:
                s = self._seqs[r.seq_id] = _HFSeq(r.seq_id, self._new_cache())
            if r.seed is not None:
                s.gen = torch.Generator().manual_seed(r.seed)
            if s.gen is None:
                s.gen = torch.Generator().manual_seed(0)
            s.pending.extend(r.tokens)
            seqs.append(s)
        return seqs

    # generation ------------------------------------------------------------------------
    def _on_stream(self) -> AbstractContextManager:
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def generate(
        self, requests: Sequence[GenRequest], max_new_tokens: int, pause_check: Callable[[], bool] = lambda: False
    ) -> list[list[int]]:
        seqs = self._admit(requests)
        with self._on_stream(), torch.inference_mode():
            # paused before a forward: the rest stays pending
            out, self.last_logprobs = decode_tokens(
                seqs, max_new_tokens, lambda: self._step(seqs, pause_check), self.temperature, self._count_step
            )
            return out

    def _count_step(self) -> None:
        self.steps += 1

    def _step(self, seqs: list[_HFSeq], pause_check: Callable[[], bool]) -> list[torch.Tensor] | None:
        """Feed every sequence's pending tokens; each one's last logits, or None when
        pause_check turned true before a forward (what was fed stays fed)."""
        for s in seqs:
            if not s.pending and s.logits is None:
                raise ValueError("a sequence with nothing to feed: give a prompt first")
            if s.pending and s.length + len(s.pending) > self.max_seq:
                # the token sampled last would sit past the model's last position
                raise ValueError(f"sequence {s.seq_id}: {s.length + len(s.pending)} tokens > max_seq {self.max_seq}")
        # prefill / extension: new sequences and those with more than one new token
        for s in seqs:
            if (len(s.pending) > 1 or (s.pending and s.length == 0)) and not self._prefill(s, pause_check):
                return None
        decode = [s for s in seqs if s.pending]
        if decode:
            if self.batch_decode and len(decode) > 1:
                if pause_check():
                    return None
                self._decode_batch(decode)
            else:
                for s in decode:
                    if pause_check():
                        return None
                    self._feed(s, s.pending)
                    s.pending.clear()
        out: list[torch.Tensor] = []
        for s in seqs:
            assert s.logits is not None  # fed above, or kept from its last feed (checked on entry)
            out.append(s.logits)
        for s in seqs:
            s.logits = None
        return out

    def _forward(self, ids: torch.Tensor, cache: Any, **kw: Any) -> torch.Tensor:
        """Last-position logits [batch, vocab] of one forward that appends `ids` to `cache`."""
        if self._keep_logits:
            kw["logits_to_keep"] = 1
        res = self.model(input_ids=ids, past_key_values=cache, use_cache=True, **kw)
        last = res.logits[:, -1]
        return last if self._keep_logits else last.clone()  # a view would keep every position's logits

    def _feed(self, s: _HFSeq, toks: list[int]) -> None:
        ids = torch.tensor([toks], dtype=torch.long, device=self.device)
        s.logits = self._forward(ids, s.cache)[0]
        s.length += len(toks)

    def _prefill(self, s: _HFSeq, pause_check: Callable[[], bool]) -> bool:
        """Feed s.pending in chunks of `prefill_chunk` tokens; False if paused before the end."""
        while s.pending:
            if pause_check():
                return False
            n = min(len(s.pending), self.prefill_chunk)
            self._feed(s, s.pending[:n])
            del s.pending[:n]
        return True

    def _decode_batch(self, part: list[_HFSeq]) -> None:
        """One forward for sequences that each feed one token on top of a non-empty cache:
        their caches left-padded to the longest into one temporary cache, padding masked out,
        each row at its own position; the new key/value column goes back to each own cache."""
        longest = max(s.length for s in part)
        n_layers = len(part[0].cache.layers)
        data = []
        for li in range(n_layers):
            ks, vs = [], []
            for s in part:
                layer = s.cache.layers[li]
                pad = longest - s.length
                ks.append(F.pad(layer.keys, (0, 0, pad, 0)) if pad else layer.keys)
                vs.append(F.pad(layer.values, (0, 0, pad, 0)) if pad else layer.values)
            data.append((torch.cat(ks), torch.cat(vs)))
        cache = self._cache_from(data)
        mask = torch.ones(len(part), longest + 1, dtype=torch.long)
        for i, s in enumerate(part):
            mask[i, : longest - s.length] = 0
        ids = torch.tensor([s.pending for s in part], dtype=torch.long, device=self.device)
        pos = torch.tensor([[s.length] for s in part], dtype=torch.long, device=self.device)
        logits = self._forward(ids, cache, attention_mask=mask.to(self.device), position_ids=pos)
        for li, layer in enumerate(cache.layers):
            k_new, v_new = layer.keys[:, :, longest:], layer.values[:, :, longest:]
            for i, s in enumerate(part):
                s.cache.layers[li].update(k_new[i : i + 1], v_new[i : i + 1])
        for i, s in enumerate(part):
            s.logits = logits[i]
            s.length += 1
            s.pending.clear()


def weights_match(engine: HFEngine, state_dict: dict) -> list[str]:
    """Names of the published tensors the engine does not hold bit-exactly (`tensors_match`); an
    empty list means the engine runs exactly the published weights."""
    return tensors_match(engine.model.state_dict(), state_dict)
