"""The XOR delta body of one shard: which elements changed, and their bits XORed with the old ones.

A body holds only the elements (units of the shard's narrowest dtype) whose bits changed: their
positions, as LEB128 varints of the gaps or as a bitmap, whichever is smaller, and their values
XORed with the receiver's old bits, stored as byte planes (all low bytes, then all high bytes).
It is the lossless codec `xor` of wire format 2 (rose.weights.codec still decodes it and sends
it on request; `zdelta` replaced it as the default), and the lossy codecs (rose.weights.lossy)
send the elements they choose in this form. Pure numpy, no Python loops over elements; the
varints here serve zdelta too. Why XOR then, and how a shard is scanned: docs/weights.md.
"""

from __future__ import annotations

import struct

import numpy as np

from rose.weights import scan

_MODE_VARINT, _MODE_BITMAP = 0, 1
_HEAD = struct.Struct("<BBxxII")  # mode, unit, count, index bytes
_VARINT_MAX = 10  # bytes of the largest LEB128 value (2**64 - 1)


class CorruptPayload(ValueError):
    """A payload that cannot be decoded."""


# -- varints ---------------------------------------------------------------------------


def varint_encode(values: np.ndarray) -> np.ndarray:
    """LEB128 of non-negative integers (< 2**64), vectorised.

    Gaps between changed elements are mostly below 128 (one byte each), so the full-length
    work is a few passes; the bytes beyond the first of larger values are inserted and
    filled as a (small) subset.
    """
    v = values.astype(np.uint64, copy=False)
    idx = np.flatnonzero(v >= 0x80)
    low = v.astype(np.uint8) & 0x7F
    if not len(idx):
        return low
    vb = v[idx]
    nb = np.ones(len(idx), dtype=np.int64)  # bytes of each large value
    for k in range(1, _VARINT_MAX):
        nb += vb >= np.uint64(1 << (7 * k))
    low[idx] |= 0x80
    extra = nb - 1
    out = np.insert(low, np.repeat(idx + 1, extra), 0)
    first = idx + np.cumsum(extra) - extra  # where each large value starts in `out`
    for k in range(1, _VARINT_MAX):
        sel = np.flatnonzero(nb > k)
        if not len(sel):
            break
        byte = (vb[sel] >> np.uint64(7 * k)).astype(np.uint8) & 0x7F
        out[first[sel] + k] = byte | ((nb[sel] > k + 1).astype(np.uint8) << 7)
    return out


def varint_decode(buf: np.ndarray, count: int) -> np.ndarray:
    """Inverse of varint_encode (as int64: values of 2**63 and above wrap, and the callers'
    range checks refuse them); full-length work only on the (few) continuation bytes."""
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
    if j.max() >= _VARINT_MAX - 1:
        raise CorruptPayload(f"varint longer than {_VARINT_MAX} bytes")
    low = np.add.reduceat((buf[cont] & 0x7F).astype(np.uint64) << (7 * j).astype(np.uint64), starts)
    vals = np.delete(buf, cont).astype(np.uint64)  # the last byte of every value
    which = cont[starts] - starts  # value index of each multi-byte value
    vals[which] = (vals[which] << (7 * np.diff(np.append(starts, m))).astype(np.uint64)) | low
    return vals.view(np.int64)


# -- one shard --------------------------------------------------------------------------


def changed_units(
    old: np.ndarray, new: np.ndarray, unit: int, *, update: bool = False, digest=None
) -> tuple[np.ndarray, np.ndarray]:
    """Positions (in units) of the elements that differ, and their XORed bits, in one pass over
    the shard (rose.weights.scan.changed)."""
    pos, o, n = scan.changed(old, new, unit, update=update, digest=digest)
    o ^= n
    return pos, o


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


def decode_delta_body(body: bytes, n_bytes: int) -> tuple[int, np.ndarray, np.ndarray]:
    """(unit, positions, XORed bits) of a body for a shard of `n_bytes` bytes."""
    if len(body) < _HEAD.size:
        raise CorruptPayload("delta shorter than its header")
    mode, unit, count, ilen = _HEAD.unpack_from(body)
    if unit not in scan.UINT or n_bytes % unit or len(body) != _HEAD.size + ilen + count * unit:
        raise CorruptPayload(f"delta header does not match its size (unit {unit}, count {count})")
    raw = np.frombuffer(body, dtype=np.uint8)
    index = raw[_HEAD.size : _HEAD.size + ilen]
    if mode == _MODE_VARINT:
        pos = varint_decode(index, count)
        pos += 1
        np.cumsum(pos, out=pos)
        pos -= 1
    elif mode == _MODE_BITMAP:
        pos = np.flatnonzero(np.unpackbits(index, count=n_bytes // unit))
    else:
        raise CorruptPayload(f"unknown index mode {mode}")
    if len(pos) != count or (count and (pos[0] < 0 or pos[-1] >= n_bytes // unit)):
        raise CorruptPayload("delta positions outside the shard")
    xor = np.ascontiguousarray(raw[_HEAD.size + ilen :].reshape(unit, count).T).view(scan.UINT[unit]).ravel()
    return unit, pos, xor


def apply_delta_body(buf: np.ndarray, body: bytes, digest=None) -> None:
    """XOR a body into shard bytes `buf` in place (feeding the result to `digest`, if given)."""
    unit, pos, xor = decode_delta_body(body, len(buf))
    scan.write(buf, unit, pos, xor, np.bitwise_xor, digest)
