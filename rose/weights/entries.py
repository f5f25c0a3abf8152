"""The Redis stream entry of the weight stream (docs/contract.md §6), and its HMAC.

Fields (all bytes): seq, version, kind (full | delta | commit), shard, part, parts, codec,
raw (bytes of the whole shard), size (bytes of this part's payload), sum (hex checksum of
the shard after applying), layout (layout digest), vstart (seq of the version's first
entry), epoch (the publisher lineage), format (the wire format, `codec.FORMAT`: it fixes the
checksum algorithm and the codecs a reader must know; absent means 1), payload, optionally layout_json (the first entry of a
keyframe version) and sig (hex HMAC-SHA256 over every other field, length-prefixed, sorted).
The stream entry id is `0-{seq}`, so Redis itself refuses a second entry with the same seq.
An entry of a format this reader does not know is refused (`UnsupportedFormat`), never
applied: its checksums or codec would not decode and would look like divergence. Entries of
format 2 (codec `xor`) still decode.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

from rose.weights.codec import CHECKSUM, FORMAT, READABLE

KINDS = ("full", "delta", "commit")
_INT_FIELDS = ("seq", "version", "shard", "part", "parts", "raw", "size", "vstart")
_READABLE = {b"%d" % f for f in READABLE}


class InvalidEntry(ValueError):
    """An entry that must not be applied; `refused` marks a missing or wrong signature."""

    def __init__(self, reason: str, refused: bool = False):
        super().__init__(reason)
        self.refused = refused


class UnsupportedFormat(InvalidEntry):
    """An entry written in a wire format this reader does not know (another release)."""

    def __init__(self, fmt: str):
        super().__init__(
            f"entry wire format {fmt!r} is not supported: this reader knows formats "
            f"{', '.join(map(str, READABLE))} ({CHECKSUM} checksums; it writes format {FORMAT}); run the "
            "publisher and followers at the same release"
        )
        self.format = fmt


@dataclass(frozen=True)
class Entry:
    seq: int
    version: int
    kind: str
    shard: int
    part: int
    parts: int
    codec: str
    raw: int
    checksum: str
    layout: str
    vstart: int
    epoch: str
    payload: bytes
    layout_json: bytes = b""
    format: int = FORMAT

    @property
    def stream_id(self) -> str:
        return f"0-{self.seq}"


def signature(fields: dict[bytes, bytes], key: bytes) -> str:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for k in sorted(fields):
        if k == b"sig":
            continue
        v = fields[k]
        mac.update(struct.pack("<I", len(k)) + k + struct.pack("<Q", len(v)))
        mac.update(v)
    return mac.hexdigest()


def to_fields(e: Entry, key: bytes = b"") -> dict[bytes, bytes]:
    f = {
        b"seq": b"%d" % e.seq,
        b"version": b"%d" % e.version,
        b"kind": e.kind.encode(),
        b"shard": b"%d" % e.shard,
        b"part": b"%d" % e.part,
        b"parts": b"%d" % e.parts,
        b"codec": e.codec.encode(),
        b"raw": b"%d" % e.raw,
        b"size": b"%d" % len(e.payload),
        b"sum": e.checksum.encode(),
        b"layout": e.layout.encode(),
        b"vstart": b"%d" % e.vstart,
        b"epoch": e.epoch.encode(),
        b"format": b"%d" % e.format,
        b"payload": e.payload,
    }
    if e.layout_json:
        f[b"layout_json"] = e.layout_json
    if key:
        f[b"sig"] = signature(f, key).encode()
    return f


def from_fields(fields: dict, key: bytes = b"") -> Entry:
    """Decode a stream entry; with a key, verify its signature first (InvalidEntry(refused=True))."""
    f = {
        (k.encode() if isinstance(k, str) else k): (v.encode() if isinstance(v, str) else v) for k, v in fields.items()
    }
    if key:
        sig = f.get(b"sig")
        if sig is None:
            raise InvalidEntry("unsigned entry", refused=True)
        if not hmac.compare_digest(sig, signature(f, key).encode()):
            raise InvalidEntry("wrong signature", refused=True)
    fmt = f.get(b"format", b"1")
    if fmt not in _READABLE:
        raise UnsupportedFormat(fmt.decode(errors="replace"))
    try:
        ints = {n: int(f[n.encode()]) for n in _INT_FIELDS}
        kind = f[b"kind"].decode()
        e = Entry(
            kind=kind,
            codec=f[b"codec"].decode(),
            checksum=f[b"sum"].decode(),
            layout=f[b"layout"].decode(),
            epoch=f[b"epoch"].decode(),
            payload=f[b"payload"],
            layout_json=f.get(b"layout_json", b""),
            format=int(fmt),
            **{n: ints[n] for n in _INT_FIELDS if n != "size"},
        )
    except (KeyError, ValueError, UnicodeDecodeError) as err:
        raise InvalidEntry(f"malformed entry ({err!r})") from None
    if kind not in KINDS or ints["size"] != len(e.payload) or not 0 <= e.part < e.parts:
        raise InvalidEntry(f"malformed entry seq {e.seq}: kind {kind!r}, part {e.part}/{e.parts}")
    return e
