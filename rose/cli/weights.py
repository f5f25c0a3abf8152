"""`rose weights diff|patch|publish|follow`: weight deltas as files and through Redis."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import orjson
import typer

from rose.cli import cli_config, fail

_WORKERS = 2  # threads encoding or applying shards
T = TypeVar("T")

weights_app = typer.Typer(
    help="Sparse, bit-exact weight deltas: files and the Redis weight stream.", no_args_is_help=True
)


def _load(path: Path):
    from rose.weights.checkpoint import CheckpointError, load

    try:
        return load(path)
    except CheckpointError as e:
        fail(str(e))


def _flat(ck, shard_bytes: int):
    from rose.weights.layout import flatten, make_layout

    layout = make_layout(ck.specs, shard_bytes)
    return layout, flatten(layout, ck.arrays)


@weights_app.command("diff")
def diff(
    base: Path = typer.Argument(..., help="The checkpoint the receiver has (.safetensors, .pt, .bin)."),
    target: Path = typer.Argument(..., help="The checkpoint to reach."),
    out: Path = typer.Option(..., "--out", help="Delta file to write."),
    json_out: bool = typer.Option(False, "--json", help="Print the figures as one JSON object."),
    shard_mib: int = typer.Option(8, "--shard-mib", help="Shard size in MiB."),
) -> None:
    """Write the lossless delta from BASE to TARGET."""
    from rose.weights import codec, delta_file
    from rose.weights.layout import LayoutError

    t0 = time.perf_counter()
    b, t = _load(base), _load(target)
    layout, bflat = _flat(b, shard_mib << 20)
    tlayout, tflat = _flat(t, shard_mib << 20)
    try:
        layout.check_same(tlayout)
    except LayoutError as e:
        fail(f"layout mismatch between {base} and {target}: {e}")
    base_sum = codec.checksum(bflat)
    patches, _ = codec.encode_state(layout, bflat, tflat, workers=_WORKERS)
    size = delta_file.write(
        out, delta_file.DeltaFile(layout, patches, base_sum, codec.checksum(tflat), t.format, t.metadata)
    )
    units = layout.shard_units()
    total_units = sum(
        int(e - s) // int(units[i]) for i, (s, e) in enumerate(map(layout.shard_range, range(layout.num_shards)))
    )
    changed = sum(p.changed for p in patches)
    report = {
        "params": sum(x.nbytes // max(1, _itemsize(x.dtype)) for x in layout.tensors),
        "tensors": len(layout.tensors),
        "changed_fraction": changed / total_units if total_units else 0.0,
        "shards_changed": len(patches),
        "shards_total": layout.num_shards,
        "bytes_full": sum(x.nbytes for x in layout.tensors),
        "bytes_delta": size,
        "delta_ratio": size / max(1, sum(x.nbytes for x in layout.tensors)),
        "seconds": round(time.perf_counter() - t0, 4),
    }
    if json_out:
        typer.echo(orjson.dumps(report).decode())
    else:
        typer.echo(
            f"{out}: {size} bytes ({report['delta_ratio']:.4f} of {report['bytes_full']}), "
            f"{report['changed_fraction']:.4%} of elements changed"
        )


def _itemsize(dtype: str) -> int:
    from rose.weights.layout import ITEMSIZE

    return ITEMSIZE[dtype]


@weights_app.command("patch")
def patch(
    base: Path = typer.Argument(..., help="The checkpoint the delta was made from."),
    delta: Path = typer.Argument(..., help="A file written by `rose weights diff`."),
    out: Path = typer.Option(..., "--out", help="Where to write the result (.safetensors or torch)."),
) -> None:
    """Apply DELTA to BASE; OUT equals the diff's TARGET bit for bit."""
    from rose.weights.patch import PatchError, patch_files

    try:
        patch_files(base, delta, out)
    except PatchError as e:
        fail(str(e))


def _weights_side(cfg, make: Callable[[Any], T]) -> T:
    """`make(client)` on the client of `cfg`'s weight streams (`redis_client`: a RedisCluster
    with redis.cluster_nodes, else the Redis at redis.url); one `rose: ...` line and exit 1 for a
    cluster that is not usable, 2 for settings that cannot be (malformed nodes, shard_streams
    out of range, a brace in the model name or key prefix)."""
    from rose.weights.clients import ClusterUnavailable, redis_client

    try:
        return make(redis_client(cfg.redis))
    except ClusterUnavailable as e:
        fail(str(e), 1)
    except ValueError as e:
        fail(str(e))


@weights_app.command("publish")
def publish(
    checkpoints: list[Path] = typer.Argument(..., help="Checkpoints, published as consecutive versions."),
    model: str = typer.Option(..., "--model", help="Model name: the stream is rose:weights:{model}."),
    keyframe_every: int = typer.Option(50, "--keyframe-every", help="A full snapshot every K versions."),
    codec_name: str = typer.Option(
        "zdelta", "--codec", help="zdelta or xor (lossless), topk or int8 (lossy, error feedback)."
    ),
    interval_s: float = typer.Option(0.0, "--interval", help="Seconds between versions."),
    json_out: bool = typer.Option(False, "--json", help="One JSON object per version."),
) -> None:
    """Publish checkpoints as versions of the weight stream."""
    from rose.weights.clients import unavailable_errors
    from rose.weights.stream import WeightPublisher

    if codec_name not in ("zdelta", "xor", "topk", "int8"):
        fail(f"--codec: unknown codec {codec_name!r} (zdelta, xor, topk, int8)")
    cfg = cli_config()
    pub = _weights_side(
        cfg,
        lambda r: WeightPublisher(
            r, cfg.redis, model, keyframe_every=keyframe_every, codec=codec_name, hmac_key=cfg.security.weights_hmac_key
        ),
    )
    for i, path in enumerate(checkpoints):
        ck = _load(path)
        try:
            stats = pub.publish_raw(ck.specs, ck.arrays)
        except unavailable_errors() as e:
            fail(f"redis at {cfg.redis.cluster_nodes or cfg.redis.safe_url}: {type(e).__name__}: {e}")
        if json_out:
            typer.echo(orjson.dumps({"checkpoint": str(path), **stats.__dict__}).decode())
        else:
            typer.echo(
                f"{path}: version {stats.version}, {'keyframe' if stats.keyframe else 'delta'}, "
                f"{stats.bytes_sent} of {stats.bytes_full} bytes"
            )
        if interval_s and i + 1 < len(checkpoints):
            time.sleep(interval_s)


@weights_app.command("follow")
def follow(
    model: str = typer.Option(..., "--model", help="Model name: the stream is rose:weights:{model}."),
    out: Path = typer.Option(..., "--out", help="Directory for weights.safetensors (state + applied seq)."),
    until_version: int = typer.Option(None, "--until-version", help="Exit once this version is applied."),
    idle_s: float = typer.Option(None, "--idle-exit", help="Exit after this many seconds without a new version."),
    metrics_port: int = typer.Option(None, "--metrics-port", help="Serve /metrics and /healthz on this port."),
) -> None:
    """Apply the weight stream exactly once; keep OUT/weights.safetensors at the newest version."""
    from rose.obs import metrics
    from rose.obs.logs import setup_logging
    from rose.shutdown import Shutdown
    from rose.weights.follower import FileStateStore, WeightFollower

    setup_logging()
    cfg = cli_config()
    shutdown = Shutdown.install(name="rose-weights-follow")
    f = _weights_side(
        cfg, lambda r: WeightFollower(r, cfg.redis, model, FileStateStore(out), hmac_key=cfg.security.weights_hmac_key)
    )
    if metrics_port is not None:
        metrics.serve(metrics_port, health=lambda: not shutdown.requested)
    f.follow(until_version=until_version, idle_s=idle_s, stop=shutdown.stop)
    snap = f.receiver.visible()
    typer.echo(
        orjson.dumps(
            {
                "version": snap.version if snap else None,
                **{k: v for k, v in f.stats.__dict__.items() if k != "applied_versions"},
            }
        ).decode()
    )


def register(app: typer.Typer) -> None:
    app.add_typer(weights_app, name="weights")
