"""Applying a delta file to a checkpoint: `rose weights patch`'s work, and what `rose bench
weights` times in-process. Every reason a delta does not apply is one `PatchError` whose message
names the file and the cause, for the user."""

from __future__ import annotations

import time
from pathlib import Path

from rose.weights import codec, delta_file
from rose.weights.checkpoint import CheckpointError, load, save
from rose.weights.layout import LayoutError, flatten, make_layout

WORKERS = 2  # threads applying shards


class PatchError(ValueError):
    """A delta that cannot be applied to this base (the message says why, for the user)."""


def out_format(path: Path) -> str:
    """The checkpoint format a path asks for: safetensors by its suffix, else torch."""
    return "safetensors" if path.suffix == ".safetensors" else "torch"


def patch_files(base: Path, delta: Path, out: Path, workers: int = WORKERS) -> dict[str, float]:
    """Apply the delta file DELTA to the checkpoint BASE and write OUT; seconds per stage."""
    t0 = time.perf_counter()
    if not delta.is_file():
        raise PatchError(f"{delta}: no such file")
    try:
        d = delta_file.read(delta)
        b = load(base)
    except (delta_file.DeltaFileError, CheckpointError) as e:
        raise PatchError(str(e)) from None
    layout = make_layout(b.specs, d.layout.shard_bytes)
    flat = flatten(layout, b.arrays)
    try:
        d.layout.check_same(layout)
    except LayoutError as e:
        raise PatchError(f"layout mismatch between {base} and the delta's base: {e}") from None
    if codec.checksum(flat) != d.base_checksum:
        raise PatchError(f"{base} is not the checkpoint {delta} was made from (checksum differs)")
    t1 = time.perf_counter()
    try:
        codec.apply_patches(layout, flat, d.patches, workers=workers)
    except (codec.ChecksumMismatch, codec.CorruptPayload) as e:
        raise PatchError(f"{delta}: {e}") from None
    if codec.checksum(flat) != d.target_checksum:
        raise PatchError(f"{delta}: result differs from the target (corrupt delta)")
    t2 = time.perf_counter()
    fmt = out_format(out)
    save(out, layout, flat, fmt, d.metadata if fmt == d.format else None)
    return {"load_s": t1 - t0, "apply_s": t2 - t1, "save_s": time.perf_counter() - t2}
