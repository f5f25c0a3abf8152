"""The rollout engine interface, and the torch engine that runs the reference policy.

`RolloutEngine` is what a worker needs from an inference engine, and nothing more; vLLM or
SGLang plug in behind the same methods (how: docs/rollout.md). The torch engine also enforces
the worker's memory budget (`MemoryBudget`): the slot count comes from it, and every forward is
sized so that its activations fit what is left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rose.rollout.policy_model import ModelSpec, PolicyModel


@dataclass
class GenRequest:
    seq_id: str
    tokens: list[int] = field(default_factory=list)  # appended to the sequence before sampling
    seed: int | None = None  # reseeds the sequence's sampler (set at the start of a turn)


class RolloutEngine(Protocol):
    """What a worker needs from an inference engine.

    - `generate(requests, max_new_tokens, pause_check) -> list[list[int]]`: for each request,
      append `request.tokens` to the sequence `request.seq_id` (a new id starts a sequence; the
      engine keeps its cache), then sample up to `max_new_tokens` tokens. `pause_check()` is
      called before every decode step; when it returns True the engine launches nothing more
      and returns what it has (possibly fewer tokens). Called with `max_new_tokens=1` on every
      loop iteration it gives continuous batching: sequences join and leave between steps.
    - `release(seq_id)` drops a sequence's cache; `free_slots()` says how many more fit.
    - `load_weights(version, state_dict)` swaps the policy between two `generate` calls; the
      engine is single-threaded, so no step ever runs on a half-updated policy. The state dict
      is keyed by the checkpoint's tensor names; an empty one keeps the weights (a new version
      number only). `weights_match(state_dict)` names the published tensors the engine does not
      hold bit-exactly (empty: it runs exactly what was published).
    - `n_slots` sequences at most, each up to `max_seq` tokens of ids below `vocab_size`;
      `interrupted_tokens` counts decode work a pause threw away; `describe()` says
      `{name, version, device}` (the library's version, not the policy's).
    - `last_logprobs`: after each `generate` call, parallel to what it returned, the
      log-probability of each sampled token under the distribution it was sampled from (the
      logits divided by the temperature; at temperature 0, greedy, the untempered logits), as a
      float. An attribute beside the returned tokens rather than a new return type, so every
      caller of `generate` that needs only the ids keeps working unchanged.
    """

    version: int
    n_slots: int
    interrupted_tokens: int
    last_logprobs: list[list[float]]

    @property
    def max_seq(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def describe(self) -> dict: ...

    def generate(
        self, requests: Sequence[GenRequest], max_new_tokens: int, pause_check: Callable[[], bool] = lambda: False
    ) -> list[list[int]]: ...

    def release(self, seq_id: str) -> None: ...

    def free_slots(self) -> int: ...

    def load_weights(self, version: int, state_dict: dict) -> None: ...

    def weights_match(self, state_dict: dict) -> list[str]: ...


class BudgetError(RuntimeError):
    """The memory budget cannot hold the model plus one sequence."""


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes the rollout side may hold, split into model, KV cache and activations.

    Pure arithmetic on the model's shape: the CPU budget is enforced by never allocating
    more than this estimate allows; on CUDA the allocator's per-process fraction backs it.
    """

    limit_bytes: int
    spec: ModelSpec
    dtype_bytes: int = 4

    @property
    def model_bytes(self) -> int:
        return self.spec.param_count() * self.dtype_bytes

    @property
    def kv_bytes_per_slot(self) -> int:
        s = self.spec
        return 2 * s.n_layers * s.max_seq * s.d_model * self.dtype_bytes

    def activation_bytes(self, batch: int, new_tokens: int, ctx: int) -> int:
        """Peak bytes of one forward: residual/MLP activations, attention scores, logits,
        and the gathered keys/values of the batch (the cache is indexed, so copied)."""
        s = self.spec
        bt = batch * new_tokens
        acts = bt * (6 * s.d_model + 2 * s.d_ff + s.vocab)
        scores = batch * s.n_heads * new_tokens * ctx * 2
        kv = 2 * batch * ctx * s.d_model
        return (acts + scores + kv) * self.dtype_bytes

    def min_activation_bytes(self) -> int:
        return self.activation_bytes(1, 1, self.spec.max_seq)

    def slots(self, max_batch: int) -> int:
        """How many sequences fit; raises BudgetError when not even one does."""
        if self.model_bytes > self.limit_bytes:
            raise BudgetError(f"mem_bytes {self.limit_bytes} is below the model's {self.model_bytes} bytes")
        free = self.limit_bytes - self.model_bytes - self.min_activation_bytes()
        n = free // self.kv_bytes_per_slot if free > 0 else 0
        if n < 1:
            need = self.model_bytes + self.min_activation_bytes() + self.kv_bytes_per_slot
            raise BudgetError(f"mem_bytes {self.limit_bytes} cannot hold the model and one sequence ({need} bytes)")
        return int(min(n, max_batch))

    def max_batch_for(self, slots: int, new_tokens: int, ctx: int) -> int:
        """Largest batch of this shape whose activations fit beside model and cache."""
        free = self.limit_bytes - self.model_bytes - slots * self.kv_bytes_per_slot
        per = self.activation_bytes(1, new_tokens, ctx)
        return max(1, free // per) if per else slots

    def max_chunk_for(self, slots: int, ctx: int) -> int:
        """Longest prefill chunk (tokens) of one sequence that fits."""
        t = self.spec.max_seq
        free = self.limit_bytes - self.model_bytes - slots * self.kv_bytes_per_slot
        while t > 1 and self.activation_bytes(1, t, ctx) > free:
            t //= 2
        return t


@dataclass
class _Seq:
    slot: int
    length: int = 0  # tokens in the cache
    pending: list[int] = field(default_factory=list)  # to feed before the next sample
    logits: torch.Tensor | None = None  # after the last fed token, once pending is empty
    gen: torch.Generator | None = None


class TorchEngine:
    """Continuous-batching engine over `PolicyModel`; one instance per worker process."""

    def __init__(
        self,
        spec: ModelSpec,
        budget: MemoryBudget,
        max_batch: int = 32,
        device: str = "cpu",
        stream: torch.cuda.Stream | None = None,
        temperature: float = 1.0,
    ):
        self.spec = spec
        self.budget = budget
        self.device = torch.device(device)
        self.max_batch = max_batch
        # a warm engine (budget 0: no lease yet) holds the model and no KV cache until `assign`
        self.n_slots = budget.slots(max_batch) if budget.limit_bytes else 0
        self.stream = stream
        self.temperature = temperature
        self.model = PolicyModel(spec).to(self.device).eval()
        self.cache = self.model.new_cache(self.n_slots)
        self.version = -1
        self._seqs: dict[str, _Seq] = {}
        self._free = list(range(self.n_slots - 1, -1, -1))
        self.steps = 0
        self.interrupted_tokens = 0  # tokens of decode steps cut short by a pause (recomputed later)
        self.peak_activation_bytes = 0
        self.last_logprobs: list[list[float]] = []  # of the tokens the last `generate` returned

    def assign(self, budget: MemoryBudget, device: str | None = None, stream: torch.cuda.Stream | None = None) -> None:
        """Size a warm engine to its lease: move the model to `device` (when given), then
        allocate the KV cache for the slots `budget` allows (BudgetError when not even one
        fits). Only before any sequence is admitted."""
        if self._seqs:
            raise RuntimeError("assign: the engine already runs sequences")
        n = budget.slots(self.max_batch)
        if device is not None and torch.device(device) != self.device:
            self.device = torch.device(device)
            self.model.to(self.device)
        self.budget, self.n_slots, self.stream = budget, n, stream
        self.cache = self.model.new_cache(n)
        self._free = list(range(n - 1, -1, -1))

    @property
    def max_seq(self) -> int:
        return self.spec.max_seq

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab

    def describe(self) -> dict:
        return {"name": "reference", "version": torch.__version__, "device": str(self.device)}

    # weights ---------------------------------------------------------------------------
    def load_weights(self, version: int, state_dict: dict) -> None:
        if state_dict:
            self.model.load_state_dict(state_dict, strict=True)
        self.version = version

    def weights_match(self, state_dict: dict) -> list[str]:
        return tensors_match(self.model.state_dict(), state_dict)

    # sequences -------------------------------------------------------------------------
    def free_slots(self) -> int:
        return len(self._free)

    def length(self, seq_id: str) -> int:
        s = self._seqs.get(seq_id)
        return 0 if s is None else s.length + len(s.pending)

    def release(self, seq_id: str) -> None:
        s = self._seqs.pop(seq_id, None)
        if s is not None:
            self._free.append(s.slot)

    def _seq(self, r: GenRequest) -> _Seq:
        s = self._seqs.get(r.seq_id)
        if s is None:
            if not self._free:
                raise RuntimeError("no free slot: check free_slots() before admitting a sequence")
            s = self._seqs[r.seq_id] = _Seq(slot=self._free.pop())
        if r.seed is not None:
            s.gen = torch.Generator().manual_seed(r.seed)
        if s.gen is None:
            s.gen = torch.Generator().manual_seed(0)
        s.pending.extend(r.tokens)
        if s.length + len(s.pending) > self.spec.max_seq:
            raise ValueError(f"sequence {r.seq_id}: {s.length + len(s.pending)} tokens > max_seq {self.spec.max_seq}")
        return s

    # generation ------------------------------------------------------------------------
    def generate(
        self, requests: Sequence[GenRequest], max_new_tokens: int, pause_check: Callable[[], bool] = lambda: False
    ) -> list[list[int]]:
        seqs = [self._seq(r) for r in requests]
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            # paused before a step, or between prefill chunks: the rest stays pending
            out, self.last_logprobs = decode_tokens(
                seqs,
                max_new_tokens,
                lambda: None if pause_check() else self._step(seqs, pause_check),
                self.temperature,
                self._count_step,
            )
            return out

    def _count_step(self) -> None:
        self.steps += 1

    def _step(self, seqs: list[_Seq], pause_check: Callable[[], bool]) -> list[torch.Tensor] | None:
        """Feed every sequence's pending tokens; each one's last logits, or None when
        pause_check turned true between two forwards (what was fed stays fed)."""
        for s in seqs:
            if not s.pending and s.logits is None:
                raise ValueError("a sequence with nothing to feed: give a prompt first")
        for s in seqs:  # prefill / extension, chunked to the budget
            if len(s.pending) > 1 and not self._prefill(s, pause_check):
                return None
        decode = [s for s in seqs if len(s.pending) == 1]
        if decode and pause_check():
            return None
        if decode:
            ctx = max(s.length for s in decode) + 1
            bmax = self.budget.max_batch_for(self.n_slots, 1, ctx)
            for j in range(0, len(decode), bmax):  # shrink the batch to fit the budget
                part = decode[j : j + bmax]
                toks = torch.tensor([[s.pending[0]] for s in part], device=self.device)
                slots = torch.tensor([s.slot for s in part], device=self.device)
                starts = torch.tensor([s.length for s in part], device=self.device)
                self._track(len(part), 1, ctx)
                lg = self.model(toks, self.cache, slots, starts, pause_check)
                if lg is None:  # paused between layers: this decode step's work is thrown away
                    self.interrupted_tokens += len(part)
                    return None
                lg = lg[:, -1]
                for k, s in enumerate(part):
                    s.length += 1
                    s.pending.clear()
                    s.logits = lg[k]
        out: list[torch.Tensor] = []
        for s in seqs:
            assert s.logits is not None  # fed above, or kept from its last feed (checked on entry)
            out.append(s.logits)
        for s in seqs:
            s.logits = None
        return out

    def _prefill(self, s: _Seq, pause_check: Callable[[], bool]) -> bool:
        """Feed s.pending in budget-sized chunks; False if paused before the end."""
        while s.pending:
            if pause_check():
                return False
            ctx = s.length + len(s.pending)
            n = min(len(s.pending), self.budget.max_chunk_for(self.n_slots, ctx))
            toks = torch.tensor([s.pending[:n]], device=self.device)
            slots = torch.tensor([s.slot], device=self.device)
            starts = torch.tensor([s.length], device=self.device)
            self._track(1, n, s.length + n)
            lg = self.model(toks, self.cache, slots, starts, pause_check)
            if lg is None:
                return False
            s.logits = lg[0, -1]
            s.length += n
            del s.pending[:n]
        return True

    def _track(self, b: int, t: int, ctx: int) -> None:
        self.peak_activation_bytes = max(self.peak_activation_bytes, self.budget.activation_bytes(b, t, ctx))


class _Decoding(Protocol):
    pending: list[int]
    gen: torch.Generator | None


def decode_tokens(
    seqs: Sequence[_Decoding],
    max_new_tokens: int,
    step: Callable[[], list[torch.Tensor] | None],
    temperature: float,
    on_step: Callable[[], None],
) -> tuple[list[list[int]], list[list[float]]]:
    """The decode loop of the torch engines: up to `max_new_tokens` times, `step()` feeds every
    sequence's pending tokens and gives each one's last logits (None once paused: stop), one
    token per sequence is sampled from its own generator, to be fed at the next step, and
    `on_step()` counts the step (a pause check may read the count). Each sequence's new tokens,
    and the log-probability of each (`sample_tokens`)."""
    gens: list[torch.Generator] = []
    for s in seqs:
        assert s.gen is not None  # every engine seeds a sequence's generator when it admits it
        gens.append(s.gen)
    out: list[list[int]] = [[] for _ in seqs]
    lps: list[list[float]] = [[] for _ in seqs]
    for _ in range(max_new_tokens):
        logits = step()
        if logits is None:
            break
        toks, logprobs = sample_tokens(logits, gens, temperature)
        for i, (s, tok, lp) in enumerate(zip(seqs, toks, logprobs)):
            s.pending.append(tok)
            out[i].append(tok)
            lps[i].append(lp)
        on_step()
    return out, lps


def sample_tokens(
    logits: list[torch.Tensor], gens: list[torch.Generator], temperature: float
) -> tuple[list[int], list[float]]:
    """One token per sequence, each from its own generator (so a sequence's draws do not depend
    on what it is batched with); the softmax runs once for the batch; temperature 0 is greedy.
    With each token its log-probability under the distribution it was drawn from: float32
    log_softmax of logits / temperature at the token (greedy: of the logits as they are)."""
    lg = torch.stack(logits).float()
    if temperature <= 0:
        ids = lg.argmax(-1).tolist()
        logp = torch.log_softmax(lg, dim=-1)
    else:
        scaled = lg / temperature
        probs = torch.softmax(scaled, dim=-1).cpu()
        ids = [int(torch.multinomial(p, 1, generator=g)) for p, g in zip(probs, gens)]
        logp = torch.log_softmax(scaled, dim=-1)
    picked = logp.gather(-1, torch.tensor(ids, device=logp.device).unsqueeze(-1)).squeeze(-1)
    return ids, picked.cpu().tolist()


def tensors_match(params: dict, state_dict: dict) -> list[str]:
    """Names of the published tensors `params` (a module's state dict) does not hold bit-exactly:
    its tensor, cast to the published tensor's dtype, is not byte-equal to the published one (or
    is missing, or has another shape)."""
    bad = []
    with torch.no_grad():
        for name, t in state_dict.items():
            p = params.get(name)
            if p is None or tuple(p.shape) != tuple(t.shape):
                bad.append(name)
                continue
            mine = p.detach().to(dtype=t.dtype).reshape(-1).contiguous()
            theirs = t.detach().to(device=mine.device).reshape(-1).contiguous()
            if not torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)):
                bad.append(name)
    return bad
