"""The canonical flat layout of a state dict, and its fixed-size shards.

Tensors are laid out by sorted name, each at an offset aligned to 8 bytes, as their raw
bytes. Shard `i` is the byte range [i*shard_bytes, (i+1)*shard_bytes) of that layout, so
shard ids stay stable across versions while names, shapes and dtypes do not change; any
change of those changes the layout digest and forces a keyframe. Because offsets and shard
sizes are multiples of 8, no element straddles a shard boundary, and each shard can be
compared in units of the narrowest dtype it holds (2 bytes for bf16).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import orjson

ALIGN = 8
DEFAULT_SHARD_BYTES = 8 << 20

# Element width in bytes of every dtype we carry (torch names without the `torch.` prefix).
ITEMSIZE = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex64": 8,
}


class LayoutError(ValueError):
    """Two states whose tensors (names, shapes, dtypes) differ where they must match."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    tensors: tuple[TensorSpec, ...]
    shard_bytes: int
    total: int  # bytes of the flat buffer (padded to ALIGN)

    @property
    def num_shards(self) -> int:
        return -(-self.total // self.shard_bytes)

    def shard_range(self, i: int) -> tuple[int, int]:
        start = i * self.shard_bytes
        return start, min(start + self.shard_bytes, self.total)

    def shard_units(self) -> np.ndarray:
        """Per shard, the narrowest element width of the tensors it overlaps (8 if none)."""
        units = np.full(self.num_shards, ALIGN, dtype=np.int64)
        for t in self.tensors:
            if t.nbytes:
                first, last = t.offset // self.shard_bytes, (t.offset + t.nbytes - 1) // self.shard_bytes
                np.minimum(units[first : last + 1], ITEMSIZE[t.dtype], out=units[first : last + 1])
        return units

    def shard_dtype(self, i: int) -> str | None:
        """The single dtype of shard `i` if exactly one tensor dtype covers it, else None."""
        start, end = self.shard_range(i)
        dtypes = {t.dtype for t in self.tensors if t.nbytes and t.offset < end and t.offset + t.nbytes > start}
        return dtypes.pop() if len(dtypes) == 1 else None

    def to_json(self) -> bytes:
        return orjson.dumps(
            {"shard_bytes": self.shard_bytes, "tensors": [[t.name, t.dtype, list(t.shape)] for t in self.tensors]}
        )

    @property
    def digest(self) -> str:
        return hashlib.blake2b(self.to_json(), digest_size=8).hexdigest()

    def check_same(self, other: Layout) -> None:
        """Raise LayoutError naming the first tensor that differs."""
        if self.digest == other.digest:
            return
        mine = {t.name: t for t in self.tensors}
        theirs = {t.name: t for t in other.tensors}
        for name in sorted(set(mine) | set(theirs)):
            a, b = mine.get(name), theirs.get(name)
            if a is None or b is None:
                raise LayoutError(f"tensor {name!r} is only in the {'second' if a is None else 'first'} state")
            if (a.dtype, a.shape) != (b.dtype, b.shape):
                raise LayoutError(f"tensor {name!r}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
        raise LayoutError(f"shard size {self.shard_bytes} vs {other.shard_bytes}")


def make_layout(specs: Mapping[str, tuple[str, Sequence[int]]], shard_bytes: int = DEFAULT_SHARD_BYTES) -> Layout:
    """Layout of tensors given as {name: (dtype, shape)}."""
    if shard_bytes <= 0 or shard_bytes % ALIGN:
        raise LayoutError(f"shard_bytes must be a positive multiple of {ALIGN}, got {shard_bytes}")
    tensors, offset = [], 0
    for name in sorted(specs):
        dtype, shape = specs[name]
        if dtype not in ITEMSIZE:
            raise LayoutError(f"tensor {name!r}: unsupported dtype {dtype}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[dtype]
        tensors.append(TensorSpec(name, dtype, tuple(int(s) for s in shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return Layout(tuple(tensors), shard_bytes, offset)


def is_count(x: object) -> bool:
    """An int >= 0 that is not a bool: a size, offset or index read from a file's JSON header."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def layout_from_json(raw: bytes | str) -> Layout:
    d = orjson.loads(raw)
    return make_layout({n: (dt, tuple(shape)) for n, dt, shape in d["tensors"]}, d["shard_bytes"])


def flatten(layout: Layout, arrays: Mapping[str, np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """Copy tensors' raw bytes (uint8 arrays, C order) into the flat buffer of `layout`."""
    flat = np.zeros(layout.total, dtype=np.uint8) if out is None else out
    for t in layout.tensors:
        flat[t.offset : t.offset + t.nbytes] = arrays[t.name]
    return flat


def views(layout: Layout, flat: np.ndarray) -> dict[str, np.ndarray]:
    """Each tensor's bytes as a uint8 view into `flat` (no copy)."""
    return {t.name: flat[t.offset : t.offset + t.nbytes] for t in layout.tensors}
