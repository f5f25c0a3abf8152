"""The pure codec: bit-exact deltas over many versions, any dtype; realistic sparsity; lossy convergence."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rose.weights import codec, xor_delta
from rose.weights.layout import ITEMSIZE, LayoutError, flatten, layout_from_json, make_layout

DTYPES = ["bfloat16", "float32", "float16", "int64", "uint8", "int32"]


def _random_state(rng, n_tensors):
    specs = {}
    for i in range(n_tensors):
        dtype = DTYPES[rng.integers(len(DTYPES))]
        shape = tuple(int(x) for x in rng.integers(0, 40, size=rng.integers(0, 3)))
        specs[f"t{i:02d}"] = (dtype, shape)
    return specs


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), shard_words=st.integers(1, 64), versions=st.integers(1, 12), compress=st.booleans())
def test_many_versions_bit_exact(seed, shard_words, versions, compress):
    rng = np.random.default_rng(seed)
    specs = _random_state(rng, int(rng.integers(1, 8)))
    layout = make_layout(specs, shard_bytes=8 * shard_words)
    target = rng.integers(0, 256, layout.total, dtype=np.uint8)
    target = flatten(layout, {t.name: target[t.offset : t.offset + t.nbytes] for t in layout.tensors})
    patches, view = codec.encode_state(layout, None, target, keyframe=True, compress=compress)
    receiver = np.zeros(layout.total, dtype=np.uint8)
    for p in patches:
        codec.apply_patch(layout, receiver, p)
    assert np.array_equal(receiver, target)
    for _ in range(versions):
        target = target.copy()
        for t in layout.tensors:  # random changes in random tensors (hence random shards)
            if t.nbytes and rng.random() < 0.5:
                k = int(rng.integers(1, t.nbytes + 1))
                idx = rng.integers(t.offset, t.offset + t.nbytes, size=k)
                target[idx] = rng.integers(0, 256, size=k, dtype=np.uint8)
        patches, view = codec.encode_state(layout, view, target, compress=compress, workers=int(rng.integers(1, 3)))
        changed = {
            i
            for i in range(layout.num_shards)
            if not np.array_equal(receiver[slice(*layout.shard_range(i))], target[slice(*layout.shard_range(i))])
        }
        assert {p.shard for p in patches} == changed  # unchanged shards are skipped
        for p in patches:
            codec.apply_patch(layout, receiver, p)
        assert np.array_equal(receiver, target) and np.array_equal(view, target)


@given(st.lists(st.integers(0, 2**35 - 1), max_size=200))
def test_varint_round_trip(values):
    arr = np.array(values, dtype=np.int64)
    assert xor_delta.varint_decode(xor_delta.varint_encode(arr), len(arr)).tolist() == values


def test_bitmap_chosen_for_dense_changes_and_round_trips():
    rng = np.random.default_rng(1)
    old = rng.integers(0, 256, 4096, dtype=np.uint8)
    new = old.copy()
    new[::3] ^= 1  # dense: the bitmap is smaller than the index list
    payload = codec.encode_delta(old, new, 2, compress=False)
    assert payload[1] == 1  # mode byte after the flags byte: bitmap
    buf = old.copy()
    codec.apply_delta(buf, payload)
    assert np.array_equal(buf, new)


def test_checksum_catches_a_diverged_receiver():
    layout = make_layout({"w": ("bfloat16", (1000,))}, shard_bytes=512)
    rng = np.random.default_rng(2)
    a = rng.integers(0, 256, layout.total, dtype=np.uint8)
    b = a.copy()
    b[10] ^= 4
    patches, _ = codec.encode_state(layout, a.copy(), b)
    wrong = a.copy()
    wrong[11] ^= 1  # receiver's bytes differ from the sender's view
    with pytest.raises(codec.ChecksumMismatch):
        codec.apply_patch(layout, wrong, patches[0])


def test_layout_shards_stable_and_mismatch_named():
    a = make_layout({"x": ("float32", (10,)), "y": ("bfloat16", (3, 3))}, shard_bytes=16)
    assert layout_from_json(a.to_json()).digest == a.digest
    assert all(t.offset % 8 == 0 for t in a.tensors) and a.shard_units().tolist()[-1] == 2
    b = make_layout({"x": ("float32", (10,)), "y": ("float16", (3, 3))}, shard_bytes=16)
    with pytest.raises(LayoutError, match="'y'"):
        a.check_same(b)


def test_realistic_rl_update_is_sparse():
    pytest.importorskip("torch")
    from rose.weights.checkpoint import from_state_dict
    from rose.weights.rl_update import AdamLikeTrainer

    trainer = AdamLikeTrainer({"w1": 600_000, "w2": 400_000, "bias": 1000}, lr=2e-6)
    for _ in range(10):
        trainer.step()
    specs, arrays = from_state_dict(trainer.bf16())
    layout = make_layout(specs, shard_bytes=256 << 10)
    _, view = codec.encode_state(layout, None, flatten(layout, arrays), keyframe=True)
    receiver = view.copy()
    for _ in range(3):
        trainer.step()
        target = flatten(layout, from_state_dict(trainer.bf16())[1])
        patches, view = codec.encode_state(layout, view, target)
        changed = sum(p.changed for p in patches) / 1_001_000
        ratio = sum(len(p.payload) for p in patches) / layout.total
        assert 0.005 < changed < 0.04, changed
        assert ratio < 0.05 and ratio < 2.2 * changed, (ratio, changed)
        for p in patches:
            codec.apply_patch(layout, receiver, p)
        assert np.array_equal(receiver, target)


@pytest.mark.parametrize("name,steps", [("topk", 60), ("int8", 30)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_lossy_error_feedback_converges(name, steps, dtype):
    rng = np.random.default_rng(3)
    n = 20_000
    np_dtype = {"bfloat16": np.float32, "float16": np.float16, "float32": np.float32}[dtype]
    layout = make_layout({"w": (dtype, (n,)), "i": ("int64", (7,))}, shard_bytes=8192)

    def state(x):
        from rose.weights.lossy import from_f32

        raw = (
            from_f32(x.astype(np.float32), dtype).view(np.uint8)
            if dtype == "bfloat16"
            else x.astype(np_dtype).view(np.uint8)
        )
        return flatten(layout, {"w": raw, "i": np.arange(7, dtype=np.int64).view(np.uint8)})

    x = rng.standard_normal(n).astype(np.float32)
    base = state(x)
    target = state(x + rng.standard_normal(n).astype(np.float32) * 0.01)
    target[-56:] = np.arange(7, 14, dtype=np.int64).view(np.uint8)  # a non-float tensor goes lossless
    view, receiver = base.copy(), base.copy()
    for step in range(steps):
        patches, view = codec.encode_state(
            layout, view, target, codec=name, lossy_options={"frac": 0.1} if name == "topk" else None
        )
        for p in patches:
            codec.apply_patch(layout, receiver, p)
        assert np.array_equal(receiver, view)  # the sender mirrors the receiver exactly
        if step == 0:
            assert not np.array_equal(receiver, target) or name == "int8"
        if np.array_equal(receiver, target):
            break
    assert np.array_equal(receiver, target), f"{name} did not converge in {steps} steps"


def test_every_dtype_has_a_width():
    assert set(DTYPES) <= set(ITEMSIZE)
