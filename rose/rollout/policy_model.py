"""The reference policy: a small byte-level decoder-only transformer with a slot KV cache.

Small on purpose (2 layers, d_model 128, vocab 256): a turn of a few dozen tokens decodes
in tens of milliseconds on one CPU core, so the whole rollout loop is real on any machine.
The cache is one preallocated tensor per layer, `[slots, 2, heads, max_seq, head_dim]`;
a sequence owns a slot, so sequences of different lengths decode in one batched forward
(continuous batching) and join or leave between steps without copying anyone's cache.
`forward(tokens, slots, starts)` writes the new keys/values at `starts[b]..` and attends
to everything in the slot up to each query's own position, so prefill, extension (tool
observations appended to a cached prefix) and one-token decoding are one code path. A
decode step over most slots attends on a view of the whole cache instead of gathering the
batch's rows (a copy of every key and value, the main cost on CPU).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    vocab: int = 256
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 512
    max_seq: int = 1024

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def param_count(self) -> int:
        d, f = self.d_model, self.d_ff
        per_layer = 4 * d * d + 2 * d * f + f + d + 4 * d  # attn, mlp (+biases), 2 norms
        return self.vocab * d + self.max_seq * d + self.n_layers * per_layer + 2 * d

    def to_dict(self) -> dict:
        return asdict(self)


class Block(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        self.s = s
        self.ln1 = nn.LayerNorm(s.d_model)
        self.qkv = nn.Linear(s.d_model, 3 * s.d_model, bias=False)
        self.proj = nn.Linear(s.d_model, s.d_model, bias=False)
        self.ln2 = nn.LayerNorm(s.d_model)
        self.up = nn.Linear(s.d_model, s.d_ff)
        self.down = nn.Linear(s.d_ff, s.d_model)

    def forward(self, x, cache, slots, starts, mask):
        b, t, _ = x.shape
        h, hd = self.s.n_heads, self.s.head_dim
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, h, hd).permute(2, 0, 3, 1, 4)
        # write this step's keys/values into each sequence's slot
        pos = starts[:, None] + torch.arange(t, device=x.device)[None, :]  # [b, t]
        sl = slots[:, None].expand(b, t)
        cache[sl, 0, :, pos] = k.permute(0, 2, 1, 3)  # [b, t, h, hd]
        cache[sl, 1, :, pos] = v.permute(0, 2, 1, 3)
        ctx = mask.shape[-1]
        n_slots = cache.shape[0]
        if t == 1 and 2 * b >= n_slots:
            # decode over most slots: attend on a view of the whole cache (no gather copy);
            # rows of idle slots see position 0 only and are dropped
            qf = q.new_zeros(n_slots, h, 1, hd)
            qf[slots] = q
            mf = torch.zeros(n_slots, 1, ctx, dtype=torch.bool, device=x.device)
            mf[:, :, 0] = True
            mf[slots] = mask
            a = F.scaled_dot_product_attention(qf, cache[:, 0, :, :ctx], cache[:, 1, :, :ctx], attn_mask=mf[:, None])[
                slots
            ]
        else:
            kk = cache[slots, 0, :, :ctx]  # [b, h, ctx, hd]: a gathered copy
            vv = cache[slots, 1, :, :ctx]
            a = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask[:, None])
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class PolicyModel(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.tok = nn.Embedding(spec.vocab, spec.d_model)
        self.pos = nn.Embedding(spec.max_seq, spec.d_model)
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.n_layers))
        self.ln_f = nn.LayerNorm(spec.d_model)

    def new_cache(self, slots: int) -> list[torch.Tensor]:
        s = self.spec
        p = next(self.parameters())
        return [
            torch.zeros(slots, 2, s.n_heads, s.max_seq, s.head_dim, dtype=p.dtype, device=p.device)
            for _ in range(s.n_layers)
        ]

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        cache: list[torch.Tensor],
        slots: torch.Tensor,
        starts: torch.Tensor,
        pause_check=None,
    ) -> torch.Tensor | None:
        """tokens [b, t] placed at positions starts[b].. of cache slots[b]; logits [b, t, vocab].
        `pause_check()` runs between layers: True abandons the forward and returns None (the
        keys/values it wrote sit beyond the sequence's length and are overwritten when the
        same tokens are fed again), so a pause waits for one layer, not a whole step."""
        b, t = tokens.shape
        dev = tokens.device
        pos = starts[:, None] + torch.arange(t, device=dev)[None, :]
        if int(pos.max()) >= self.spec.max_seq:
            raise ValueError(f"sequence longer than max_seq={self.spec.max_seq}")
        ctx = int(pos.max()) + 1
        mask = torch.arange(ctx, device=dev)[None, None, :] <= pos[:, :, None]  # [b, t, ctx]
        x = self.tok(tokens) + self.pos(pos)
        for i, (blk, c) in enumerate(zip(self.blocks, cache)):
            if i and pause_check is not None and pause_check():
                return None
            x = blk(x, c, slots, starts, mask)
        return self.ln_f(x) @ self.tok.weight.T


def init_state_dict(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic weights for a seed (the `StaticWeights` policy, version 0)."""
    g = torch.Generator().manual_seed(seed)
    m = PolicyModel(spec)
    out = {}
    for name, p in m.state_dict().items():
        if name.endswith(".weight") and p.dim() == 2:
            std = 0.02 if "down" not in name and "proj" not in name else 0.02 / math.sqrt(2 * spec.n_layers)
            out[name] = torch.randn(p.shape, generator=g) * std
        elif "ln" in name and name.endswith("weight"):
            out[name] = torch.ones_like(p)
        else:
            out[name] = torch.zeros_like(p)
    return out
