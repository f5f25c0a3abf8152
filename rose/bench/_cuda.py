"""Serving beside rollout on one CUDA GPU, in one process with no Kafka or Redis: what
`rose bench interference` measures when a GPU is present, and the device-side figures of the
GPU check (deploy/gpu-check.sh).

* Interference. Serving runs decode steps of a 7B-class layer stack (bf16 GEMMs of a batch of
  running requests) back to back on the highest-priority CUDA stream and times each one.
  Rollout runs the same kind of step, for a larger batch of episodes, on the lowest-priority
  stream (as ROSE's workers do, rose.rollout.worker_process.lowest_priority_stream), busy for a
  fraction `share` of the time: a burst of steps, then idle for burst × (1 - share) / share.
  Phases: serving alone; beside rollout at each share on the low-priority stream; beside
  rollout at share 1 on a stream of serving's own priority (unprotected); optionally beside
  rollout in a second process (its own CUDA context: time-sliced with serving unless MPS
  runs). ``alpha_per_share`` is the least-squares slope of (p99 beside / p99 alone - 1) over
  the share, through the origin: the simulator's ``1 + alpha × share``
  (`rose simulate --interference-bench`, rose.sim.engine.calibration).
* Pause latency: rollout checks its pause flag (rose.rollout.pause_flag, the worker's own)
  between layers, as the worker's engine does; the time from the flag raised to the rollout
  stream drained is the device side of a guard pause or a revoke.
* Host-to-device copy of a weight version (pinned and pageable host memory).

Every function takes a `device`; the CPU runs the same code without streams (tests), but only
CUDA figures are evidence.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass

from rose.bench._stack import percentiles_ms
from rose.obs.stats import percentile

SHARES = (0.25, 0.5, 1.0)  # rollout's busy fraction in the low-priority phases
PROCESS_SHARES = (0.5, 1.0)  # ... in the second-process phases
GOAL_PAUSE_P99_MS = 2.0  # = rose.bench.revoke.GOAL_GUARD_PAUSED_P99_MS, the guard path's goal
SWITCH_INTERVAL_S = 0.0002  # the GIL switch interval while both sides launch from one process


@dataclass(frozen=True)
class Shape:
    """The layer stack both sides run: a Llama-2-7B layer's linear work (d_model 4096, MLP
    11008, 32 layers of which `layers` run per step), bf16 on CUDA."""

    d_model: int = 4096
    d_ff: int = 11008
    layers: int = 8
    serving_batch: int = 32  # running requests of a decode step
    rollout_batch: int = 64  # episodes decoding together on a rollout worker
    rollout_burst: int = 4  # steps rollout launches before it checks the clock


class _Device:
    """Streams and synchronisation on CUDA; the same calls as no-ops on the CPU."""

    def __init__(self, device: str):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32

    def stream(self, which: str):
        """A new stream at the lowest ('low') or highest ('high') priority (CUDA: a larger
        number is a lower priority; the default stream has the lowest)."""
        if not self.cuda:
            return None
        low, high = self.torch.cuda.Stream.priority_range()  # type: ignore[call-arg]  # a staticmethod
        return self.torch.cuda.Stream(self.device, priority={"low": low, "high": high}[which])

    def barrier(self) -> None:
        """Everything queued so far done (tensors made on one stream, read on another)."""
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def on(self, stream):
        return self.torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def sync(self, stream) -> None:
        if stream is not None:
            stream.synchronize()


def make_stack(dev: _Device, shape: Shape, seed: int) -> list[tuple]:
    """Per layer: the QKV, output, gate+up and down projections (random, scaled to keep the
    activations bounded)."""
    t = dev.torch
    g = t.Generator(device=dev.device).manual_seed(seed)  # drawn on the device: GBs of weights
    d, f = shape.d_model, shape.d_ff

    def w(a: int, b: int):
        return t.randn(a, b, generator=g, device=dev.device, dtype=dev.dtype) / math.sqrt(a)

    return [(w(d, 3 * d), w(d, d), w(d, 2 * f), w(f, d)) for _ in range(shape.layers)]


def decode_step(dev: _Device, x, stack: list[tuple], should_stop=None) -> bool:
    """One decode iteration's GEMMs for the batch `x`; False if `should_stop()` turned true
    between two layers (the rest of the step is not launched)."""
    t = dev.torch
    d, f = stack[0][1].shape[0], stack[0][3].shape[0]
    for wqkv, wo, wup, wdown in stack:
        if should_stop is not None and should_stop():
            return False
        h = (x @ wqkv)[:, :d] @ wo
        x = x + h
        u = x @ wup
        x = x + (t.nn.functional.silu(u[:, :f]) * u[:, f:]) @ wdown
    return True


class _Rollout:
    """Rollout beside serving in a thread of this process: bursts of decode steps on its own
    stream, busy for `share` of the time; `steps` counts the steps done."""

    def __init__(self, dev: _Device, shape: Shape, stream, share: float, flag=None):
        self.dev, self.shape, self.stream, self.share, self.flag = dev, shape, stream, share, flag
        self.stack = make_stack(dev, shape, seed=2)
        self.x = dev.torch.randn(shape.rollout_batch, shape.d_model).to(dev.device, dev.dtype)
        dev.barrier()
        self.steps = 0
        self.pauses_ns: list[int] = []
        self._last_raised = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> _Rollout:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _paused(self) -> bool:
        from rose.rollout.pause_flag import RUN

        return self.flag is not None and self.flag.get() != RUN

    def _loop(self) -> None:
        dev = self.dev
        check = self._paused if self.flag is not None else None
        with dev.on(self.stream):
            while not self._stop.is_set():
                if self._paused():  # the stream is drained: every burst ends synchronised
                    self._seen_pause()
                    while self._paused() and not self._stop.is_set():
                        time.sleep(0.0002)
                    continue
                t0 = time.perf_counter()
                done = 0
                for _ in range(self.shape.rollout_burst):
                    if not decode_step(dev, self.x, self.stack, check):
                        break
                    done += 1
                dev.sync(self.stream)
                self.steps += done
                busy = time.perf_counter() - t0
                if self.share < 1.0:
                    self._stop.wait(busy * (1.0 - self.share) / self.share)

    def _seen_pause(self) -> None:
        """Record flag raised -> stream drained, once per raise of the flag."""
        assert self.flag is not None  # only a flag pauses
        raised = self.flag.set_ns
        if raised != self._last_raised:
            self._last_raised = raised
            self.pauses_ns.append(time.monotonic_ns() - raised)


def _serve(dev: _Device, stack, x, stream, n: int) -> list[int]:
    """`n` serving steps back to back on `stream`, each timed to its stream drained (ns)."""
    out = []
    with dev.on(stream):
        for _ in range(n):
            t0 = time.perf_counter_ns()
            decode_step(dev, x, stack)
            dev.sync(stream)
            out.append(time.perf_counter_ns() - t0)
    return out


def _phase(
    samples: list[int], alone_p99_ms: float | None, share: float, rollout_steps: int | None, secs: float
) -> dict:
    """Serving's latency figures of one phase, with rollout's steps/s beside it (None: not counted here)."""
    ms = percentiles_ms(samples)
    ms["mean_ms"] = round(sum(samples) / len(samples) / 1e6, 4) if samples else None
    ms["share"] = share
    ms["rollout_steps_per_s"] = None if rollout_steps is None else round(rollout_steps / secs, 2) if secs > 0 else 0.0
    if alone_p99_ms:
        r = ms["p99_ms"] / alone_p99_ms
        ms["p99_over_alone"] = round(r, 4)
        bound = 1.0 / (1.0 - share) if share < 1.0 else math.inf
        ms["within_time_slicing_bound"] = r <= bound
    return ms


def fit_alpha(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope through the origin of (share, p99 ratio - 1): the alpha of
    ``1 + alpha × share``; None without a point at a positive share."""
    den = sum(x * x for x, _ in points)
    if den <= 0:
        return None
    return round(max(0.0, sum(x * (r - 1.0) for x, r in points) / den), 4)


def interference(
    device: str = "cuda",
    quick: bool = True,
    shape: Shape = Shape(),
    steps: int | None = None,
    shares: tuple[float, ...] = SHARES,
    processes: bool = True,
) -> dict:
    """Serving p99 alone and beside rollout at each share (low-priority stream), beside
    rollout at serving's own priority, and (with `processes`) beside rollout in a second
    process; the alpha each phase set implies."""
    import torch

    dev = _Device(device)
    steps = steps or (200 if quick else 2000)
    torch.manual_seed(0)
    stack = make_stack(dev, shape, seed=1)
    x = torch.randn(shape.serving_batch, shape.d_model).to(dev.device, dev.dtype)
    dev.barrier()
    high = dev.stream("high")
    # Both sides launch from Python threads of one process: a thread holding the GIL in Python
    # code keeps it up to the switch interval (5 ms by default), which would delay serving's
    # launches in a way two processes never see. A short interval keeps that below the figures.
    switch = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        return _interference(dev, shape, stack, x, high, steps, quick, shares, processes)
    finally:
        sys.setswitchinterval(switch)


def _interference(dev: _Device, shape: Shape, stack, x, high, steps: int, quick: bool, shares, processes) -> dict:
    import torch

    _serve(dev, stack, x, high, 10)  # warm up: kernels chosen, memory allocated
    t0 = time.perf_counter()
    alone = _serve(dev, stack, x, high, steps)
    phases = {"alone": _phase(alone, None, 0.0, 0, time.perf_counter() - t0)}
    a99 = phases["alone"]["p99_ms"]
    with _Rollout(dev, shape, dev.stream("low"), 1.0) as solo:  # rollout's own rate, serving idle
        time.sleep(0.5 if quick else 2.0)
        solo_rate = solo.steps / (0.5 if quick else 2.0)
    for share in shares:
        with _Rollout(dev, shape, dev.stream("low"), share) as ro:
            time.sleep(0.05)
            s0, t0 = ro.steps, time.perf_counter()
            samples = _serve(dev, stack, x, high, steps)
            phases[f"low_priority_share_{share:g}"] = _phase(
                samples, a99, share, ro.steps - s0, time.perf_counter() - t0
            )
    with _Rollout(dev, shape, dev.stream("high"), 1.0) as ro:  # no protection: serving's priority
        time.sleep(0.05)
        s0, t0 = ro.steps, time.perf_counter()
        samples = _serve(dev, stack, x, high, steps)
        phases["same_priority_share_1"] = _phase(samples, a99, 1.0, ro.steps - s0, time.perf_counter() - t0)
    if processes:
        for share in PROCESS_SHARES:
            phases[f"separate_process_share_{share:g}"] = _beside_process(dev, shape, stack, x, high, steps, a99, share)
    low = [(p["share"], p["p99_over_alone"]) for k, p in phases.items() if k.startswith("low_priority")]
    proc = [(p["share"], p["p99_over_alone"]) for k, p in phases.items() if k.startswith("separate_process")]
    for p in phases.values():
        if solo_rate > 0 and p["rollout_steps_per_s"]:
            p["rollout_over_alone"] = round(p["rollout_steps_per_s"] / solo_rate, 3)
    props = torch.cuda.get_device_properties(dev.device) if dev.cuda else None
    return {
        "device": dev.device.type,
        "gpu_name": props.name if props is not None else None,
        "method": "priority streams in one process (rose.bench._cuda)",
        "shape": asdict(shape),
        "serving_step": f"decode GEMMs of {shape.layers} Llama-2-7B-size layers, batch {shape.serving_batch}, "
        f"{str(dev.dtype).removeprefix('torch.')}, highest-priority stream",
        "rollout_work": f"the same GEMMs for {shape.rollout_batch} episodes, lowest-priority stream, busy for "
        "`share` of the time",
        "serving_steps_per_phase": steps,
        "rollout_steps_per_s_alone": round(solo_rate, 2),
        "phases": phases,
        "alpha_per_share": fit_alpha(low),
        "alpha_per_share_separate_process": fit_alpha(proc) if proc else None,
        "alpha_basis": "least squares of p99 beside / alone - 1 over the low-priority phases' shares",
        "unprotected_p99_over_alone": phases["same_priority_share_1"]["p99_over_alone"],
        "protected_p99_over_alone": phases.get("low_priority_share_0.5", {}).get("p99_over_alone"),
        "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
    }


def _process_rollout(device: str, shape: dict, share: float, ready, stop) -> None:
    """A second process's rollout (own CUDA context), until `stop` is set; steps sent on `ready`."""
    dev = _Device(device)
    ro = _Rollout(dev, Shape(**shape), dev.stream("low"), share)
    with ro:
        ready.send(0)
        stop.wait()
    ready.send(ro.steps)


def _beside_process(dev: _Device, shape: Shape, stack, x, stream, steps: int, a99: float, share: float) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # a fresh CUDA context
    parent, child = ctx.Pipe()
    stop = ctx.Event()
    p = ctx.Process(target=_process_rollout, args=(str(dev.device), asdict(shape), share, child, stop), daemon=True)
    p.start()
    try:
        if not parent.poll(120):
            raise RuntimeError("the rollout process did not start within 120 s")
        parent.recv()
        time.sleep(0.2)
        t0 = time.perf_counter()
        samples = _serve(dev, stack, x, stream, steps)
        secs = time.perf_counter() - t0
        stop.set()
        n = parent.recv() if parent.poll(60) else 0
    finally:
        stop.set()
        p.join(30)
        if p.is_alive():
            p.kill()
    out = _phase(samples, a99, share, None, secs)
    out["rollout_steps_total"] = n  # from its start to its stop, serving's phase inside
    return out


def pause_latency(device: str = "cuda", quick: bool = True, shape: Shape = Shape(), n: int | None = None) -> dict:
    """Rollout running flat out on the low-priority stream; the pause flag raised `n` times at
    random moments: flag raised -> rollout's stream drained, in ms."""
    import random

    from rose.rollout.pause_flag import PAUSE, RUN, PauseFlag

    dev = _Device(device)
    n = n or (30 if quick else 200)
    rng = random.Random(0)
    flag = PauseFlag(f"rose-bench-cuda-{os.getpid()}", create=True)
    try:
        flag.set(RUN)
        with _Rollout(dev, shape, dev.stream("low"), 1.0, flag=flag) as ro:
            time.sleep(0.2)
            for _ in range(n):
                time.sleep(rng.uniform(0.005, 0.03))
                before = len(ro.pauses_ns)
                flag.set(PAUSE)
                deadline = time.monotonic() + 5.0
                while len(ro.pauses_ns) == before and time.monotonic() < deadline:
                    time.sleep(0.0002)
                flag.set(RUN)
            lat = list(ro.pauses_ns)
    finally:
        flag.close()
        flag.unlink()
    out = percentiles_ms(lat)
    out["raised"] = n
    out["goal_p99_ms"] = GOAL_PAUSE_P99_MS
    out["p99_over_goal"] = round(out["p99_ms"] / GOAL_PAUSE_P99_MS, 3) if out["p99_ms"] is not None else None
    out["what"] = "pause flag raised -> rollout's low-priority stream drained (checked between layers)"
    return out


def host_to_device(device: str = "cuda", quick: bool = True) -> dict:
    """GB/s of copying a weight version to the GPU from pinned and from pageable host memory."""
    import torch

    dev = _Device(device)
    nbytes = (256 if quick else 2048) << 20
    out: dict = {"bytes": nbytes}
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev.device)
    for kind in ("pinned", "pageable"):
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=kind == "pinned" and dev.cuda)
        times = []
        for _ in range(3 if quick else 10):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=kind == "pinned")
            if dev.cuda:
                torch.cuda.synchronize(dev.device)
            times.append(time.perf_counter() - t0)
        best = percentile(times, 0.0) or math.inf
        out[f"{kind}_gb_per_s"] = round(nbytes / best / 1e9, 2)
    return out


def codec_on_device(device: str = "cuda", quick: bool = True, params: int | None = None) -> dict:
    """The lossless delta codec where the trainer's weights live: one Adam step at lr 1e-6 (past
    its start-up) on fp32 masters on the device, its bf16 copy encoded against the last
    version and applied to a receiver's copy, both on the device, each beside a
    device-to-device copy of the same bytes (the memcpy of the 0.5x goal, on that device), and
    the encode's time split into the device scan and the host's entropy coding."""
    import torch

    from rose.bench.weights import (
        GOAL_APPLY_OVER_MEMCPY,
        GOAL_ENCODE_OVER_MEMCPY,
        GOAL_LR,
        PATCH_PARAMS,
        WARMUP_STEPS,
        _sizes,
    )
    from rose.weights import codec, scan
    from rose.weights.layout import make_layout
    from rose.weights.rl_update import AdamLikeTrainer

    dev = _Device(device)
    params = params or PATCH_PARAMS  # a 108M-parameter model: 216 MB of bf16
    sizes = _sizes(params)
    trainer = AdamLikeTrainer(sizes, lr=GOAL_LR, device=device)
    for _ in range(WARMUP_STEPS):
        trainer.step()
    layout = make_layout({n: ("bfloat16", (s,)) for n, s in sizes.items()})

    def flat():  # a uint8 tensor of the layout on the device
        buf = torch.zeros(layout.total, dtype=torch.uint8, device=dev.device)
        state = trainer.bf16()
        for t in layout.tensors:
            buf[t.offset : t.offset + t.nbytes] = state[t.name].view(torch.uint8)
        return buf

    view = flat()
    trainer.step()
    target = flat()
    work, scratch = view.clone(), torch.empty_like(view)
    full = sum(t.nbytes for t in layout.tensors)

    def timed(f) -> float:
        dev.barrier()
        t0 = time.perf_counter()
        f()
        dev.barrier()
        return time.perf_counter() - t0

    memcpy = lambda: scratch.copy_(view)  # noqa: E731
    enc, app, cpy, scans = [], [], [], []
    patches: list = []
    for _ in range(3 if quick else 5):
        work.copy_(view)
        cpy.append(timed(memcpy))
        enc.append(timed(lambda: patches.__setitem__(slice(None), codec.encode_state(layout, work, target)[0])))
        work.copy_(view)
        scans.append(
            timed(
                lambda: [
                    scan.changed_t(work[s:e], target[s:e], 2)
                    for s, e in map(layout.shard_range, range(layout.num_shards))
                ]
            )
        )
        work.copy_(view)
        app.append(timed(lambda: codec.apply_patches(layout, work, patches)))
        if not torch.equal(work, target):
            raise AssertionError("the device apply did not reproduce the target bytes")
    best = lambda xs: percentile(xs, 0.0) or math.inf  # noqa: E731
    m, e, a, s = best(cpy), best(enc), best(app), best(scans)
    return {
        "device": str(dev.device),
        "params": params,
        "bytes": full,
        "lr": GOAL_LR,
        "changed_fraction": round(sum(p.changed for p in patches) / (full // 2), 5),
        "bytes_ratio_per_step": round(sum(len(p.payload) for p in patches) / full, 5),
        "device_memcpy_gb_per_s": round(full / m / 1e9, 1),
        "encode_ms": round(e * 1e3, 2),
        "encode_scan_ms": round(s * 1e3, 2),
        "apply_ms": round(a * 1e3, 2),
        "encode_over_device_memcpy": round(m / e, 5),
        "apply_over_device_memcpy": round(m / a, 5),
        "goal_over_memcpy": min(GOAL_ENCODE_OVER_MEMCPY, GOAL_APPLY_OVER_MEMCPY),
        "what": "lossless zdelta codec on device tensors (scan and gathers on the device, entropy coding "
        "and checksums on the host) vs a device-to-device copy of the same bytes; best of the repeats",
    }
