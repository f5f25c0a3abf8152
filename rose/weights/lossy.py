"""Opt-in lossy shard codecs with error feedback: top-k by magnitude, int8-quantised differences.

The sender keeps the receiver's exact view and always encodes `target - view`; what a step
leaves out stays in that residual and is sent by a later step, so repeated publishes of the
same target converge to it bit for bit (no update is lost). Decoding is deterministic
float32 numpy arithmetic, so sender and receiver compute the same bits.

- `topk`: the `frac` share of changed elements with the largest |target - view|, sent
  exactly (as the lossless XOR delta of that subset).
- `int8`: every changed element as round(d / scale) in int8 with one fp32 scale per shard;
  the largest differences (|q| = 127) and non-finite values are sent exactly, so each step
  lands at least one element exactly and the residual shrinks ~254x in max norm per step.
"""

from __future__ import annotations

import struct

import numpy as np

from rose.weights.xor_delta import (
    CorruptPayload,
    apply_delta_body,
    changed_units,
    delta_body,
    varint_decode,
    varint_encode,
)

FLOAT_DTYPES = frozenset({"bfloat16", "float16", "float32"})
CODECS = ("topk", "int8")
_ITEM = {"bfloat16": 2, "float16": 2, "float32": 4}
_INT8_HEAD = struct.Struct("<fII")  # scale, quantised count, index bytes


def to_f32(buf: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (buf.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype == "float16":
        return buf.view(np.float16).astype(np.float32)
    return buf.view(np.float32)


def from_f32(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> raw uint bits of `dtype`, round to nearest even."""
    if dtype == "bfloat16":
        u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(x)
        r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
        return r
    if dtype == "float16":
        return x.astype(np.float16).view(np.uint16)
    return x.astype(np.float32).view(np.uint32)


class _TopK:
    dtypes = FLOAT_DTYPES

    def __init__(self, frac: float = 0.01):
        if not 0 < frac <= 1:
            raise ValueError(f"topk frac must be in (0, 1], got {frac}")
        self.frac = frac

    def encode(self, old: np.ndarray, new: np.ndarray, dtype: str) -> bytes | None:
        unit = _ITEM[dtype]
        pos, xor = changed_units(old, new, unit)
        if not len(pos):
            return None
        k = max(1, int(np.ceil(self.frac * (len(new) // unit))))
        if len(pos) > k:
            d = np.abs(to_f32(new.view(np.uint8), dtype)[pos] - to_f32(old.view(np.uint8), dtype)[pos])
            d[~np.isfinite(d)] = np.inf
            keep = np.sort(np.argpartition(-d, k - 1)[:k])
            pos, xor = pos[keep], xor[keep]
        old.view(xor.dtype)[pos] ^= xor
        return delta_body(pos, xor, unit, len(new) // unit)


class _Int8:
    dtypes = FLOAT_DTYPES

    def encode(self, old: np.ndarray, new: np.ndarray, dtype: str) -> bytes | None:
        unit = _ITEM[dtype]
        pos, xor = changed_units(old, new, unit)
        if not len(pos):
            return None
        have, want = to_f32(old, dtype)[pos], to_f32(new, dtype)[pos]
        d = want - have
        finite = np.isfinite(d)
        amax = float(np.max(np.abs(d[finite]))) if finite.any() else 0.0
        scale = np.float32(amax / 127.0)
        if scale > 0 and np.isfinite(scale):
            q = np.zeros(len(d), dtype=np.int8)
            q[finite] = np.clip(np.rint(d[finite] / scale), -127, 127).astype(np.int8)
        else:
            q = np.zeros(len(d), dtype=np.int8)
            scale = np.float32(0.0)
        exact = ~finite | (np.abs(q) == 127) | ((q == 0) & (d == 0))  # sign-of-zero flips included
        quant = ~exact & (q != 0)
        qpos, qv = pos[quant], q[quant]
        units = old.view(xor.dtype)
        units[qpos] = from_f32(have[quant] + qv.astype(np.float32) * scale, dtype)
        epos, exor = pos[exact], xor[exact]
        units[epos] ^= exor
        index = varint_encode(np.diff(qpos, prepend=-1) - 1)
        head = _INT8_HEAD.pack(float(scale), len(qpos), len(index))
        tail = delta_body(epos, exor, unit, len(new) // unit) if len(epos) else b""
        return b"".join((head, index.tobytes(), qv.tobytes(), tail))


def encoder(codec: str, **options):
    if codec == "topk":
        return _TopK(**options)
    if codec == "int8":
        return _Int8()
    raise ValueError(f"unknown codec {codec!r}; known: xor, {', '.join(CODECS)}")


def apply(codec: str, buf: np.ndarray, body: bytes, dtype: str | None) -> None:
    """Apply a lossy shard body to shard bytes `buf` in place (the sender computed the same)."""
    if dtype not in FLOAT_DTYPES:
        raise CorruptPayload(f"{codec} delta on a shard of dtype {dtype}")
    if codec == "topk":
        apply_delta_body(buf, body)
        return
    if codec != "int8":
        raise CorruptPayload(f"unknown codec {codec!r}")
    if len(body) < _INT8_HEAD.size:
        raise CorruptPayload("int8 delta shorter than its header")
    scale, count, ilen = _INT8_HEAD.unpack_from(body)
    raw = np.frombuffer(body, dtype=np.uint8)
    at = _INT8_HEAD.size
    if len(raw) < at + ilen + count:
        raise CorruptPayload("int8 delta shorter than its counts")
    qpos = np.cumsum(varint_decode(raw[at : at + ilen], count) + 1) - 1
    qv = raw[at + ilen : at + ilen + count].view(np.int8)
    units = buf.view(np.uint16 if _ITEM[dtype] == 2 else np.uint32)
    if count and qpos[-1] >= len(units):
        raise CorruptPayload("int8 positions outside the shard")
    have = to_f32(buf, dtype)[qpos]
    units[qpos] = from_f32(have + qv.astype(np.float32) * np.float32(scale), dtype)
    if len(raw) > at + ilen + count:
        apply_delta_body(buf, body[at + ilen + count :])
