"""The file `rose weights diff` writes and `rose weights patch` reads.

`ROSEDLT3`, a little-endian u64 header length, a JSON header (layout, checksums of the
whole base and target, the checksum algorithm, the target's file format and metadata, and
per shard: id, kind, codec, payload offset and size, checksum), then the shard payloads
back to back. The digit in the magic is the wire format (`codec.FORMAT`); files of format 2
(`ROSEDLT2`, codec `xor`) still read, others (`ROSEDLT1`: blake2b checksums) are refused with
that reason.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import orjson

from rose.weights.codec import CHECKSUM, FORMAT, READABLE, ShardPatch
from rose.weights.layout import Layout, layout_from_json

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
    data = Path(path).read_bytes()
    if data[:7] != _PREFIX or len(data) < 16:
        raise DeltaFileError(f"{path}: not a ROSE weights delta file")
    if data[:8] not in {_PREFIX + b"%d" % f for f in READABLE}:
        fmt = data[7:8].decode(errors="replace")
        raise DeltaFileError(
            f"{path}: delta file format {fmt} is not supported (this release reads formats "
            f"{', '.join(map(str, READABLE))}, {CHECKSUM} checksums); recreate it with `rose weights diff`"
        )
    (hlen,) = struct.unpack_from("<Q", data, 8)
    try:
        h = orjson.loads(data[16 : 16 + hlen])
        layout = layout_from_json(orjson.dumps(h["layout"]))
        body = memoryview(data)[16 + hlen :]
        patches = []
        for shard, kind, codec, off, size, csum in h["shards"]:
            if off + size > len(body):
                raise DeltaFileError(f"{path}: truncated (shard {shard})")
            patches.append(ShardPatch(shard, kind, codec, bytes(body[off : off + size]), csum))
        return DeltaFile(layout, patches, h["base"], h["target"], h["format"], h.get("metadata") or {})
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        if isinstance(e, DeltaFileError):
            raise
        raise DeltaFileError(f"{path}: bad header ({e})") from None
