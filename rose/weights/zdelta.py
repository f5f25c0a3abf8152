"""The `zdelta` body of one shard, the default lossless codec: entropy-coded gaps and integer
differences of the changed elements.

For each changed element (unit of the shard's narrowest dtype) the body holds its `gap`, the
number of unchanged units before it, and `d`, the difference of its new and old bits in
sign-magnitude order (`order`) modulo 2**bits: a float that moves by k representable values
has |d| = k, so a small learning-rate step gives |d| = 1 for most elements. With `k`, the
shard's gap shift (from its mean gap, in the header), they go as four streams, each
zstd-compressed when that pays:

- symbols, one byte per changed element: `min(gap >> k, 63) << 2 | (d < 0) << 1 | (|d| > 1)`;
- low gap bits, one byte per changed element holding `gap & (2**k - 1)` (absent when k = 0);
- gap escapes: LEB128 varints of `(gap >> k) - 63` for the symbols holding 63;
- magnitudes: LEB128 varints of `|d| - 2` where |d| > 1.

Joining the gap with the sign and the `big` flag spreads the symbol over ~256 values, so zstd's
Huffman stage codes it within a few percent of its entropy, where the skewed flags alone would
cost at least a bit each; the shift keeps sparse shards' gaps out of the escapes. Why this
coding, and what it costs per changed element: docs/weights.md.
"""

from __future__ import annotations

import struct
import threading

import numpy as np

from rose.weights.scan import SINT, UINT
from rose.weights.xor_delta import CorruptPayload, varint_decode, varint_encode

NAME = "zdelta"
VERSION = 1
_HEAD = struct.Struct("<BBBBIIIII")  # version, unit, zstd flags (a bit per stream), k, count, 4 stream lengths
_MAX_SIGNED = {u: (1 << (8 * u - 1)) - 1 for u in UINT}
_CAP = 63  # shifted gaps from here on continue in the escape stream
_MAX_SHIFT = 8  # low gap bits fit a byte
_ZSTD_LEVEL = 1
_ZSTD_MIN = 64  # streams shorter than this are stored as they are
ZSTD_MIN_GAIN = 0.97  # keep compressed bytes only if they are at most this fraction of the raw ones
_local = threading.local()


def zstd():
    """This thread's zstd (compressor, decompressor)."""
    if not hasattr(_local, "c"):
        import zstandard

        _local.c, _local.d = zstandard.ZstdCompressor(level=_ZSTD_LEVEL), zstandard.ZstdDecompressor()
    return _local.c, _local.d


def order(units: np.ndarray, unit: int) -> np.ndarray:
    """Float bits in sign-magnitude order as unsigned integers, so that neighbouring floats
    differ by 1; its own inverse, and a bijection on any bits (integers too)."""
    s = units.view(SINT[unit])
    return (s ^ ((s >> (8 * unit - 1)) & _MAX_SIGNED[unit])).view(UINT[unit])


def gap_shift(count: int, span: int) -> int:
    """The gap shift for `count` changed units over `span` units: shifted gaps of a geometric
    spread then average 4-8. Below 3 it is 0: zstd codes a stream of one- or two-bit values at
    well above their entropy."""
    k = int(np.log2(max(span / max(count, 1), 1.0))) - 2
    return min(k, _MAX_SHIFT) if k >= 3 else 0


def encode(pos: np.ndarray, old: np.ndarray, new: np.ndarray, unit: int, compress: bool = True) -> bytes:
    """The body of the changed units at sorted positions `pos`, from their `old` and `new` bits."""
    count = len(pos)
    gaps = np.empty(count, dtype=np.int64)
    if count:
        gaps[0] = pos[0]
        np.subtract(pos[1:], pos[:-1], out=gaps[1:])
        gaps[1:] -= 1
    k = gap_shift(count, int(pos[-1]) + 1 if count else 0)
    d = order(new, unit) - order(old, unit)  # wraps modulo 2**bits
    neg = d.view(SINT[unit]) < 0
    mag = np.abs(d.view(SINT[unit])).view(UINT[unit])  # |-2**(bits-1)| wraps to itself: right as unsigned
    big = mag > 1
    high = gaps >> k if k else gaps
    sym = np.minimum(high, _CAP).astype(np.uint8)
    sym <<= 2
    sym |= neg.view(np.uint8) << 1
    sym |= big.view(np.uint8)
    low = (gaps & ((1 << k) - 1)).astype(np.uint8) if k else np.zeros(0, dtype=np.uint8)
    esc = high[high >= _CAP]
    esc -= _CAP
    streams = (sym, low, varint_encode(esc), varint_encode(mag[big] - 2))
    flags, packed = 0, []
    for i, s in enumerate(streams):
        raw = s.tobytes()
        if compress and len(raw) >= _ZSTD_MIN:
            c = zstd()[0].compress(raw)
            if len(c) < len(raw) * ZSTD_MIN_GAIN:
                raw, flags = c, flags | (1 << i)
        packed.append(raw)
    return b"".join((_HEAD.pack(VERSION, unit, flags, k, count, *map(len, packed)), *packed))


def _stream(body: bytes, at: int, size: int, packed: bool, limit: int) -> np.ndarray:
    raw = body[at : at + size]
    if packed:
        try:
            raw = zstd()[1].decompress(raw, max_output_size=limit)
        except Exception as e:  # zstandard.ZstdError
            raise CorruptPayload(f"zstd: {e}") from None
    return np.frombuffer(raw, dtype=np.uint8)


def decode(body: bytes, n_bytes: int) -> tuple[int, np.ndarray, np.ndarray]:
    """(unit, sorted positions, d) of a body for a shard of `n_bytes` bytes, where d is the
    difference (modulo 2**bits) to add to each changed unit in `order`."""
    if len(body) < _HEAD.size:
        raise CorruptPayload("zdelta shorter than its header")
    version, unit, flags, k, count, *sizes = _HEAD.unpack_from(body)
    if version != VERSION or unit not in UINT or n_bytes % unit or k > _MAX_SHIFT:
        raise CorruptPayload(f"zdelta header: version {version}, unit {unit}, shift {k}")
    n_units = n_bytes // unit
    if count > n_units or len(body) != _HEAD.size + sum(sizes):
        raise CorruptPayload(f"zdelta header does not match its size (count {count}, {len(body)} bytes)")
    at = _HEAD.size
    streams = []
    for i, (size, limit) in enumerate(zip(sizes, (count, count, 10 * count, 10 * count))):
        streams.append(_stream(body, at, size, bool(flags >> i & 1), limit))
        at += size
    sym, low, esc_raw, mag_raw = streams
    if len(sym) != count or len(low) != (count if k else 0):
        raise CorruptPayload(f"zdelta holds {len(sym)} symbols and {len(low)} low gap bits, expected {count}")
    gaps = (sym >> 2).astype(np.int64)
    esc = np.flatnonzero(gaps == _CAP)
    extra = varint_decode(esc_raw, len(esc))
    if len(extra) and (extra.min() < 0 or extra.max() > n_units >> k):  # so that the positions cannot overflow
        raise CorruptPayload("zdelta gap outside the shard")
    gaps[esc] += extra
    if k:
        gaps <<= k
        gaps |= low
    gaps += 1
    pos = np.cumsum(gaps, out=gaps)
    pos -= 1
    if count and pos[-1] >= n_units:
        raise CorruptPayload("zdelta positions outside the shard")
    big = np.flatnonzero(sym & 1)
    d = np.ones(count, dtype=UINT[unit])
    d[big] = varint_decode(mag_raw, len(big)).astype(UINT[unit])
    d[big] += 2
    neg = ((sym >> 1) & 1).astype(SINT[unit])
    np.negative(neg, out=neg)  # all ones where d < 0: d = (|d| ^ -1) + 1 there (two's complement)
    d ^= neg.view(UINT[unit])
    d -= neg.view(UINT[unit])
    return unit, pos, d


def updated(old: np.ndarray, d: np.ndarray, unit: int) -> np.ndarray:
    """The new units from the old ones and their differences `d` (see `decode`)."""
    o = order(old, unit)
    o += d
    return order(o, unit)
