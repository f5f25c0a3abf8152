"""The file `rose weights diff` writes and `rose weights patch` reads.

`ROSEDLT3`, a little-endian u64 header length, a JSON header (layout, checksums of the
whole base and target, the checksum algorithm, the target's file format and metadata, and
per shard: id, kind, codec, payload offset and size, checksum), then the shard payloads
back to back. The digit in the magic is the wire format (`codec.FORMAT`); files of format 2
(`ROSEDLT2`, codec `xor`) still read, others (`ROSEDLT1`: blake2b checksums) are refused with
that reason.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from rose.weights.codec import CHECKSUM, FORMAT, READABLE, ShardPatch
from rose.weights.layout import ITEMSIZE, Layout, LayoutError, is_count, make_layout

_PREFIX = b"ROSEDLT"
MAGIC = _PREFIX + b"%d" % FORMAT


class DeltaFileError(ValueError):
    """Not a delta file, or a truncated one."""


@dataclass
class DeltaFile:
    layout: Layout
    patches: list[ShardPatch]
    base_checksum: str
    target_checksum: str
    format: str
    metadata: dict


def write(path: str | Path, delta: DeltaFile) -> int:
    """Write the file; returns its size in bytes."""
    shards, offset = [], 0
    for p in delta.patches:
        shards.append([p.shard, p.kind, p.codec, offset, len(p.payload), p.checksum])
        offset += len(p.payload)
    header = orjson.dumps(
        {
            "layout": orjson.loads(delta.layout.to_json()),
            "base": delta.base_checksum,
            "target": delta.target_checksum,
            "format": delta.format,
            "metadata": delta.metadata,
            "checksum": CHECKSUM,
            "shards": shards,
        }
    )
    with open(path, "wb") as fh:
        fh.write(MAGIC + struct.pack("<Q", len(header)) + header)
        for p in delta.patches:
            fh.write(p.payload)
    return len(MAGIC) + 8 + len(header) + offset


def read(path: str | Path) -> DeltaFile:
    """Parse a delta file; anything malformed is a DeltaFileError naming the file and the
    first thing wrong (never a huge allocation, a KeyError or a TypeError)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise DeltaFileError(f"{path}: cannot read it ({e.strerror or e})") from None
    if data[:7] != _PREFIX or len(data) < 16:
        raise DeltaFileError(f"{path}: not a ROSE weights delta file")
    if data[:8] not in {_PREFIX + b"%d" % f for f in READABLE}:
        fmt = data[7:8].decode(errors="replace")
        raise DeltaFileError(
            f"{path}: delta file format {fmt} is not supported (this release reads formats "
            f"{', '.join(map(str, READABLE))}, {CHECKSUM} checksums); recreate it with `rose weights diff`"
        )
    (hlen,) = struct.unpack_from("<Q", data, 8)
    if hlen > len(data) - 16:
        raise DeltaFileError(f"{path}: truncated (header length {hlen} exceeds the {len(data) - 16} bytes after it)")
    try:
        return _parse(orjson.loads(data[16 : 16 + hlen]), memoryview(data)[16 + hlen :])
    except _Bad as e:
        raise DeltaFileError(f"{path}: bad header ({e}); recreate it with `rose weights diff`") from None
    except _Truncated as e:
        raise DeltaFileError(f"{path}: truncated ({e})") from None
    except (orjson.JSONDecodeError, LayoutError) as e:
        raise DeltaFileError(f"{path}: bad header ({e}); recreate it with `rose weights diff`") from None


class _Bad(ValueError):
    """A header field of the wrong shape or type."""


class _Truncated(ValueError):
    """A shard whose payload lies beyond the end of the file."""


def _parse(h: Any, body: memoryview) -> DeltaFile:
    if not isinstance(h, dict):
        raise _Bad(f"a JSON {type(h).__name__}, not an object")
    layout = _layout(h.get("layout"))
    shards = h.get("shards")
    if not isinstance(shards, list):
        raise _Bad("shards is not a list")
    patches = [_patch(row, layout, body) for row in shards]
    base, target, fmt = (_field(h, k, str) for k in ("base", "target", "format"))
    meta = h.get("metadata") or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _Bad("metadata is not an object of strings")
    return DeltaFile(layout, patches, base, target, fmt, meta)


def _field(h: dict, key: str, typ: type) -> Any:
    v = h.get(key)
    if not isinstance(v, typ) or isinstance(v, bool):
        raise _Bad(f"{key} is not a {typ.__name__}")
    return v


def _layout(d: Any) -> Layout:
    """The layout of the header, its tensors' shapes checked before any size is computed."""
    if not isinstance(d, dict) or not isinstance(d.get("tensors"), list):
        raise _Bad("layout is not an object with a tensors list")
    sb = _field(d, "shard_bytes", int)
    if not 0 < sb <= _MAX_BYTES:
        raise _Bad(f"layout shard_bytes {sb} out of range")
    specs = {}
    for t in d["tensors"]:
        if not (
            isinstance(t, list) and len(t) == 3 and isinstance(t[0], str) and isinstance(t[1], str) and t[1] in ITEMSIZE
        ):
            raise _Bad("a layout tensor is not [name, dtype, shape]")
        name, dtype, shape = t
        if not isinstance(shape, list) or not all(is_count(n) for n in shape) or math.prod(shape) > _MAX_BYTES:
            raise _Bad(f"tensor {name[:80]!r}: bad shape")
        specs[name] = (dtype, tuple(shape))
    return make_layout(specs, sb)


def _patch(row: Any, layout: Layout, body: memoryview) -> ShardPatch:
    if not (isinstance(row, list) and len(row) == 6):
        raise _Bad("a shard is not [shard, kind, codec, offset, size, checksum]")
    shard, kind, codec, off, size, csum = row
    if not all(is_count(x) for x in (shard, off, size)) or not all(isinstance(x, str) for x in (kind, codec, csum)):
        raise _Bad("a shard has a field of the wrong type")
    if shard >= layout.num_shards:
        raise _Bad(f"shard {shard} outside the layout ({layout.num_shards} shards)")
    if off + size > len(body):
        raise _Truncated(f"shard {shard}")
    return ShardPatch(shard, kind, codec, bytes(body[off : off + size]), csum)


_MAX_BYTES = 1 << 62  # beyond any real tensor or shard; keeps sizes inside int64
