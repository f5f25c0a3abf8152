"""Shard patches over the flat layout: what `encode_state` sends for each changed shard, and
`apply_patch`, which applies one and checks the bytes the receiver ends with.

A delta shard is a lossless XOR delta (rose.weights.xor_delta) by default, or a lossy codec's
body (rose.weights.lossy); a keyframe shard is the raw bytes. A zstd stage is kept only when it
pays. Every patch carries an xxh3-128 checksum of the shard bytes the receiver must end with; a
mismatch means its view diverged. `FORMAT` names the checksum on the wire (entries, delta files);
readers refuse formats they do not know. Why XOR, why xxh3 and what bounds the speed:
docs/weights.md.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import xxhash

from rose.weights import lossy
from rose.weights.layout import Layout
from rose.weights.xor_delta import CorruptPayload, apply_delta_body, changed_units, delta_body

LOSSLESS = "xor"
FORMAT = 2  # 1: blake2b-16 checksums; 2: xxh3-128 checksums (same payloads)
CHECKSUM = "xxh3-128"
_FLAG_ZSTD = 1
_ZSTD_MIN_GAIN = 0.97  # keep zstd output only if it is at most this fraction of the input
_local = threading.local()


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


def encode_delta(old: np.ndarray, new: np.ndarray, unit: int, compress: bool = True) -> bytes | None:
    """The delta turning shard bytes `old` into `new`, or None when they are equal."""
    pos, xor = changed_units(old, new, unit)
    if not len(pos):
        return None
    return _pack(delta_body(pos, xor, unit, len(new) // unit), compress)


def apply_delta(buf: np.ndarray, payload: bytes, digest=None) -> None:
    """XOR a delta into shard bytes `buf` in place (feeding the result to `digest`, if given)."""
    apply_delta_body(buf, _unpack(payload), digest)


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
    encoder = lossy.encoder(codec, **(lossy_options or {})) if codec != LOSSLESS else None

    def one(i: int) -> ShardPatch | None:
        s, e = layout.shard_range(i)
        new = target[s:e]
        if keyframe:
            return ShardPatch(i, "full", "raw", encode_full(new, compress), checksum(new))
        old = view[s:e]
        dtype = layout.shard_dtype(i) if encoder else None
        if encoder and dtype in encoder.dtypes:
            payload = encoder.encode(old, new, dtype)  # updates old in place
            if payload is None:
                return None
            return ShardPatch(i, "delta", codec, _pack(payload, compress), checksum(old))
        unit = int(units[i])
        digest = xxhash.xxh3_128()
        pos, xor = changed_units(old, new, unit, update=True, digest=digest)
        if not len(pos):
            return None
        payload = _pack(delta_body(pos, xor, unit, len(new) // unit), compress)
        return ShardPatch(i, "delta", LOSSLESS, payload, digest.hexdigest(), len(pos))

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
    if patch.kind != "full" and patch.codec == LOSSLESS:
        digest = xxhash.xxh3_128() if verify else None
        apply_delta(buf, patch.payload, digest)  # fed block by block while in cache
        got = digest.hexdigest() if digest is not None else ""
    else:
        if patch.kind == "full":
            apply_full(buf, patch.payload)
        else:
            lossy.apply(patch.codec, buf, _unpack(patch.payload), layout.shard_dtype(patch.shard))
        got = checksum(buf) if verify else ""
    if verify and got != patch.checksum:
        raise ChecksumMismatch(f"shard {patch.shard}: checksum mismatch after applying")
