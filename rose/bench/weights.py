"""Weight deltas: bytes sent vs a full bf16 broadcast, encode/apply GB/s vs memcpy, publish->applied via Redis, lossy codecs."""

from __future__ import annotations

import time

import numpy as np

GOAL_RATIO = 0.05  # bytes sent / full bf16 broadcast per step, lossless
AIM_RATIO = 0.03
GOAL_ENCODE_VS_MEMCPY = 0.5
ENCODE_WORKERS = 2  # as the publisher runs it


def _best(f, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def _best_on(buf, start, f, repeat: int = 3) -> float:
    """Best time of `f`, each run on `buf` reset to `start` first (the reset is not timed)."""
    best = float("inf")
    for _ in range(repeat):
        np.copyto(buf, start)
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def run(cfg, quick: bool) -> dict:
    from rose.weights import codec
    from rose.weights.checkpoint import from_state_dict
    from rose.weights.layout import flatten, make_layout
    from rose.weights.rl_update import AdamLikeTrainer

    params = 10_000_000 if quick else 100_000_000
    steps = 2
    # a transformer-like mix: a few big matrices and small vectors
    sizes = {f"layer{i}.w": params // 8 - 4096 for i in range(8)} | {f"layer{i}.norm": 4096 for i in range(8)}
    trainer = AdamLikeTrainer(sizes, lr=2e-6)
    for _ in range(3):  # past Adam's first, larger bias-corrected steps
        trainer.step()
    specs, arrays = from_state_dict(trainer.bf16())
    layout = make_layout(specs)
    view = flatten(layout, arrays)
    receiver = view.copy()
    full = sum(t.nbytes for t in layout.tensors)
    scratch = np.empty_like(view)
    memcpy_s = _best(lambda: np.copyto(scratch, view))
    work, rwork = np.empty_like(view), np.empty_like(view)  # encode/apply run on copies, best of 3
    ratios, changed, enc_s, enc1_s, app_s, targets = [], [], [], [], [], []
    for _ in range(steps):
        trainer.step()
        target = flatten(layout, from_state_dict(trainer.bf16())[1])
        enc1_s.append(_best_on(work, view, lambda: codec.encode_state(layout, work, target, workers=1)))
        enc_s.append(_best_on(work, view, lambda: codec.encode_state(layout, work, target, workers=ENCODE_WORKERS)))
        np.copyto(work, view)
        patches, _ = codec.encode_state(layout, work, target, workers=ENCODE_WORKERS)
        view, work = work, view

        def apply():
            for p in patches:
                codec.apply_patch(layout, rwork, p)

        app_s.append(_best_on(rwork, receiver, apply))
        receiver, rwork = rwork, receiver
        assert np.array_equal(receiver, target) and np.array_equal(view, target)
        ratios.append(sum(len(p.payload) for p in patches) / full)
        changed.append(sum(p.changed for p in patches) / (full // 2))
        targets.append(target)
    gbps = lambda s: full / s / 1e9  # noqa: E731
    encode = gbps(float(np.median(enc_s)))
    memcpy = gbps(memcpy_s)
    ratio = float(np.mean(ratios))
    out = {
        "params": sum(sizes.values()),
        "bytes_full_bf16": full,
        "steps": steps,
        "changed_fraction": round(float(np.mean(changed)), 5),
        "bytes_ratio_per_step": round(ratio, 5),
        "bytes_ratio_goal": GOAL_RATIO,
        "bytes_ratio_vs_goal": round(ratio / GOAL_RATIO, 3),
        "bytes_ratio_vs_aim": round(ratio / AIM_RATIO, 3),
        "encode_gb_per_s": round(encode, 3),
        "encode_workers": ENCODE_WORKERS,
        "encode_1_worker_gb_per_s": round(gbps(float(np.median(enc1_s))), 3),
        "apply_gb_per_s": round(gbps(float(np.median(app_s))), 3),
        "memcpy_gb_per_s": round(memcpy, 3),
        "encode_vs_memcpy": round(encode / memcpy, 4),
        "encode_vs_memcpy_goal": GOAL_ENCODE_VS_MEMCPY,
        "apply_vs_memcpy": round(gbps(float(np.median(app_s))) / memcpy, 4),
    }
    out.update(_redis_figures(cfg, layout, trainer, quick))
    out.update(_lossy_figures(layout, targets[-1], trainer))
    return out


def _redis_figures(cfg, layout, trainer, quick: bool) -> dict:
    """Publish -> visible on a follower through the local Redis (median over steps)."""
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


def _lossy_figures(layout, target, trainer) -> dict:
    """Lossy codecs on one step of the first 12.5M params (all bf16): bytes ratio, max error
    after the step relative to the largest update, steps to land exactly on the target."""
    from rose.weights import codec
    from rose.weights.checkpoint import from_state_dict
    from rose.weights.layout import flatten, make_layout
    from rose.weights.lossy import to_f32

    out = {}
    trainer.step()
    new_all = flatten(layout, from_state_dict(trainer.bf16())[1])
    k = min(layout.total, 25_000_000)
    layout = make_layout({"w": ("bfloat16", (k // 2,))})
    base, new = target[:k].copy(), new_all[:k].copy()
    del new_all
    truth = to_f32(new, "bfloat16")
    for name, opts in (("topk", {"frac": 0.005}), ("int8", None)):
        view = base.copy()
        patches, view = codec.encode_state(layout, view, new, codec=name, lossy_options=opts, workers=2)
        err = np.abs(to_f32(view, "bfloat16") - truth)
        scale = float(np.max(np.abs(truth - to_f32(base, "bfloat16"))))
        steps = 1
        while not np.array_equal(view, new) and steps < 20:
            patches2, view = codec.encode_state(layout, view, new, codec=name, lossy_options=opts, workers=2)
            steps += 1
        out[f"lossy_{name}_bytes_ratio"] = round(sum(len(p.payload) for p in patches) / layout.total, 5)
        out[f"lossy_{name}_max_err_vs_max_update"] = round(float(np.nanmax(err)) / scale, 4) if scale else 0.0
        out[f"lossy_{name}_steps_to_exact"] = steps if np.array_equal(view, new) else None
    return out
