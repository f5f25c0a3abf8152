"""Shard patches over the flat layout: what `encode_state` sends for each changed shard, and
`apply_patch`, which applies one and checks the bytes the receiver ends with.

A delta shard is lossless by default: `zdelta` (rose.weights.zdelta: entropy-coded gaps and
integer differences), or the older `xor` (rose.weights.xor_delta), still decoded and sent on
request; or a lossy codec's body (rose.weights.lossy). A keyframe shard is the raw bytes. Every
patch carries an xxh3-128 checksum of the shard bytes the receiver must end with; a mismatch
means its view diverged. `FORMAT` is the wire format written (entries, delta files): it names
the checksum and the codecs a reader must know; readers take the formats in `READABLE` and
refuse the others. Buffers are numpy arrays, or torch tensors on a device (the trainer's GPU)
for the lossless codecs. Why these codings, and what bounds the speed: docs/weights.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np
import xxhash

from rose.weights import lossy, scan, zdelta
from rose.weights.layout import Layout
from rose.weights.xor_delta import CorruptPayload, apply_delta_body, changed_units, decode_delta_body, delta_body

LOSSLESS = zdelta.NAME  # the default codec
XOR = "xor"  # the lossless codec of format 2
FORMAT = 3  # 1: blake2b-16 checksums; 2: xxh3-128 checksums; 3: format 2 plus the zdelta codec
READABLE = (2, 3)
CHECKSUM = "xxh3-128"
_FLAG_ZSTD = 1


class ChecksumMismatch(ValueError):
    """The shard bytes after applying differ from the sender's: the receiver's view diverged."""


@dataclass(frozen=True)
class ShardPatch:
    shard: int
    kind: str  # "full" | "delta"
    codec: str  # "raw" for full shards, else the delta codec
    payload: bytes
    checksum: str  # hex xxh3-128 of the shard bytes after applying
    changed: int = 0  # elements (units) sent; informational


def checksum(buf: np.ndarray | bytes) -> str:
    """Hex xxh3-128 of a contiguous buffer (no copy)."""
    # numpy's stubs declare ndarray's buffer protocol (__buffer__) only for Python >= 3.12
    return xxhash.xxh3_128_hexdigest(buf)  # type: ignore[arg-type]


# -- zstd stage of xor, lossy and full shards ----------------------------------------------


def _pack(body: bytes, compress: bool) -> bytes:
    if compress and len(body) > 64:
        c = zdelta.zstd()[0].compress(body)
        if len(c) < len(body) * zdelta.ZSTD_MIN_GAIN:
            return bytes([_FLAG_ZSTD]) + c
    return b"\x00" + body


def _unpack(payload: bytes) -> bytes:
    if not payload:
        raise CorruptPayload("empty payload")
    if payload[0] & _FLAG_ZSTD:
        try:
            return zdelta.zstd()[1].decompress(payload[1:])
        except Exception as e:  # zstandard.ZstdError
            raise CorruptPayload(f"zstd: {e}") from None
    return payload[1:]


# -- one shard --------------------------------------------------------------------------


def encode_delta(old: np.ndarray, new: np.ndarray, unit: int, compress: bool = True) -> bytes | None:
    """The `xor` delta turning shard bytes `old` into `new`, or None when they are equal."""
    pos, xor = changed_units(old, new, unit)
    if not len(pos):
        return None
    return _pack(delta_body(pos, xor, unit, len(new) // unit), compress)


def apply_delta(buf: np.ndarray, payload: bytes, digest=None) -> None:
    """XOR an `xor` delta into shard bytes `buf` in place (feeding the result to `digest`, if given)."""
    apply_delta_body(buf, _unpack(payload), digest)


def encode_full(new: np.ndarray, compress: bool = True) -> bytes:
    return _pack(new.tobytes(), compress)


def apply_full(buf, payload: bytes) -> None:
    """Write a full shard's bytes into `buf` (a numpy array or a device tensor)."""
    body = _unpack(payload)
    if len(body) != len(buf):
        raise CorruptPayload(f"full shard of {len(body)} bytes, expected {len(buf)}")
    raw = np.frombuffer(body, dtype=np.uint8)
    if scan.is_tensor(buf):
        import torch

        buf.copy_(torch.from_numpy(raw.copy()))
    else:
        buf[:] = raw


def _lossless_body(pos: np.ndarray, old: np.ndarray, new: np.ndarray, unit: int, n: int, codec: str, compress: bool):
    if codec == XOR:
        return _pack(delta_body(pos, old ^ new, unit, n // unit), compress)
    return b"\x00" + zdelta.encode(pos, old, new, unit, compress)  # its streams carry their own zstd


# -- a whole state ------------------------------------------------------------------------


def _map(fn, items: Iterable, workers: int) -> list:
    items = list(items)
    if workers > 1 and len(items) > 1:
        with ThreadPoolExecutor(min(workers, len(items))) as ex:
            return list(ex.map(fn, items))
    return [fn(i) for i in items]


def encode_state(
    layout: Layout,
    view,
    target,
    *,
    keyframe: bool = False,
    codec: str = LOSSLESS,
    compress: bool = True,
    workers: int = 1,
    lossy_options: dict | None = None,
):
    """Patches that bring the receiver's `view` to `target`, and the receiver's new view.

    Lossless: the new view is `target` itself. Lossy codecs: the view the receiver will
    actually hold (error feedback: what was not sent stays in target - view and goes next
    time). `view` is updated in place when given; unchanged shards yield no patch. `view` and
    `target` are flat uint8 numpy arrays, or (lossless codecs) torch tensors on one device:
    then the shards are compared there and only the changed elements and the checksummed
    bytes come to the host. `workers` threads encode shards in parallel.
    """
    device = scan.is_tensor(target)
    if device and codec not in (LOSSLESS, XOR):
        raise ValueError(f"codec {codec!r} needs numpy buffers; device tensors take {LOSSLESS} or {XOR}")
    if keyframe or view is None:
        if view is None:
            view = target.clone() if device else target.copy()
        elif view is not target:
            view.copy_(target) if device else np.copyto(view, target)
    units = layout.shard_units()
    encoder = lossy.encoder(codec, **(lossy_options or {})) if codec not in (LOSSLESS, XOR) else None

    def one(i: int) -> ShardPatch | None:
        s, e = layout.shard_range(i)
        new = target[s:e]
        if keyframe:
            host = scan.host_bytes(new)
            return ShardPatch(i, "full", "raw", encode_full(host, compress), checksum(host))
        old = view[s:e]
        dtype = layout.shard_dtype(i) if encoder else None
        if encoder and dtype in encoder.dtypes:
            payload = encoder.encode(old, new, dtype)  # updates old in place
            if payload is None:
                return None
            return ShardPatch(i, "delta", codec, _pack(payload, compress), checksum(old))
        unit = int(units[i])
        if device:
            pos, o, n = scan.changed_t(old, new, unit, update=True)
            sums = None
        else:
            sums = xxhash.xxh3_128()
            pos, o, n = scan.changed(old, new, unit, update=True, digest=sums)
        if not len(pos):
            return None
        name = XOR if codec == XOR else LOSSLESS
        payload = _lossless_body(pos, o, n, unit, e - s, name, compress)
        digest = sums.hexdigest() if sums is not None else checksum(scan.host_bytes(new))
        return ShardPatch(i, "delta", name, payload, digest, len(pos))

    patches = _map(one, range(layout.num_shards), workers)
    return [p for p in patches if p is not None], view


def apply_patch(layout: Layout, flat, patch: ShardPatch, verify: bool = True) -> None:
    """Apply one shard patch to the flat buffer (numpy, or a torch tensor on a device for the
    lossless codecs) in place; check the resulting bytes."""
    if not 0 <= patch.shard < layout.num_shards:
        raise CorruptPayload(f"shard {patch.shard} outside the layout ({layout.num_shards} shards)")
    s, e = layout.shard_range(patch.shard)
    buf = flat[s:e]
    device = scan.is_tensor(buf)
    got = ""
    if patch.kind != "full" and patch.codec in (LOSSLESS, XOR):
        body = _unpack(patch.payload)
        combine: Callable[[np.ndarray, np.ndarray], np.ndarray]
        if patch.codec == LOSSLESS:
            unit, pos, values = zdelta.decode(body, e - s)
            combine = partial(zdelta.updated, unit=unit)
        else:
            unit, pos, values = decode_delta_body(body, e - s)
            combine = np.bitwise_xor
        if device:
            scan.write_t(buf, unit, pos, values, combine)
        else:
            digest = xxhash.xxh3_128() if verify else None
            scan.write(buf, unit, pos, values, combine, digest)  # fed block by block while in cache
            got = digest.hexdigest() if digest is not None else ""
    elif patch.kind == "full":
        apply_full(buf, patch.payload)
    elif device:
        raise CorruptPayload(f"codec {patch.codec!r} is applied to numpy buffers only")
    else:
        lossy.apply(patch.codec, buf, _unpack(patch.payload), layout.shard_dtype(patch.shard))
    if verify and not got:
        got = checksum(scan.host_bytes(buf))
    if verify and got != patch.checksum:
        raise ChecksumMismatch(f"shard {patch.shard}: checksum mismatch after applying")


def apply_patches(
    layout: Layout, flat, patches: Iterable[ShardPatch], *, verify: bool = True, workers: int = 1
) -> None:
    """`apply_patch` of patches of distinct shards, `workers` threads in parallel."""
    _map(lambda p: apply_patch(layout, flat, p, verify), patches, workers)
