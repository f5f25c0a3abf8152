"""Fuzzing the readers of user-supplied files: whatever the bytes, the config loader raises only
ConfigError, the safetensors reader only CheckpointError and the delta reader only
DeltaFileError, or they parse. No other exception, no huge allocation, no hang."""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rose.config import ConfigError, load_config
from rose.weights import codec, delta_file
from rose.weights.checkpoint import CheckpointError, load
from rose.weights.layout import ITEMSIZE, flatten, make_layout

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
_TMP = tempfile.TemporaryDirectory(prefix="rose-fuzz-")  # removed at exit
_DIR = Path(_TMP.name)


def _file(name: str, data: bytes) -> Path:
    path = _DIR / name
    path.write_bytes(data)
    return path


# ---- the config loader --------------------------------------------------------------------

_SECTIONS = ["kafka", "redis", "policy", "telemetry", "security", "executor", "rollout", "stack", "tracing", "x"]
_KEYS = ["bootstrap", "partitions", "ttl_s", "grant_streak", "librdkafka", "metrics", "engine", "url", "pool"]
_KEYS += ["weights_hmac_key_file", "command_hmac_key", "model", "period_s", "shard_streams", "nope"]
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.datetimes(),
)
_values = st.recursive(
    _scalars, lambda v: st.lists(v, max_size=3) | st.dictionaries(st.text(max_size=5), v, max_size=3)
)


def _toml_value(v) -> str:
    """A TOML literal for `v` (None as an empty inline table, which TOML has no null for)."""
    if v is None:
        return "{}"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if v != v else ("inf" if v > 0 else "-inf") if v in (float("inf"), float("-inf")) else repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")  # a TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(map(_toml_value, v)) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_value(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return v.isoformat()


def _load(data: bytes) -> None:
    try:
        cfg = load_config(_file("rose.toml", data), env={})
    except ConfigError as e:
        assert "\n" not in str(e)
        return
    for section in dataclasses.fields(cfg):  # a parse holds values of the declared types
        obj = getattr(cfg, section.name)
        for f in dataclasses.fields(obj):
            want = _TYPES.get(str(f.type).split("[")[0])
            assert want is None or isinstance(getattr(obj, f.name), want), (section.name, f.name)


_TYPES = {"int": int, "float": float, "str": str, "Mapping": Mapping}


@FUZZ
@given(st.binary(max_size=400))
def test_config_loader_on_arbitrary_bytes(data):
    _load(data)


@FUZZ
@given(st.dictionaries(st.sampled_from(_SECTIONS), st.dictionaries(st.sampled_from(_KEYS), _values, max_size=4)))
def test_config_loader_on_toml_ish_documents(doc):
    text = "".join(f"[{s}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in kv.items()) for s, kv in doc.items())
    _load(text.encode())


# ---- the safetensors reader -------------------------------------------------------------


def _safetensors_bytes() -> bytes:
    from safetensors.numpy import save

    return save({"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(3, np.int16)}, {"k": "v"})


VALID_ST = _safetensors_bytes()


def _read_st(data: bytes) -> None:
    try:
        ck = load(_file("f.safetensors", data))
    except CheckpointError as e:
        assert "\n" not in str(e)
        return
    for name, (dtype, shape) in ck.specs.items():  # a parse is a consistent one
        assert ck.arrays[name].nbytes == math.prod(shape) * ITEMSIZE[dtype]


_mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, len(VALID_ST) - 1), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, len(VALID_ST)), st.just(0)),
    st.tuples(st.just("hlen"), st.integers(0, (1 << 64) - 1), st.just(0)),
)


def _mutate(valid: bytes, mutations, hlen_at: int = 0) -> bytes:
    b = bytearray(valid)
    for kind, at, x in mutations:
        if kind == "flip" and at < len(b):
            b[at] ^= x
        elif kind == "cut":
            del b[at:]
        elif kind == "hlen" and len(b) >= hlen_at + 8:
            b[hlen_at : hlen_at + 8] = struct.pack("<Q", at)
    return bytes(b)


@FUZZ
@given(st.binary(max_size=300))
def test_safetensors_reader_on_arbitrary_bytes(data):
    _read_st(data)


@FUZZ
@given(st.lists(_mutation, min_size=1, max_size=4))
def test_safetensors_reader_on_mutated_files(mutations):
    _read_st(_mutate(VALID_ST, mutations))


# ---- the delta reader ---------------------------------------------------------------------


def _delta_bytes() -> bytes:
    rng = np.random.default_rng(0)
    specs = {"w": ("float32", (64,)), "b": ("int16", (8,))}
    layout = make_layout(specs, 64)
    base = {n: rng.integers(0, 255, math.prod(s) * ITEMSIZE[d], dtype=np.uint8) for n, (d, s) in specs.items()}
    target = {n: a.copy() for n, a in base.items()}
    target["w"][::7] ^= 1
    bflat, tflat = flatten(layout, base), flatten(layout, target)
    patches, _ = codec.encode_state(layout, bflat, tflat)
    d = delta_file.DeltaFile(layout, patches, codec.checksum(bflat), codec.checksum(tflat), "safetensors", {"k": "v"})
    delta_file.write(_DIR / "valid.rdelta", d)
    return (_DIR / "valid.rdelta").read_bytes()


VALID_DELTA = _delta_bytes()
_delta_mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, len(VALID_DELTA) - 1), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, len(VALID_DELTA)), st.just(0)),
    st.tuples(st.just("hlen"), st.integers(0, (1 << 64) - 1), st.just(0)),
)


def _read_delta(data: bytes) -> None:
    try:
        d = delta_file.read(_file("f.rdelta", data))
    except delta_file.DeltaFileError as e:
        assert "\n" not in str(e)
        return
    assert all(0 <= p.shard < d.layout.num_shards for p in d.patches)


@FUZZ
@given(st.binary(max_size=300))
def test_delta_reader_on_arbitrary_bytes(data):
    _read_delta(delta_file.MAGIC + data if data[:1] == b"\0" else data)


@FUZZ
@given(st.lists(_delta_mutation, min_size=1, max_size=4))
def test_delta_reader_on_mutated_files(mutations):
    _read_delta(_mutate(VALID_DELTA, mutations, hlen_at=len(delta_file.MAGIC)))


def test_the_valid_files_parse():
    assert load(_file("ok.safetensors", VALID_ST)).specs["w"] == ("float32", (3, 4))
    assert len(delta_file.read(_file("ok.rdelta", VALID_DELTA)).patches) >= 1
