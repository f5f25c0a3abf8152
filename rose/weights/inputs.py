"""What a weight publisher is given, as the raw tensors it sends: a state dict (torch tensors or
numpy arrays) or a safetensors checkpoint (one file, or an HF `save_pretrained` directory,
sharded or not), floating-point tensors cast to a named dtype on the way.

`tensors(weights, dtype)` is the one path from either to `WeightPublisher.publish_raw`'s
(specs, arrays); `RoseClient.publish_weights` (rose.client) and the gateway's
`POST /v1/weights` (rose.gateway) both publish through it. Every input it refuses raises
ValueError whose message starts with the argument at fault (`weights:` or `dtype:`).
torch is imported only for a state dict of torch tensors or a cast.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    import torch

# the dtypes floating-point tensors are cast to, and the only ones cast from (fp8, int and bool
# tensors are published as they are)
CAST_DTYPES = ("bfloat16", "float16", "float32")
_FLOATS = frozenset({"bfloat16", "float16", "float32", "float64"})
_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def dtype_name(dtype: Any) -> str | None:
    """'bfloat16' for torch.bfloat16 or 'bfloat16' (or 'bf16'/'fp16'/'fp32'); None keeps each tensor's dtype."""
    if dtype is None:
        return None
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in CAST_DTYPES:
        raise ValueError(f"dtype: expected one of torch.{', torch.'.join(CAST_DTYPES)} or None, got {dtype!r}")
    return name


def tensors(weights: Mapping[str, Any] | str | os.PathLike, dtype: Any) -> tuple[dict, dict]:
    """(specs, arrays) for `WeightPublisher.publish_raw`: `weights` is a state dict or a path to a
    .safetensors file or a checkpoint directory; floating-point tensors are cast to `dtype`
    (`dtype_name`; None publishes each as it is)."""
    target = dtype_name(dtype)
    if isinstance(weights, str | os.PathLike):
        return checkpoint_tensors(Path(weights), target)
    if isinstance(weights, Mapping):
        return state_dict_tensors(weights, target)
    raise ValueError(
        f"weights: expected a state dict or a path to a safetensors checkpoint, got {type(weights).__name__}"
    )


def state_dict_tensors(state: Mapping[str, Any], target: str | None) -> tuple[dict, dict]:
    """(specs, arrays) of a state dict, each floating-point tensor cast to `target`."""
    import numpy as np
    import torch

    from rose.weights.checkpoint import CheckpointError, from_state_dict

    if not state:
        raise ValueError("weights: the state dict is empty")
    out: dict[str, Any] = {}
    for name, v in state.items():
        if not isinstance(name, str):
            raise ValueError(f"weights: tensor names must be strings, got {name!r}")
        if isinstance(v, np.ndarray) and target is not None and v.dtype.name in _FLOATS:
            v = torch.from_numpy(v)
        if isinstance(v, torch.Tensor):
            v = v.detach()
            if target is not None and str(v.dtype).removeprefix("torch.") in _FLOATS:
                v = v.to(getattr(torch, target))
        out[name] = v
    try:
        return from_state_dict(out)
    except CheckpointError as e:
        raise ValueError(f"weights: {e}") from None


def safetensors_files(path: Path) -> list[Path]:
    """The .safetensors files of a checkpoint: the file itself, or a directory's (by its
    `*.safetensors.index.json` when there is one)."""
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"weights: {path} is not a .safetensors file")
        return [path]
    if not path.is_dir():
        raise ValueError(f"weights: {path}: no such file or directory")
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise ValueError(f"weights: {path} holds {len(indexes)} safetensors index files; name one checkpoint file")
    if indexes:
        try:
            weight_map = orjson.loads(indexes[0].read_bytes())["weight_map"]
            names = list(dict.fromkeys(str(f) for f in weight_map.values()))
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"weights: {indexes[0]}: not a safetensors index ({e})") from None
        files = [path / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"weights: {indexes[0]} names missing files: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"weights: no .safetensors file in {path}")
    return files


def checkpoint_tensors(path: Path, target: str | None) -> tuple[dict, dict]:
    """(specs, arrays) of a safetensors checkpoint, its floating-point tensors cast to `target`
    (the others, and those already in `target`, as the file's bytes)."""
    from rose.weights.checkpoint import CheckpointError, load, tensor_bytes

    specs: dict[str, tuple] = {}
    arrays: dict[str, Any] = {}
    for f in safetensors_files(path):
        try:
            ck = load(f)
        except CheckpointError as e:
            raise ValueError(f"weights: {e}") from None
        for name, (dt, shape) in ck.specs.items():
            if name in specs:
                raise ValueError(f"weights: tensor {name!r} is in more than one file of {path}")
            raw = ck.arrays[name]
            if target is not None and dt in _FLOATS and dt != target:
                dt, shape, raw = tensor_bytes(_cast(raw, dt, shape, target))
            specs[name], arrays[name] = (dt, tuple(shape)), raw
    if not specs:
        raise ValueError(f"weights: {path} holds no tensors")
    return specs, arrays


def _cast(raw: Any, dtype: str, shape: tuple, target: str) -> torch.Tensor:
    import numpy as np
    import torch

    buf = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True))  # off the read-only map, aligned
    return buf.view(getattr(torch, dtype)).reshape(shape).to(getattr(torch, target))
