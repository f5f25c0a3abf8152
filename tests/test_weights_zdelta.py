"""The zdelta codec (entropy-coded gaps and integer differences): bit-exact for any bits of any
width, corrupt payloads refused, format-2 (`xor`) entries and files still applied, the torch
kernels (device path) equal to the numpy ones, threads equal to one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rose.weights import codec, delta_file, scan, zdelta
from rose.weights.entries import to_fields
from rose.weights.follower import Receiver
from rose.weights.layout import make_layout

DTYPE = {1: "uint8", 2: "bfloat16", 4: "float32", 8: "int64"}


def _pair(rng, unit: int, n_units: int, density: float, wide: bool):
    """Old and new shard bytes: `density` of the units changed, by one step in sign-magnitude
    order (a float's neighbour) or, with `wide`, to any bits."""
    kind = scan.UINT[unit]
    old = rng.integers(0, 256, n_units * unit, dtype=np.uint8)
    new = old.copy()
    hit = np.flatnonzero(rng.random(n_units) < density)
    units = new.view(kind)
    if wide:
        units[hit] = rng.integers(0, 256, len(hit) * unit, dtype=np.uint8).view(kind)
    else:
        step = rng.choice(np.array([1, 2, 3, -1, -2], dtype=np.int64), len(hit)).astype(kind)
        units[hit] = zdelta.order(zdelta.order(units[hit], unit) + step, unit)
    return old, new


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    unit=st.sampled_from([1, 2, 4, 8]),
    n_words=st.integers(1, 400),
    density=st.sampled_from([0.0, 0.002, 0.02, 0.3, 1.0]),
    wide=st.booleans(),
    compress=st.booleans(),
)
def test_round_trip_is_bit_exact(seed, unit, n_words, density, wide, compress):
    rng = np.random.default_rng(seed)
    n_units = n_words * 8 // unit
    old, new = _pair(rng, unit, n_units, density, wide)
    pos, o, n = scan.changed(old, new, unit)
    body = zdelta.encode(pos, o, n, unit, compress)
    got_unit, got_pos, d = zdelta.decode(body, len(old))
    assert got_unit == unit and got_pos.tolist() == pos.tolist()
    assert np.array_equal(zdelta.updated(o, d, unit), n)
    layout = make_layout({"t": (DTYPE[unit], (n_units,))}, shard_bytes=8 * max(1, n_words // 3))
    view, receiver = old.copy(), old.copy()
    patches, view = codec.encode_state(layout, view, new, compress=compress, workers=2)
    assert all(p.codec == codec.LOSSLESS for p in patches)
    codec.apply_patches(layout, receiver, patches, workers=2)
    assert np.array_equal(view, new) and np.array_equal(receiver, new)


def test_extremes_round_trip():
    """Gaps far past the escape, every unit changed, differences of half the range and sign flips."""
    for unit in (1, 2, 4, 8):
        kind = scan.UINT[unit]
        n = (1 << 22) // unit
        old = np.zeros(n * unit, dtype=np.uint8)
        new = old.copy()
        top = np.iinfo(kind).max
        u = new.view(kind)
        u[[0, 1, n // 2, n - 1]] = [top, 1 << (8 * unit - 1), top >> 1, 1]  # -0 vs +0, extremes
        dense = np.full(4096, 0x55, dtype=np.uint8), np.full(4096, 0xAA, dtype=np.uint8)
        for o, nw in ((old, new), (new, old), dense):
            pos, a, b = scan.changed(o, nw, unit)
            _, got_pos, d = zdelta.decode(zdelta.encode(pos, a, b, unit), len(o))
            assert got_pos.tolist() == pos.tolist() and np.array_equal(zdelta.updated(a, d, unit), b)


def test_realistic_step_is_smaller_than_xor_and_close_to_its_entropy():
    pytest.importorskip("torch")
    from rose.weights.checkpoint import from_state_dict
    from rose.weights.layout import flatten
    from rose.weights.rl_update import AdamLikeTrainer

    trainer = AdamLikeTrainer({"w": 2_000_000}, lr=1e-6)
    for _ in range(20):
        trainer.step()
    specs, arrays = from_state_dict(trainer.bf16())
    layout = make_layout(specs)
    base = flatten(layout, arrays)
    trainer.step()
    target = flatten(layout, from_state_dict(trainer.bf16())[1])
    sizes = {}
    for name in (codec.LOSSLESS, codec.XOR):
        patches, _ = codec.encode_state(layout, base.copy(), target, codec=name)
        sizes[name] = sum(len(p.payload) for p in patches)
    units = base.view(np.uint16)
    new = target.view(np.uint16)
    changed = units != new
    p = changed.mean()
    d = zdelta.order(new[changed], 2).astype(np.int64) - zdelta.order(units[changed], 2).astype(np.int64)
    _, counts = np.unique(d, return_counts=True)
    q = counts / counts.sum()
    entropy_bits = len(units) * -(p * np.log2(p) + (1 - p) * np.log2(1 - p)) + changed.sum() * -(q * np.log2(q)).sum()
    assert sizes[codec.LOSSLESS] < 0.9 * sizes[codec.XOR]
    assert sizes[codec.LOSSLESS] * 8 < 1.08 * entropy_bits, (sizes, entropy_bits / 8)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31), what=st.sampled_from(["flip", "truncate", "extend", "header"]))
def test_corrupt_payloads_are_refused_never_misapplied(seed, what):
    rng = np.random.default_rng(seed)
    layout = make_layout({"w": ("bfloat16", (20_000,))}, shard_bytes=40_000)
    old, new = _pair(rng, 2, 20_000, 0.05, bool(seed % 2))
    (patch,), _ = codec.encode_state(layout, old.copy(), new)
    data = bytearray(patch.payload)
    if what == "flip":
        i = int(rng.integers(0, len(data)))
        data[i] ^= int(rng.integers(1, 256))
    elif what == "truncate":
        data = data[: int(rng.integers(0, len(data)))]
    elif what == "extend":
        data += bytes(rng.integers(0, 256, int(rng.integers(1, 9)), dtype=np.uint8))
    else:
        data[1 + int(rng.integers(0, 24))] ^= 1 << int(rng.integers(0, 8))
    bad = codec.ShardPatch(patch.shard, patch.kind, patch.codec, bytes(data), patch.checksum)
    buf = old.copy()
    try:
        codec.apply_patch(layout, buf, bad)
    except (codec.CorruptPayload, codec.ChecksumMismatch):
        return
    assert np.array_equal(buf, new)  # the change did not matter (e.g. a byte zstd ignores)


class _Sink:
    """Just enough of a Redis client for WeightPublisher to build its entries."""

    def hget(self, *a):
        return None


def _stream(layout, states, codec_name: str, fmt: int):
    from rose.config import RedisConfig
    from rose.weights.stream import WeightPublisher

    pub = WeightPublisher(_Sink(), RedisConfig(), "m", shard_bytes=layout.shard_bytes, chunk_bytes=1000)
    pub._epoch = "e"
    fields, view = [], None
    for version, target in enumerate(states, 1):
        keyframe = view is None
        patches, view = codec.encode_state(layout, view, target, keyframe=keyframe, codec=codec_name)
        for e in pub._entries(layout, version, patches, keyframe):
            fields.append(to_fields(e.__class__(**{**e.__dict__, "format": fmt})))
            pub._seq = e.seq
    return fields


def test_format_2_xor_stream_and_a_format_3_stream_both_apply():
    rng = np.random.default_rng(5)
    layout = make_layout({"w": ("bfloat16", (30_000,)), "b": ("float32", (100,))}, shard_bytes=8192)
    states = [rng.integers(0, 256, layout.total, dtype=np.uint8)]
    for _ in range(4):
        s = states[-1].copy()
        s[rng.integers(0, layout.total, 500)] ^= 1
        states.append(s)
    for name, fmt in ((codec.XOR, 2), (codec.LOSSLESS, 3)):
        r = Receiver()
        for f in _stream(layout, states, name, fmt):
            r.offer(f)
        assert r.stats.applied_versions == [1, 2, 3, 4, 5], (name, r.stats)
        assert np.array_equal(r.visible().flat, states[-1])


def test_format_2_delta_file_still_patches(tmp_path):
    pytest.importorskip("safetensors")
    from rose.weights.checkpoint import save
    from rose.weights.patch import patch_files

    rng = np.random.default_rng(6)
    layout = make_layout({"w": ("bfloat16", (50_000,))}, shard_bytes=16384)
    base = rng.integers(0, 256, layout.total, dtype=np.uint8)
    target = base.copy()
    target[rng.integers(0, layout.total, 800)] ^= 2
    save(tmp_path / "base.safetensors", layout, base, "safetensors")
    save(tmp_path / "target.safetensors", layout, target, "safetensors")
    patches, _ = codec.encode_state(layout, base.copy(), target, codec=codec.XOR)
    dfile = delta_file.DeltaFile(layout, patches, codec.checksum(base), codec.checksum(target), "safetensors", {})
    delta_file.write(tmp_path / "d", dfile)
    data = bytearray((tmp_path / "d").read_bytes())
    data[7:8] = b"2"  # as format 2 wrote it
    (tmp_path / "d").write_bytes(bytes(data))
    patch_files(tmp_path / "base.safetensors", tmp_path / "d", tmp_path / "out.safetensors")
    assert Path(tmp_path / "out.safetensors").read_bytes() == (tmp_path / "target.safetensors").read_bytes()


def _device_round_trip(device: str) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    layout = make_layout(
        {"w": ("bfloat16", (40_000,)), "f": ("float32", (3000,)), "i": ("int64", (100,)), "c": ("uint8", (13,))},
        shard_bytes=8192,
    )
    old = rng.integers(0, 256, layout.total, dtype=np.uint8)
    new = old.copy()
    new[rng.integers(0, layout.total, 2000)] += 1
    for name in (codec.LOSSLESS, codec.XOR):
        host, host_view = codec.encode_state(layout, old.copy(), new, codec=name)
        view_t = torch.from_numpy(old.copy()).to(device)
        dev, view_t = codec.encode_state(layout, view_t, torch.from_numpy(new).to(device), codec=name)
        assert dev == host and np.array_equal(view_t.cpu().numpy(), new)  # same payloads, same checksums
        buf = torch.from_numpy(old.copy()).to(device)
        codec.apply_patches(layout, buf, dev, workers=2)
        assert np.array_equal(buf.cpu().numpy(), new)
    keyframes, _ = codec.encode_state(layout, None, torch.from_numpy(new).to(device), keyframe=True)
    zeros = torch.zeros(layout.total, dtype=torch.uint8, device=device)
    for p in keyframes:
        codec.apply_patch(layout, zeros, p)
    assert np.array_equal(zeros.cpu().numpy(), new)
    with pytest.raises(ValueError, match="numpy"):
        codec.encode_state(layout, view_t, torch.from_numpy(new).to(device), codec="topk")


def test_device_kernels_match_the_numpy_ones_on_cpu_tensors():
    _device_round_trip("cpu")


@pytest.mark.cuda
def test_device_kernels_on_cuda():
    _device_round_trip("cuda")
