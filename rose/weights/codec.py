"""Lossless shard deltas over the flat layout (pure numpy, no Python loops over elements).

A delta shard holds only the elements (units of the shard's narrowest dtype) whose bits
changed: their positions, as LEB128 varints of the gaps or as a bitmap, whichever is
smaller, and their values XORed with the receiver's old bits, stored as byte planes (all
low bytes, then all high bytes). The receiver XORs them back in. XOR rather than the raw
new value because a small learning-rate step changes only low mantissa bits: the planes
of high bytes are then almost all zero and the optional zstd stage removes them, which it
would not for raw values. zstd is kept only when it pays. Every shard carries a blake2b-16
checksum of the shard bytes the receiver must end with; a mismatch means its view diverged.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from rose.weights.layout import Layout

LOSSLESS = "xor"
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_FLAG_ZSTD = 1
_MODE_VARINT, _MODE_BITMAP = 0, 1
_HEAD = struct.Struct("<BBxxII")  # mode, unit, count, index bytes
_ZSTD_MIN_GAIN = 0.97  # keep zstd output only if it is at most this fraction of the input
_local = threading.local()


class ChecksumMismatch(ValueError):
    """The shard bytes after applying differ from the sender's: the receiver's view diverged."""


class CorruptPayload(ValueError):
    """A payload that cannot be decoded."""


@dataclass(frozen=True)
class ShardPatch:
    shard: int
    kind: str  # "full" | "delta"
    codec: str  # "raw" for full shards, else the delta codec
    payload: bytes
    checksum: str  # hex blake2b-16 of the shard bytes after applying
    changed: int = 0  # elements (units) sent; informational


def checksum(buf: np.ndarray | bytes) -> str:
    return hashlib.blake2b(buf, digest_size=16).hexdigest()


# -- varints ---------------------------------------------------------------------------


def varint_encode(values: np.ndarray) -> np.ndarray:
    """LEB128 of non-negative integers (< 2**35), vectorised: one pass per byte position."""
    v = values.astype(np.uint64, copy=False)
    nbytes = np.ones(v.shape, dtype=np.int64)
    for k in range(1, 5):
        nbytes += v >= (1 << (7 * k))
    ends = np.cumsum(nbytes)
    out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.uint8)
    starts = ends - nbytes
    for k in range(5):
        sel = nbytes > k
        if not sel.any():
            break
        byte = (v[sel] >> np.uint64(7 * k)) & np.uint64(0x7F)
        more = (nbytes[sel] > k + 1).astype(np.uint64) << np.uint64(7)
        out[starts[sel] + k] = (byte | more).astype(np.uint8)
    return out


def varint_decode(buf: np.ndarray, count: int) -> np.ndarray:
    last = np.flatnonzero((buf & 0x80) == 0)
    if len(last) != count or (count and last[-1] != len(buf) - 1):
        raise CorruptPayload(f"varint stream holds {len(last)} values, expected {count}")
    if not count:
        return np.zeros(0, dtype=np.int64)
    starts = np.concatenate(([0], last[:-1] + 1))
    lengths = last - starts + 1
    pos = np.arange(len(buf)) - np.repeat(starts, lengths)
    contrib = (buf & 0x7F).astype(np.int64) << (7 * pos)
    return np.add.reduceat(contrib, starts)


# -- zstd stage -------------------------------------------------------------------------


def _zstd():
    if not hasattr(_local, "c"):
        import zstandard

        _local.c, _local.d = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    return _local.c, _local.d


def _pack(body: bytes, compress: bool) -> bytes:
    if compress and len(body) > 64:
        c = _zstd()[0].compress(body)
        if len(c) < len(body) * _ZSTD_MIN_GAIN:
            return bytes([_FLAG_ZSTD]) + c
    return b"\x00" + body


def _unpack(payload: bytes) -> bytes:
    if not payload:
        raise CorruptPayload("empty payload")
    if payload[0] & _FLAG_ZSTD:
        try:
            return _zstd()[1].decompress(payload[1:])
        except Exception as e:  # zstandard.ZstdError
            raise CorruptPayload(f"zstd: {e}") from None
    return payload[1:]


# -- one shard --------------------------------------------------------------------------


def changed_units(old: np.ndarray, new: np.ndarray, unit: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions (in units) of the elements that differ, and their XORed bits.

    Compares 8-byte words first (cheap) and looks inside the changed words only.
    """
    wo, wn = old.view(np.uint64), new.view(np.uint64)
    words = np.flatnonzero(wo != wn)
    if unit == 8 or not len(words):
        return words, (wo[words] ^ wn[words])
    shift = {1: 3, 2: 2, 4: 1}[unit]  # log2(units per word)
    x = (wo[words] ^ wn[words]).view(_UINT[unit])
    k = np.flatnonzero(x)
    pos = (words[k >> shift] << shift) + (k & ((1 << shift) - 1))
    return pos, x[k]


def encode_delta(old: np.ndarray, new: np.ndarray, unit: int, compress: bool = True) -> bytes | None:
    """The delta turning shard bytes `old` into `new`, or None when they are equal."""
    pos, xor = changed_units(old, new, unit)
    if not len(pos):
        return None
    return _pack(delta_body(pos, xor, unit, len(new) // unit), compress)


def delta_body(pos: np.ndarray, xor: np.ndarray, unit: int, n_units: int) -> bytes:
    """The uncompressed delta of sorted unit positions `pos` and their XORed bits."""
    gaps = np.diff(pos, prepend=-1) - 1
    index = varint_encode(gaps)
    mode = _MODE_VARINT
    if (n_units + 7) // 8 < len(index):
        mask = np.zeros(n_units, dtype=bool)
        mask[pos] = True
        index, mode = np.packbits(mask), _MODE_BITMAP
    planes = xor.view(np.uint8).reshape(-1, unit).T
    return b"".join((_HEAD.pack(mode, unit, len(pos), len(index)), index.tobytes(), np.ascontiguousarray(planes).tobytes()))


def apply_delta(buf: np.ndarray, payload: bytes) -> None:
    """XOR a delta into shard bytes `buf` in place."""
    apply_delta_body(buf, _unpack(payload))


def apply_delta_body(buf: np.ndarray, body: bytes) -> None:
    if len(body) < _HEAD.size:
        raise CorruptPayload("delta shorter than its header")
    mode, unit, count, ilen = _HEAD.unpack_from(body)
    if unit not in _UINT or len(buf) % unit or len(body) != _HEAD.size + ilen + count * unit:
        raise CorruptPayload(f"delta header does not match its size (unit {unit}, count {count})")
    raw = np.frombuffer(body, dtype=np.uint8)
    index = raw[_HEAD.size : _HEAD.size + ilen]
    if mode == _MODE_VARINT:
        pos = np.cumsum(varint_decode(index, count) + 1) - 1
    elif mode == _MODE_BITMAP:
        pos = np.flatnonzero(np.unpackbits(index, count=len(buf) // unit))
    else:
        raise CorruptPayload(f"unknown index mode {mode}")
    units = buf.view(_UINT[unit])
    if len(pos) != count or (count and (pos[0] < 0 or pos[-1] >= len(units))):
        raise CorruptPayload("delta positions outside the shard")
    xor = np.ascontiguousarray(raw[_HEAD.size + ilen :].reshape(unit, count).T).view(_UINT[unit]).ravel()
    units[pos] ^= xor


def encode_full(new: np.ndarray, compress: bool = True) -> bytes:
    return _pack(new.tobytes(), compress)


def apply_full(buf: np.ndarray, payload: bytes) -> None:
    body = _unpack(payload)
    if len(body) != len(buf):
        raise CorruptPayload(f"full shard of {len(body)} bytes, expected {len(buf)}")
    buf[:] = np.frombuffer(body, dtype=np.uint8)


# -- a whole state ------------------------------------------------------------------------


def encode_state(
    layout: Layout,
    view: np.ndarray | None,
    target: np.ndarray,
    *,
    keyframe: bool = False,
    codec: str = LOSSLESS,
    compress: bool = True,
    workers: int = 1,
    lossy_options: dict | None = None,
) -> tuple[list[ShardPatch], np.ndarray]:
    """Patches that bring the receiver's `view` to `target`, and the receiver's new view.

    Lossless: the new view is `target` itself. Lossy codecs: the view the receiver will
    actually hold (error feedback: what was not sent stays in target - view and goes next
    time). `view` is updated in place when given; unchanged shards yield no patch.
    """
    if keyframe or view is None:
        view = target.copy() if view is None else view
        if view is not target:
            np.copyto(view, target)
    units = layout.shard_units()
    lossy = None
    if codec != LOSSLESS:
        from rose.weights import lossy as lossy_mod

        lossy = lossy_mod.encoder(codec, **(lossy_options or {}))

    def one(i: int) -> ShardPatch | None:
        s, e = layout.shard_range(i)
        new = target[s:e]
        if keyframe:
            return ShardPatch(i, "full", "raw", encode_full(new, compress), checksum(new))
        old = view[s:e]
        dtype = layout.shard_dtype(i) if lossy else None
        if lossy and dtype in lossy.dtypes:
            payload = lossy.encode(old, new, dtype)  # updates old in place
            if payload is None:
                return None
            return ShardPatch(i, "delta", codec, _pack(payload, compress), checksum(old))
        unit = int(units[i])
        pos, xor = changed_units(old, new, unit)
        if not len(pos):
            return None
        payload = _pack(delta_body(pos, xor, unit, len(new) // unit), compress)
        np.copyto(old, new)
        return ShardPatch(i, "delta", LOSSLESS, payload, checksum(new), len(pos))

    ids = range(layout.num_shards)
    if workers > 1 and layout.num_shards > 1:
        with ThreadPoolExecutor(workers) as ex:
            patches = list(ex.map(one, ids))
    else:
        patches = [one(i) for i in ids]
    return [p for p in patches if p is not None], view


def apply_patch(layout: Layout, flat: np.ndarray, patch: ShardPatch, verify: bool = True) -> None:
    """Apply one shard patch to the flat buffer in place; check the resulting bytes."""
    if not 0 <= patch.shard < layout.num_shards:
        raise CorruptPayload(f"shard {patch.shard} outside the layout ({layout.num_shards} shards)")
    s, e = layout.shard_range(patch.shard)
    buf = flat[s:e]
    if patch.kind == "full":
        apply_full(buf, patch.payload)
    elif patch.codec == LOSSLESS:
        apply_delta(buf, patch.payload)
    else:
        from rose.weights import lossy as lossy_mod

        lossy_mod.apply(patch.codec, buf, _unpack(patch.payload), layout.shard_dtype(patch.shard))
    if verify and checksum(buf) != patch.checksum:
        raise ChecksumMismatch(f"shard {patch.shard}: checksum mismatch after applying")
