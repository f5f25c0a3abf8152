"""Weight deltas: bytes per RL step vs a full bf16 broadcast over a learning-rate sweep, encode/apply vs memcpy, `rose weights patch` on a 108M pair, publish->applied via Redis, lossy codecs."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from rose.weights.checkpoint import from_state_dict, load, save
from rose.weights.layout import flatten, make_layout
from rose.weights.lossy import from_f32, to_f32
from rose.weights.rl_update import AdamLikeTrainer

GOAL_BYTES_RATIO = 0.01  # lossless bytes sent / full bf16 broadcast per realistic RL step (Adam, lr 1e-6)
GOAL_ENCODE_OVER_MEMCPY = 0.5  # GB/s of the sender's encode / GB/s of memcpy on the same buffers
GOAL_APPLY_OVER_MEMCPY = 0.5
GOAL_PATCH_S = 1.5  # `rose weights patch` on a 108M-parameter pair, end to end
GOAL_LR = 1e-6
LRS = (1e-7, 1e-6, 1e-5)
# Adam's first, bias-corrected steps are up to 4x larger; by step 20 the update size is near its steady state
WARMUP_STEPS = 20
WORKERS = 2  # threads encoding or applying shards, as the publisher and `rose weights patch` run
PATCH_PARAMS = 108_000_000
ADAM_NOISE_STEP = 0.229  # |update| / lr of steady-state Adam on noise gradients: sqrt((1 - b1) / (1 + b1))


def _sizes(params: int) -> dict[str, int]:
    """A transformer-like mix: a few big matrices and small vectors."""
    return {f"layer{i}.w": params // 8 - 4096 for i in range(8)} | {f"layer{i}.norm": 4096 for i in range(8)}


def _flat_state(trainer):
    specs, arrays = from_state_dict(trainer.bf16())
    layout = make_layout(specs)
    return layout, flatten(layout, arrays)


def _paired(f, reset, memcpy, repeat: int = 3) -> tuple[float, float]:
    """Best wall time of `f` and of `memcpy`, alternated so that both see the same load; `reset`
    (not timed) runs before each `f`."""
    best_f = best_m = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        memcpy()
        best_m = min(best_m, time.perf_counter() - t)
        reset()
        t = time.perf_counter()
        f()
        best_f = min(best_f, time.perf_counter() - t)
    return best_f, best_m


def _copier(dst: np.ndarray, src: np.ndarray, threads: int, pool: ThreadPoolExecutor):
    """memcpy of `src` into `dst` on `threads` threads (contiguous slices; np.copyto releases the
    GIL), the reference for a stage run on as many threads."""
    if threads == 1:
        return lambda: np.copyto(dst, src)
    bounds = np.linspace(0, len(src), threads + 1).astype(int)
    parts = [(dst[a:b], src[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    return lambda: list(pool.map(lambda p: np.copyto(*p), parts))


def _ratio(patches, layout) -> float:
    return sum(len(p.payload) for p in patches) / sum(t.nbytes for t in layout.tensors)


def run(cfg, quick: bool) -> dict:
    out: dict = {"cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2)}
    params = 10_000_000 if quick else 100_000_000
    trainer = AdamLikeTrainer(_sizes(params), lr=GOAL_LR)
    for _ in range(WARMUP_STEPS):
        trainer.step()
    out.update(_speed(trainer, params))
    out.update(_lr_sweep(2_000_000 if quick else 8_000_000))
    out.update(_patch_figures(PATCH_PARAMS // 10 if quick else PATCH_PARAMS))
    out.update(_redis_figures(cfg, trainer, quick))
    out.update(_lossy_figures(trainer, min(params, 12_500_000)))
    out["goals_not_met"] = _not_met(out)
    return out


# -- encode / apply speed ------------------------------------------------------------------


def _speed(trainer, params: int) -> dict:
    """One lossless step at lr 1e-6 past Adam's start-up, encoded and applied as the publisher
    and the receiver do (WORKERS threads, best of 3 on reset copies) and on one thread, each
    beside memcpy of the same bytes on as many threads, measured between its runs; then the
    stages alone, on one thread."""
    with ThreadPoolExecutor(WORKERS) as pool:
        return _speed_on(trainer, params, pool)


def _speed_on(trainer, params: int, pool: ThreadPoolExecutor) -> dict:
    from rose.weights import codec

    layout, view = _flat_state(trainer)
    trainer.step()
    target = _flat_state(trainer)[1]
    full = sum(t.nbytes for t in layout.tensors)
    scratch, work, rwork = np.empty_like(view), np.empty_like(view), np.empty_like(view)
    memcpy, memcpy1 = _copier(scratch, view, WORKERS, pool), _copier(scratch, view, 1, pool)
    reset_sender = lambda: np.copyto(work, view)  # noqa: E731
    enc_s, enc_m = _paired(lambda: codec.encode_state(layout, work, target, workers=WORKERS), reset_sender, memcpy)
    enc1_s, enc1_m = _paired(lambda: codec.encode_state(layout, work, target, workers=1), reset_sender, memcpy1)
    reset_sender()
    patches, _ = codec.encode_state(layout, work, target, workers=WORKERS)
    assert np.array_equal(work, target)
    reset_receiver = lambda: np.copyto(rwork, view)  # noqa: E731
    app_s, app_m = _paired(lambda: codec.apply_patches(layout, rwork, patches, workers=WORKERS), reset_receiver, memcpy)
    app1_s, app1_m = _paired(lambda: codec.apply_patches(layout, rwork, patches, workers=1), reset_receiver, memcpy1)
    assert np.array_equal(rwork, target)
    gbps = lambda s: full / s / 1e9  # noqa: E731
    ratio = _ratio(patches, layout)
    return {
        "params": params,
        "bytes_full_bf16": full,
        "lr": GOAL_LR,
        "warmup_steps": WARMUP_STEPS,
        "changed_fraction": round(sum(p.changed for p in patches) / (full // 2), 5),
        "bytes_ratio_per_step": round(ratio, 5),
        "bytes_ratio_goal": GOAL_BYTES_RATIO,
        "bytes_ratio_over_goal": round(ratio / GOAL_BYTES_RATIO, 3),
        "memcpy_threads": WORKERS,  # every ratio's memcpy runs on as many threads as its stage
        "memcpy_gb_per_s": round(gbps(min(enc_m, app_m)), 3),
        "memcpy_1_thread_gb_per_s": round(gbps(min(enc1_m, app1_m)), 3),
        "encode_memcpy_gb_per_s": round(gbps(enc_m), 3),  # the memcpy paired with encode, same buffers
        "encode_gb_per_s": round(gbps(enc_s), 3),
        "encode_workers": WORKERS,
        "encode_over_memcpy": round(enc_m / enc_s, 4),
        "encode_over_memcpy_goal": GOAL_ENCODE_OVER_MEMCPY,
        "encode_1_worker_over_memcpy": round(enc1_m / enc1_s, 4),  # beside a 1-thread memcpy
        "apply_gb_per_s": round(gbps(app_s), 3),
        "apply_workers": WORKERS,
        "apply_over_memcpy": round(app_m / app_s, 4),
        "apply_over_memcpy_goal": GOAL_APPLY_OVER_MEMCPY,
        "apply_1_worker_over_memcpy": round(app1_m / app1_s, 4),
        "stages_over_memcpy": _stages(layout, view, target, patches),
    }


def _stages(layout, view, target, patches) -> dict:
    """The sender's and the receiver's stages alone over the whole state, on one thread, each as
    a multiple of memcpy's speed (time of memcpy / time of the stage)."""
    import xxhash

    from rose.weights import codec, scan, zdelta

    ranges = [layout.shard_range(i) for i in range(layout.num_shards)]
    units = layout.shard_units()
    words = [(view[s:e].view(np.uint64), target[s:e].view(np.uint64)) for s, e in ranges]
    masks = [a != b for a, b in words]
    found = [scan.changed(view[s:e], target[s:e], int(units[i])) for i, (s, e) in enumerate(ranges)]
    bodies = [codec._unpack(p.payload) for p in patches]
    scratch = np.empty_like(view)
    stages = {
        "compare_words": lambda: [np.not_equal(a, b, out=m) for (a, b), m in zip(words, masks)],
        "extract_indices": lambda: [np.flatnonzero(m) for m in masks],
        "checksum": lambda: xxhash.xxh3_128_hexdigest(target.data),
        "scan": lambda: [scan.changed(view[s:e], target[s:e], int(units[i])) for i, (s, e) in enumerate(ranges)],
        "code_changed": lambda: [zdelta.encode(*f, int(units[i])) for i, f in enumerate(found) if len(f[0])],
        "decode_changed": lambda: [zdelta.decode(b, e - s) for b, (s, e) in zip(bodies, ranges)],
    }
    out = {}
    for name, f in stages.items():
        t, m = _paired(f, lambda: None, lambda: np.copyto(scratch, view))
        out[name] = round(m / t, 3)
    return out


# -- bytes per step over a learning-rate sweep ---------------------------------------------------


def _lr_sweep(params: int, steps: int = 3) -> dict:
    """Per lr: lossless bytes per step / full bf16 broadcast, zdelta and the format-2 xor codec,
    past Adam's start-up (mean of `steps` steps after WARMUP_STEPS) and during it (steps 4-5)."""
    from rose.weights import codec

    sweep = {}
    for lr in LRS:
        trainer = AdamLikeTrainer(_sizes(params), lr=lr, seed=1)
        layout, view = _flat_state(trainer)
        startup: list[float] = []
        steady: list[float] = []
        steady_xor: list[float] = []
        changed: list[float] = []
        for step in range(1, WARMUP_STEPS + steps + 1):
            trainer.step()
            target = _flat_state(trainer)[1]
            if step in (4, 5) or step > WARMUP_STEPS:
                patches, _ = codec.encode_state(layout, view.copy(), target, workers=WORKERS)
                (startup if step <= 5 else steady).append(_ratio(patches, layout))
                if step > WARMUP_STEPS:
                    xor, _ = codec.encode_state(layout, view.copy(), target, codec=codec.XOR, workers=WORKERS)
                    steady_xor.append(_ratio(xor, layout))
                    changed.append(sum(p.changed for p in patches) / (layout.total // 2))
            view = target
        sweep[f"{lr:g}"] = {
            "bytes_ratio": round(float(np.mean(steady)), 5),
            "bytes_ratio_xor": round(float(np.mean(steady_xor)), 5),
            "bytes_ratio_steps_4_5": round(float(np.mean(startup)), 5),
            "changed_fraction": round(float(np.mean(changed)), 5),
            "bits_per_changed_element": round(float(np.mean(steady)) * 16 / float(np.mean(changed)), 2),
        }
    return {"lr_sweep_params": params, "bytes_ratio_by_lr": sweep}


# -- rose weights patch on a 108M-parameter pair -----------------------------------------------------


def _write_pair(d: Path, params: int) -> None:
    """base.safetensors and target.safetensors: bf16 weights N(0, 0.02) and one steady-state Adam
    step at lr 1e-6 on their fp32 masters."""
    rng = np.random.default_rng(0)
    sizes = _sizes(params)
    layout = make_layout({n: ("bfloat16", (s,)) for n, s in sizes.items()})
    base, target = np.empty(layout.total, np.uint8), np.empty(layout.total, np.uint8)
    for t in layout.tensors:
        n = t.shape[0]
        w = rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)
        base[t.offset : t.offset + t.nbytes] = from_f32(w, "bfloat16").view(np.uint8)
        w += rng.standard_normal(n, dtype=np.float32) * np.float32(GOAL_LR * ADAM_NOISE_STEP)
        target[t.offset : t.offset + t.nbytes] = from_f32(w, "bfloat16").view(np.uint8)
    save(d / "base.safetensors", layout, base, "safetensors", {"format": "pt"})
    save(d / "target.safetensors", layout, target, "safetensors", {"format": "pt"})


def _patch_figures(params: int, runs: int = 3) -> dict:
    """`rose weights diff` in-process, then `rose weights patch` `runs` times in-process (its
    function: read, apply, write) and `runs` times as a fresh process (interpreter start and
    imports included): the median and range of each one's wall time, the process's CPU time."""
    import resource

    from rose.weights import codec, delta_file
    from rose.weights.patch import patch_files

    with tempfile.TemporaryDirectory(prefix="rose-bench-weights-") as tmp:
        d = Path(tmp)
        _write_pair(d, params)
        base, target = load(d / "base.safetensors"), load(d / "target.safetensors")
        layout = make_layout(base.specs)
        bflat, tflat = flatten(layout, base.arrays), flatten(layout, target.arrays)
        del base, target
        patches, _ = codec.encode_state(layout, bflat.copy(), tflat, workers=WORKERS)
        dfile = delta_file.DeltaFile(
            layout, patches, codec.checksum(bflat), codec.checksum(tflat), "safetensors", {"format": "pt"}
        )
        delta_bytes = delta_file.write(d / "d.delta", dfile)
        changed = sum(p.changed for p in patches)
        del bflat, tflat
        want = (d / "target.safetensors").read_bytes()
        fn_wall, stages = [], []
        for _ in range(runs):
            t = time.perf_counter()
            stages.append(patch_files(d / "base.safetensors", d / "d.delta", d / "out.safetensors"))
            fn_wall.append(time.perf_counter() - t)
            assert (d / "out.safetensors").read_bytes() == want, "patched file differs from the target"
        cmd = [sys.executable, "-m", "rose.cli", "weights", "patch", str(d / "base.safetensors"), str(d / "d.delta")]
        cli_wall, cli_cpu = [], []
        for _ in range(runs):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t = time.perf_counter()
            subprocess.run([*cmd, "--out", str(d / "cli.safetensors")], check=True, capture_output=True)
            cli_wall.append(time.perf_counter() - t)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cli_cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
            assert (d / "cli.safetensors").read_bytes() == want, "patched file differs from the target"
    at_goal = params == PATCH_PARAMS
    fn, cli = statistics.median(fn_wall), statistics.median(cli_wall)
    return {
        "patch_params": params,
        "patch_changed_fraction": round(changed / (params or 1), 5),
        "patch_delta_bytes": delta_bytes,
        "patch_s": round(fn, 3),
        "patch_s_range": [round(min(fn_wall), 3), round(max(fn_wall), 3)],
        "patch_stages_s": {k: round(statistics.median(st[k] for st in stages), 3) for k in stages[0]},
        "patch_cli_s": round(cli, 3),
        "patch_cli_s_range": [round(min(cli_wall), 3), round(max(cli_wall), 3)],
        "patch_cli_cpu_s": round(statistics.median(cli_cpu), 3),
        "patch_s_goal": GOAL_PATCH_S if at_goal else None,
        "patch_over_goal": round(fn / GOAL_PATCH_S, 3) if at_goal else None,
        "patch_cli_over_goal": round(cli / GOAL_PATCH_S, 3) if at_goal else None,
    }


# -- through Redis, and the lossy codecs ---------------------------------------------------------------


def _redis_figures(cfg, trainer, quick: bool) -> dict:
    """Publish -> visible on a follower through the local Redis (median over steps)."""
    if cfg is None:  # the GPU check runs where no Redis is
        return {"publish_to_applied_ms": None, "publish_to_applied_reason": "no Redis configured"}
    import uuid

    import redis

    from rose.config import RedisConfig
    from rose.weights.follower import WeightFollower
    from rose.weights.stream import WeightPublisher

    try:
        r = redis.Redis.from_url(cfg.redis.url, socket_timeout=30)
        r.ping()
    except Exception as e:
        return {"publish_to_applied_ms": None, "publish_to_applied_reason": f"redis at {cfg.redis.url}: {e}"}
    rcfg = RedisConfig(url=cfg.redis.url, key_prefix=f"{cfg.redis.key_prefix}bench-{uuid.uuid4().hex[:8]}:")
    pub = WeightPublisher(r, rcfg, "bench", keyframe_every=1000)
    fol = WeightFollower(r, rcfg, "bench")
    try:
        s = pub.publish(trainer.bf16())
        t = time.perf_counter()
        fol.poll(0)
        keyframe_ms = (time.perf_counter() - t) * 1e3
        lat, sent = [], []
        for _ in range(2 if quick else 3):
            trainer.step()
            state = trainer.bf16()
            t = time.perf_counter()
            s = pub.publish(state)
            v = fol.poll(0)
            lat.append((time.perf_counter() - t) * 1e3)
            sent.append(s.bytes_sent / s.bytes_full)
            assert v == s.version
        return {
            "publish_to_applied_ms": round(float(np.median(lat)), 1),
            "publish_ratio_per_step": round(float(np.mean(sent)), 5),
            "keyframe_apply_ms": round(keyframe_ms, 1),
        }
    finally:
        r.delete(pub.stream, pub.meta)


def _lossy_figures(trainer, params: int) -> dict:
    """Lossy codecs on one step of the first `params` params (all bf16): bytes ratio, max error
    after the step relative to the largest update, steps to land exactly on the target."""
    from rose.weights import codec

    k = 2 * params
    base = _flat_state(trainer)[1][:k].copy()
    trainer.step()
    new = _flat_state(trainer)[1][:k].copy()
    layout = make_layout({"w": ("bfloat16", (params,))})
    truth = to_f32(new, "bfloat16")
    out: dict[str, float | int | None] = {}
    for name, opts in (("topk", {"frac": 0.005}), ("int8", None)):
        view = base.copy()
        patches, view = codec.encode_state(layout, view, new, codec=name, lossy_options=opts, workers=WORKERS)
        err = np.abs(to_f32(view, "bfloat16") - truth)
        scale = float(np.max(np.abs(truth - to_f32(base, "bfloat16"))))
        steps = 1
        while not np.array_equal(view, new) and steps < 20:
            _, view = codec.encode_state(layout, view, new, codec=name, lossy_options=opts, workers=WORKERS)
            steps += 1
        out[f"lossy_{name}_bytes_ratio"] = round(_ratio(patches, layout), 5)
        out[f"lossy_{name}_max_err_vs_max_update"] = round(float(np.nanmax(err)) / scale, 4) if scale else 0.0
        out[f"lossy_{name}_steps_to_exact"] = steps if np.array_equal(view, new) else None
    return out


# -- the goals ------------------------------------------------------------------------------


def _not_met(out: dict) -> dict[str, str]:
    """Each goal this run missed, with what holds it back (from this run's own figures)."""
    st = out["stages_over_memcpy"]
    cores = f"{out['cpus']} cores (load average {out['load_average_1m']} from other processes)"
    why = {}
    if out["encode_over_memcpy"] < GOAL_ENCODE_OVER_MEMCPY:
        why["encode_over_memcpy"] = (
            f"the sender reads both buffers: comparing their words alone runs at {st['compare_words']}x memcpy, "
            f"numpy's extraction of the changed words' indices at {st['extract_indices']}x, the whole scan at "
            f"{st['scan']}x and coding the changed elements at {st['code_changed']}x on one thread; "
            f"{WORKERS} threads on {cores} reach {out['encode_over_memcpy']}x. Closing the gap needs a fused "
            "compiled kernel (compare, extract, code in one pass) or the device path"
        )
    if out["apply_over_memcpy"] < GOAL_APPLY_OVER_MEMCPY:
        why["apply_over_memcpy"] = (
            f"decoding the changed elements runs at {st['decode_changed']}x memcpy on one thread (numpy, a few "
            f"passes per element), the checksum of every shard at {st['checksum']}x; {WORKERS} threads on {cores} "
            f"reach {out['apply_over_memcpy']}x"
        )
    if out["bytes_ratio_per_step"] > GOAL_BYTES_RATIO:
        why["bytes_ratio_per_step"] = (
            f"{out['changed_fraction']} of the elements change per step; at the entropy of their positions and "
            "differences that needs more than the goal's bytes"
        )
    stages = ", ".join(f"{k} {v}" for k, v in out["patch_stages_s"].items())
    for key, over in (("patch_s", "patch_over_goal"), ("patch_cli_s", "patch_cli_over_goal")):
        if out.get(over) is not None and out[over] > 1:
            why[key] = (
                f"in-process the stages take {stages} s; a fresh process adds the interpreter start and imports "
                f"({out['patch_cli_cpu_s']} s of CPU in all); the rest of the wall time is waiting for {cores} "
                "and the disk"
            )
    return why
