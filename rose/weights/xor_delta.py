"""The XOR delta body of one shard: which elements changed, and their bits XORed with the old ones.

A body holds only the elements (units of the shard's narrowest dtype) whose bits changed: their
positions, as LEB128 varints of the gaps or as a bitmap, whichever is smaller, and their values
XORed with the receiver's old bits, stored as byte planes (all low bytes, then all high bytes).
The lossless codec (rose.weights.codec) sends one body per changed shard; the lossy ones
(rose.weights.lossy) send the elements they choose in the same form. Pure numpy, no Python loops
over elements; why XOR and how a shard is scanned: docs/weights.md.
"""

from __future__ import annotations

import struct

import numpy as np

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_MODE_VARINT, _MODE_BITMAP = 0, 1
_HEAD = struct.Struct("<BBxxII")  # mode, unit, count, index bytes
_BLOCK = 256 << 10  # shard bytes handled at a time: both sides and the temporaries stay in L2
_SHIFT = {1: 3, 2: 2, 4: 1, 8: 0}  # log2(units per 8-byte word)


class CorruptPayload(ValueError):
    """A payload that cannot be decoded."""


# -- varints ---------------------------------------------------------------------------


def varint_encode(values: np.ndarray) -> np.ndarray:
    """LEB128 of non-negative integers (< 2**35), vectorised.

    Gaps between changed elements are mostly below 128 (one byte each), so the full-length
    work is a few passes; the bytes beyond the first of larger values are inserted and
    filled as a (small) subset.
    """
    v = values.astype(np.int64, copy=False)
    idx = np.flatnonzero(v >= 0x80)
    low = v.astype(np.uint8) & 0x7F
    if not len(idx):
        return low
    vb = v[idx]
    nb = np.ones(len(idx), dtype=np.int64)  # bytes of each large value
    for k in range(1, 5):
        nb += vb >= (1 << (7 * k))
    low[idx] |= 0x80
    extra = nb - 1
    out = np.insert(low, np.repeat(idx + 1, extra), 0)
    first = idx + np.cumsum(extra) - extra  # where each large value starts in `out`
    for k in range(1, 5):
        sel = np.flatnonzero(nb > k)
        if not len(sel):
            break
        byte = (vb[sel] >> (7 * k)).astype(np.uint8) & 0x7F
        out[first[sel] + k] = byte | ((nb[sel] > k + 1).astype(np.uint8) << 7)
    return out


def varint_decode(buf: np.ndarray, count: int) -> np.ndarray:
    """Inverse of varint_encode; full-length work only on the (few) continuation bytes."""
    cont = np.flatnonzero(buf >= 0x80)
    m = len(cont)
    if len(buf) - m != count or (m and cont[-1] == len(buf) - 1):
        raise CorruptPayload(f"varint stream holds {len(buf) - m} values, expected {count}")
    if not m:
        return buf.astype(np.int64)
    i = np.arange(m)
    run = np.ones(m, dtype=bool)  # a continuation byte that starts a value
    run[1:] = cont[1:] != cont[:-1] + 1
    starts = np.flatnonzero(run)
    j = i - np.repeat(starts, np.diff(np.append(starts, m)))  # byte position within the value
    if j.max() >= 4:
        raise CorruptPayload("varint longer than 5 bytes")
    low = np.add.reduceat((buf[cont] & 0x7F).astype(np.int64) << (7 * j), starts)
    vals = np.delete(buf, cont).astype(np.int64)  # the last byte of every value
    which = cont[starts] - starts  # value index of each multi-byte value
    vals[which] = (vals[which] << (7 * np.diff(np.append(starts, m)))) | low
    return vals


# -- one shard --------------------------------------------------------------------------


def changed_units(
    old: np.ndarray, new: np.ndarray, unit: int, *, update: bool = False, digest=None
) -> tuple[np.ndarray, np.ndarray]:
    """Positions (in units) of the elements that differ, and their XORed bits, in one pass over
    the shard, in cache-sized blocks.

    Per block: compare 8-byte words, refine only the changed words into units and, while
    the block is still in cache, feed `new` to `digest` (an xxh3 state) and, with `update`,
    copy the changed words into `old`. Doing each step over the whole shard instead reads
    it from memory several times and allocates MB-sized temporaries (fresh pages) per step.
    """
    wo, wn = old.view(np.uint64), new.view(np.uint64)
    step, shift = _BLOCK // 8, _SHIFT[unit]
    ne = np.empty(min(step, len(wo)), dtype=bool)
    positions, xors = [], []
    for s in range(0, len(wo), step):
        a, b = wo[s : s + step], wn[s : s + step]
        if digest is not None:
            digest.update(b)
        changed = ne[: len(a)]
        np.not_equal(a, b, out=changed)
        w = np.flatnonzero(changed)
        if not len(w):
            continue
        nw = b[w]
        x = (a[w] ^ nw).view(_UINT[unit])
        if update:
            a[w] = nw
        if shift:
            k = np.flatnonzero(x != 0)
            w = ((w[k >> shift] + s) << shift) | (k & ((1 << shift) - 1))
            x = x[k]
        else:
            w += s
        positions.append(w)
        xors.append(x)
    if not positions:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=_UINT[unit])
    return np.concatenate(positions), np.concatenate(xors)


def delta_body(pos: np.ndarray, xor: np.ndarray, unit: int, n_units: int) -> bytes:
    """The uncompressed delta of sorted unit positions `pos` and their XORed bits."""
    gaps = np.empty_like(pos)
    if len(pos):
        gaps[0] = pos[0]
        np.subtract(pos[1:], pos[:-1], out=gaps[1:])
        gaps[1:] -= 1
    index = varint_encode(gaps)
    mode = _MODE_VARINT
    if (n_units + 7) // 8 < len(index):
        mask = np.zeros(n_units, dtype=bool)
        mask[pos] = True
        index, mode = np.packbits(mask), _MODE_BITMAP
    planes = np.ascontiguousarray(xor.view(np.uint8).reshape(-1, unit).T)
    # numpy's stubs declare ndarray's buffer protocol (__buffer__) only for Python >= 3.12
    return b"".join((_HEAD.pack(mode, unit, len(pos), len(index)), index, planes))  # type: ignore[arg-type]


def apply_delta_body(buf: np.ndarray, body: bytes, digest=None) -> None:
    if len(body) < _HEAD.size:
        raise CorruptPayload("delta shorter than its header")
    mode, unit, count, ilen = _HEAD.unpack_from(body)
    if unit not in _UINT or len(buf) % unit or len(body) != _HEAD.size + ilen + count * unit:
        raise CorruptPayload(f"delta header does not match its size (unit {unit}, count {count})")
    raw = np.frombuffer(body, dtype=np.uint8)
    index = raw[_HEAD.size : _HEAD.size + ilen]
    if mode == _MODE_VARINT:
        pos = varint_decode(index, count)
        pos += 1
        np.cumsum(pos, out=pos)
        pos -= 1
    elif mode == _MODE_BITMAP:
        pos = np.flatnonzero(np.unpackbits(index, count=len(buf) // unit))
    else:
        raise CorruptPayload(f"unknown index mode {mode}")
    units = buf.view(_UINT[unit])
    if len(pos) != count or (count and (pos[0] < 0 or pos[-1] >= len(units))):
        raise CorruptPayload("delta positions outside the shard")
    xor = np.ascontiguousarray(raw[_HEAD.size + ilen :].reshape(unit, count).T).view(_UINT[unit]).ravel()
    # block by block, so that the digest reads each block while the scatter left it in cache
    step = _BLOCK // unit
    cuts = np.searchsorted(pos, np.arange(0, len(units) + step, step)).tolist()
    for i, s in enumerate(range(0, len(units), step)):
        a, b = cuts[i], cuts[i + 1]
        if b > a:
            units[pos[a:b]] ^= xor[a:b]
        if digest is not None:
            digest.update(units[s : s + step])
