"""State dicts and checkpoint files <-> raw tensor bytes (safetensors and torch .pt/.bin).

Safetensors files are read by parsing their header and mapping the data (no torch, no
copy); they are written with the safetensors library's serializer, as are the files we compare
with, straight from the flat buffer. torch is imported only where a torch tensor or a torch
file is involved.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rose.weights.layout import ITEMSIZE, Layout, is_count

_ST_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
    "C64": "complex64",
}
_NP_DTYPES = {
    "bool",
    "uint8",
    "int8",
    "int16",
    "uint16",
    "float16",
    "int32",
    "uint32",
    "float32",
    "int64",
    "uint64",
    "float64",
    "complex64",
}


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read as a flat mapping of tensors."""


@dataclass
class Checkpoint:
    specs: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape)
    arrays: dict[str, np.ndarray]  # name -> raw bytes (uint8, C order)
    format: str  # "safetensors" | "torch"
    metadata: dict[str, str] = field(default_factory=dict)


def tensor_bytes(value: Any) -> tuple[str, tuple[int, ...], np.ndarray]:
    """(dtype, shape, raw uint8 bytes) of a torch tensor or numpy array; a view when possible."""
    if isinstance(value, np.ndarray):
        name = value.dtype.name
        if name not in _NP_DTYPES:
            raise CheckpointError(f"unsupported numpy dtype {name}")
        return name, value.shape, np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    import torch

    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"expected a tensor, got {type(value).__name__}")
    dtype = str(value.dtype).removeprefix("torch.")
    if dtype not in ITEMSIZE:
        raise CheckpointError(f"unsupported tensor dtype {dtype}")
    t = value.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return dtype, tuple(value.shape), t.view(torch.uint8).numpy()


def from_state_dict(state: Mapping[str, Any]) -> tuple[dict, dict]:
    """(specs, arrays) of a state dict of torch tensors or numpy arrays."""
    specs, arrays = {}, {}
    for name, value in state.items():
        try:
            dtype, shape, raw = tensor_bytes(value)
        except CheckpointError as e:
            raise CheckpointError(f"tensor {name!r}: {e}") from None
        specs[name], arrays[name] = (dtype, shape), raw
    return specs, arrays


def to_tensors(layout: Layout, flat: np.ndarray) -> dict:
    """torch tensors viewing the flat buffer (no copy)."""
    import torch

    out = {}
    for t in layout.tensors:
        raw = torch.from_numpy(flat[t.offset : t.offset + t.nbytes])
        out[t.name] = raw.view(getattr(torch, t.dtype)).reshape(t.shape)
    return out


MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit on the JSON header


def _read_safetensors(path: Path) -> Checkpoint:
    """Parse the header and map the data; a file that breaks the format is a CheckpointError
    naming the file and the first thing wrong (never a huge allocation or a bare KeyError)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            hlen, doc = _st_header(fh, size)
        meta, entries = _st_entries(doc, size - 8 - hlen)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or e})") from None
    except _Corrupt as e:
        raise CheckpointError(f"{path}: not a valid safetensors file ({e}); re-create or re-download it") from None
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + hlen) if size > 8 + hlen else np.zeros(0, np.uint8)
    specs, arrays = {}, {}
    for name, (dtype, shape, start, end) in entries.items():
        specs[name] = (dtype, shape)
        arrays[name] = data[start:end]
    return Checkpoint(specs, arrays, "safetensors", meta)


class _Corrupt(ValueError):
    """What is wrong with a safetensors file's header (becomes a CheckpointError)."""


def _st_header(fh, size: int) -> tuple[int, dict]:
    """(header length, the header's JSON object), the length checked against the file."""
    head = fh.read(8)
    if len(head) < 8:
        raise _Corrupt(f"{size} bytes, shorter than the 8-byte header length")
    (hlen,) = struct.unpack("<Q", head)
    if hlen > min(size - 8, MAX_HEADER_BYTES):
        raise _Corrupt(f"header length {hlen} exceeds the {size - 8} bytes after it or {MAX_HEADER_BYTES}")
    try:
        doc = json.loads(fh.read(hlen))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, huge numbers
        raise _Corrupt(f"header is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise _Corrupt(f"header is a JSON {type(doc).__name__}, not an object")
    return hlen, doc


def _st_entries(doc: dict, data_bytes: int) -> tuple[dict[str, str], dict[str, tuple]]:
    """(metadata, name -> (dtype, shape, start, end)) of a header, each entry checked."""
    meta = _st_metadata(doc.get("__metadata__"))
    entries = {name: _st_entry(name, info, data_bytes) for name, info in doc.items() if name != "__metadata__"}
    return meta, entries


def _st_metadata(info: Any) -> dict[str, str]:
    if info is None:
        return {}
    if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
        raise _Corrupt("__metadata__ is not an object of strings")
    return dict(info)


def _st_entry(name: str, info: Any, data_bytes: int) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, start, end) of one tensor entry, checked against the data section."""
    if not isinstance(info, dict):
        raise _Corrupt(f"tensor {_short(name)}: entry is not an object")
    dtype = _ST_DTYPES.get(info["dtype"]) if isinstance(info.get("dtype"), str) else None
    if dtype is None:
        raise _Corrupt(f"tensor {_short(name)}: unsupported or missing dtype {_short(info.get('dtype'))}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(is_count(d) for d in shape):
        raise _Corrupt(f"tensor {_short(name)}: shape {_short(shape)} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_count(o) for o in offsets):
        raise _Corrupt(
            f"tensor {_short(name)}: data_offsets {_short(offsets)} is not a [start, end] pair of non-negative integers"
        )
    start, end = offsets
    if not start <= end <= data_bytes:
        raise _Corrupt(
            f"tensor {_short(name)}: data_offsets [{start}, {end}] outside the {data_bytes}-byte data section"
        )
    nbytes = ITEMSIZE[dtype] * math.prod(shape)
    if end - start != nbytes:
        raise _Corrupt(
            f"tensor {_short(name)}: {end - start} bytes of data for {dtype}{_short(shape)} ({nbytes} bytes)"
        )
    return dtype, tuple(shape), start, end


def _short(x: Any, limit: int = 80) -> str:
    """repr(x) cut to `limit` characters: a corrupt header must not flood the error line."""
    r = repr(x)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def load(path: str | os.PathLike) -> Checkpoint:
    """Read a .safetensors or torch checkpoint (a flat mapping of name -> tensor)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        with open(path, "rb") as fh:
            head = fh.read(16)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or e})") from None
    if path.suffix == ".safetensors" or (len(head) >= 9 and head[8:9] == b"{"):
        return _read_safetensors(path)
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a bad file
        raise CheckpointError(f"{path}: cannot read as a torch checkpoint ({str(e).splitlines()[0]})") from None
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path}: expected a flat mapping of name -> tensor")
    specs, arrays = from_state_dict(obj)
    return Checkpoint(specs, arrays, "torch", _torch_container(path, list(obj)))


def _torch_container(path: Path, keys: list[str]) -> dict[str, str]:
    """What a torch file's bytes depend on beyond its tensors: the zip's archive folder (torch
    names it after the file it saved to) and the mapping's key order (pickled in order).
    Carried in deltas so that `patch` rewrites the target byte for byte."""
    import zipfile

    try:
        first = zipfile.ZipFile(path).namelist()[0]
    except (zipfile.BadZipFile, IndexError):
        return {"torch.keys": json.dumps(keys)}
    return {"torch.archive": first.split("/", 1)[0], "torch.keys": json.dumps(keys)}


def _save_safetensors(path: Path, layout: Layout, flat: np.ndarray, metadata: Mapping[str, str] | None) -> None:
    """The safetensors library's own serializer (the bytes `safetensors.torch.save_file` writes),
    fed straight from the flat buffer: no torch, no copy."""
    import safetensors

    spec = getattr(safetensors, "TensorSpec", None)  # safetensors >= 0.8 takes pointers, older ones bytes
    tensors: dict[str, Any] = {}
    for t in layout.tensors:
        raw = flat[t.offset : t.offset + t.nbytes]
        shape = list(t.shape)
        if spec is not None:
            tensors[t.name] = spec(dtype=t.dtype, shape=shape, data_ptr=raw.ctypes.data, data_len=t.nbytes)
        else:
            tensors[t.name] = {"dtype": t.dtype, "shape": shape, "data": raw.tobytes()}
    safetensors.serialize_file(tensors, str(path), metadata=dict(metadata) if metadata else None)


def save(
    path: str | os.PathLike, layout: Layout, flat: np.ndarray, fmt: str, metadata: Mapping[str, str] | None = None
) -> None:
    """Write the state in `flat` as a checkpoint, atomically (temp file + rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    if fmt == "safetensors":
        _save_safetensors(tmp, layout, flat, metadata)
    else:
        import tempfile

        import torch

        tensors = to_tensors(layout, flat)

        meta = metadata or {}
        if "torch.keys" in meta:
            order = json.loads(meta["torch.keys"])
            if sorted(order) == sorted(tensors):
                tensors = {k: tensors[k] for k in order}
        archive = meta.get("torch.archive")
        if archive and archive.replace("_", "").replace("-", "").replace(".", "").isalnum():
            # torch.save names the zip's folder after the file's stem: save under that name
            with tempfile.TemporaryDirectory(dir=path.parent) as d:
                named = Path(d) / f"{archive}.pt"
                torch.save(tensors, named)
                os.replace(named, tmp)
        else:
            with open(tmp, "wb") as fh:  # a file object: the archive is named "archive"
                torch.save(tensors, fh)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
