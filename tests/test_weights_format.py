"""The wire format version (checksums, codecs) and the block-wise scan: refusal of unknown formats
with a clear reason, format-2 entries and files still decoded, bit-exact deltas across the scan's
block boundaries."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rose.weights import codec, delta_file, scan, xor_delta
from rose.weights.entries import Entry, UnsupportedFormat, from_fields, to_fields
from rose.weights.follower import Receiver
from rose.weights.layout import make_layout


def _keyframe_fields(fmt: int | None, key: bytes = b""):
    layout = make_layout({"w": ("bfloat16", (64,))}, shard_bytes=128)
    flat = np.arange(layout.total, dtype=np.uint8)
    patch = codec.encode_state(layout, None, flat, keyframe=True)[0][0]
    e = Entry(
        1, 1, "full", 0, 0, 1, "raw", 128, patch.checksum, layout.digest, 1, "ep", patch.payload, layout.to_json()
    )
    fields = to_fields(e)
    if fmt is None:
        del fields[b"format"]
    else:
        fields[b"format"] = b"%d" % fmt
    return fields


def test_entries_carry_the_format_and_unknown_ones_are_refused_with_the_reason():
    assert from_fields(_keyframe_fields(codec.FORMAT)).format == codec.FORMAT
    assert from_fields(_keyframe_fields(2)).format == 2  # format 2 (codec xor) still decodes
    for fmt in (None, 1, codec.FORMAT + 1):  # absent means format 1 (blake2b checksums)
        with pytest.raises(UnsupportedFormat, match="wire format") as err:
            from_fields(_keyframe_fields(fmt))
        assert str(codec.FORMAT) in str(err.value) and codec.CHECKSUM in str(err.value)
    r = Receiver()
    for _ in range(3):
        assert r.offer(_keyframe_fields(1)) is None
    assert r.stats.unsupported == 3 and r.stats.applied_entries == 0 and r.visible() is None
    assert r.offer(_keyframe_fields(codec.FORMAT)) is None and r.stats.applied_entries == 1


def test_old_delta_files_are_refused_with_the_reason(tmp_path):
    layout = make_layout({"w": ("float32", (4,))}, shard_bytes=16)
    path = tmp_path / "d"
    delta_file.write(path, delta_file.DeltaFile(layout, [], "a", "b", "safetensors", {}))
    assert delta_file.read(path).layout.digest == layout.digest
    data = bytearray(path.read_bytes())
    data[7:8] = b"2"  # format 2: the same header, codec xor payloads
    path.write_bytes(bytes(data))
    assert delta_file.read(path).layout.digest == layout.digest
    data[7:8] = b"1"
    path.write_bytes(bytes(data))
    with pytest.raises(delta_file.DeltaFileError, match="format 1 is not supported"):
        delta_file.read(path)


def test_checksum_is_xxh3_of_the_shard_bytes():
    import xxhash

    buf = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    assert codec.checksum(buf) == xxhash.xxh3_128_hexdigest(buf.tobytes())


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    block_words=st.integers(1, 9),
    unit=st.sampled_from([1, 2, 4, 8]),
    density=st.sampled_from([0.0, 0.001, 0.05, 0.6]),
)
def test_scan_and_apply_across_block_boundaries(seed, block_words, unit, density):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scan, "BLOCK", 8 * block_words)  # many blocks per shard, changes at their edges
        for name in (codec.LOSSLESS, codec.XOR):
            _scan_and_apply(np.random.default_rng(seed), unit, density, name)


def _scan_and_apply(rng, unit, density, name):
    n = 8 * int(rng.integers(1, 60))
    old = rng.integers(0, 256, n, dtype=np.uint8)
    new = old.copy()
    hit = rng.random(n) < density
    hit[[0, n - 1]] |= rng.random(2) < 0.5
    new[hit] ^= rng.integers(1, 256, int(hit.sum()), dtype=np.uint8)
    kind = scan.UINT[unit]
    diff = np.flatnonzero(old.view(kind) != new.view(kind))
    pos, xor = xor_delta.changed_units(old, new, unit)
    assert pos.tolist() == diff.tolist()
    assert np.array_equal(xor, old.view(kind)[diff] ^ new.view(kind)[diff])
    layout = make_layout(
        {"t": ({1: "uint8", 2: "bfloat16", 4: "float32", 8: "int64"}[unit], (n // unit,))}, shard_bytes=n
    )
    view = old.copy()
    patches, view = codec.encode_state(layout, view, new, codec=name)
    assert np.array_equal(view, new) and len(patches) == int(bool(len(diff)))
    assert all(p.codec == name for p in patches)
    receiver = old.copy()
    for p in patches:
        assert p.checksum == codec.checksum(new)
        codec.apply_patch(layout, receiver, p)  # verifies the block-wise digest
    assert np.array_equal(receiver, new)
