"""Interference profiles measured as ROSE runs rollout: serving and rollout are real transformer
decode steps, rollout runs in its own process beside serving, and each mechanism's points are
written as a `rose.interference_profile.v1` file (rose.sim.interference) for
`rose simulate --interference-profile FILE`.

* The model. A Llama architecture with random weights (transformers' `from_config`, shapes from
  rose.model.random_init.CheckpointShape): `1b` and `8b` (Llama 3.2 1B and Llama 3.1 8B sizes,
  bf16) on CUDA, `tiny` on the CPU. A serving step is one batched decode of `serving_batch`
  requests with attention over a growing KV cache (transformers' DynamicCache): the prompt is
  prefilled first (not timed), then each decode step is timed to its result on the host; after
  `context` decode steps the batch is prefilled anew. Serving runs on the default stream, as a
  serving engine does (on the CPU: one thread, the rollout process another).
* The rollout process. Spawned as the executor starts a worker (rose.rollout.launcher.spawn: at
  the executor's `worker_nice`, dying with its parent), with its own CUDA context. It decodes
  `rollout_batch` episodes the same way, on the lowest-priority CUDA stream, and obeys a pause
  flag (rose.rollout.pause_flag) as a worker does: RUN/PAUSE/STOP, its compute share and its
  token count (the flag's step counter counts decoded tokens here).
* Share is the executor's `compute_share`: the duty cycle of the rollout process. After a launch
  that kept it busy `b` seconds it stays idle `b × (1 - share) / share` (the worker's own rule,
  rose.rollout.worker), so it is busy at most `share` of the time; the share reaches it through
  the flag, as a Throttle does. Under MPS the share is instead the process's SM percentage
  (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = share × 100) and it runs flat out.

Mechanisms:

* `separate_process`: the rollout process on its low-priority stream, one launch per decode
  step of the whole batch (on the CPU: the process at niceness 19).
* `separate_process_bounded_launch`: the rollout process splits its batch into row groups and
  its prompt into prefill chunks so that one launch (one forward pass, timed to the device
  drained) takes at most the bench's `max_launch_us` (`MAX_LAUNCH_US` by default), and checks
  the pause flag between launches. No rollout worker bounds its launches (docs/executor.md): this
  measures what such a bound would buy.
* `separate_process_mps`: only where an MPS daemon already runs (`mps_daemon`); nothing here
  starts, stops or changes MPS or any GPU setting. Without one it is skipped with the reason.

Per share (`SHARES`): serving's p99 and mean step time beside rollout over alone, and rollout's
tokens/s beside serving over its solo rate (share 1, serving idle): `rollout_fraction`. Each
point carries the protection goal: serving p99 at most `GOAL_P99_RATIO` × alone while rollout
keeps at least `GOAL_ROLLOUT_FRACTION` (Tally, ASPLOS '25: +7.2 % p99 with kernel preemption).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

from rose.bench._cuda import _Device, _phase
from rose.bench.interference import GOAL_PROTECTED_OVER_ALONE
from rose.bench.interference_decode import SHAPES, BenchShape, Decoder, RolloutProcess, serving_steps, warm_up

SHARES = (0.1, 0.25, 0.5, 1.0)
MECHANISMS = ("separate_process", "separate_process_bounded_launch", "separate_process_mps")
# the longest one launch of the bounded-launch mechanism may keep the device, microseconds (the
# bench's own parameter: no worker bounds its launches)
MAX_LAUNCH_US = 2000
GOAL_P99_RATIO = GOAL_PROTECTED_OVER_ALONE  # serving p99 beside rollout / alone, at most
GOAL_ROLLOUT_FRACTION = 0.3  # rollout tokens/s beside serving / solo, at least
GOAL_REFERENCE = "Tally (ASPLOS '25): +7.2 % serving p99 with kernel-level preemption"
MPS_PIPE_DEFAULT = "/tmp/nvidia-mps"


CUDA_SHAPES = ("1b", "8b")
PROCESS_START_S = 25.0  # a rollout process: imports, model built on the device, warm-up
SOLO_S = 4.0  # rollout alone at share 1, serving idle
SLOWDOWN_ALLOWANCE = 1.3  # serving steps beside rollout take longer than alone (for the plan only)


# ---- where MPS runs --------------------------------------------------------------------------


def mps_daemon(env: dict[str, str] | None = None) -> str | None:
    """Where an MPS control daemon already answers (its pipe directory), or None. Looks only:
    CUDA_MPS_PIPE_DIRECTORY or /tmp/nvidia-mps holding a `control` pipe, else
    `nvidia-cuda-mps-control` asked nothing but whether it answers (`get_default_active_thread_percentage`)."""
    env = dict(os.environ) if env is None else env
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DEFAULT
    if Path(pipe, "control").exists():
        return pipe
    tool = shutil.which("nvidia-cuda-mps-control", path=env.get("PATH"))
    if tool is None:
        return None
    try:
        p = subprocess.run(
            [tool], input="get_default_active_thread_percentage\n", capture_output=True, text=True, timeout=5, env=env
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return pipe if p.returncode == 0 and p.stdout.strip() else None


# ---- the plan --------------------------------------------------------------------------------


def plan(
    shapes: tuple[str, ...] = CUDA_SHAPES,
    shares: tuple[float, ...] = SHARES,
    cuda: bool = True,
    mps: str | None = None,
    steps: int | None = None,
) -> dict:
    """What runs and what is skipped (with the reason), and the time it should take on an H200."""
    out: dict = {"shares": list(shares), "shapes": {}, "goal": _goal()}
    total = 0.0
    for name in shapes:
        s = SHAPES[name]
        n = steps or s.steps
        entry: dict = {"model": asdict(s.model), "serving_steps_per_phase": n, "mechanisms": {}}
        if s.cuda and not cuda:
            entry["skipped"] = "no CUDA GPU (torch.cuda.is_available() is false)"
        secs = 0.0 if "skipped" in entry else PROCESS_START_S + n * s.step_ms / 1e3
        for mech in MECHANISMS:
            why = _skip_reason(mech, s, cuda, mps)
            if why or "skipped" in entry:
                entry["mechanisms"][mech] = {"skipped": why or entry["skipped"]}
                continue
            starts = len(shares) if mech == "separate_process_mps" else 1
            phase_s = n * s.step_ms / 1e3 * SLOWDOWN_ALLOWANCE
            secs += starts * PROCESS_START_S + SOLO_S + len(shares) * phase_s
            entry["mechanisms"][mech] = {"runs": True}
        entry["estimated_s"] = round(secs)
        total += secs
        out["shapes"][name] = entry
    out["estimated_s"] = round(total)
    return out


def skips(p: dict) -> dict[str, str]:
    """What a plan leaves out and why: "shape" or "shape/mechanism" -> reason."""
    out = {}
    for name, entry in p["shapes"].items():
        if "skipped" in entry:
            out[name] = entry["skipped"]
            continue
        out.update({f"{name}/{m}": e["skipped"] for m, e in entry["mechanisms"].items() if "skipped" in e})
    return out


def summary(run_result: dict) -> dict:
    """Per shape and mechanism, each share's serving p99 ratio and rollout fraction beside the
    goal: "SHAPE/MECHANISM" -> {share: "p99 xR, fraction F, goal met|missed"}."""
    out = {}
    for shape, r in run_result["results"].items():
        for mech, m in r["mechanisms"].items():
            out[f"{shape}/{mech}"] = {
                f"{ph['share']:g}": f"p99 x{ph['serving_p99_ratio']:.3f}, fraction {ph['rollout_fraction']:.3f}, "
                f"goal {'met' if ph['meets_goal'] else 'missed'}"
                for ph in m["phases"].values()
            }
    return out


def _skip_reason(mech: str, s: BenchShape, cuda: bool, mps: str | None) -> str | None:
    if mech != "separate_process_mps":
        return None
    if not s.cuda or not cuda:
        return "MPS is a CUDA mechanism"
    if mps is None:
        return (
            "no MPS daemon runs (no control pipe in CUDA_MPS_PIPE_DIRECTORY or /tmp/nvidia-mps, "
            "nvidia-cuda-mps-control does not answer); it is never started here"
        )
    return None


def _goal() -> dict:
    return {
        "serving_p99_ratio_at_most": GOAL_P99_RATIO,
        "rollout_fraction_at_least": GOAL_ROLLOUT_FRACTION,
        "reference": GOAL_REFERENCE,
    }


# ---- the measurement ---------------------------------------------------------------------------


def measure(
    shape: str,
    device: str,
    mechanisms: tuple[str, ...] = MECHANISMS[:2],
    shares: tuple[float, ...] = SHARES,
    steps: int | None = None,
    max_launch_us: int = MAX_LAUNCH_US,
    solo_s: float = SOLO_S,
) -> dict:
    """Serving alone, then per mechanism rollout alone and serving beside rollout at each share;
    the figures of each phase and each mechanism's points."""
    import torch

    s = SHAPES[shape]
    n = steps or s.steps
    dev = _Device(device)
    # every rollout process starts now and waits paused (an idle process takes no device time),
    # so that their imports and model builds overlap; MPS ones start per share (_mechanism)
    waiting = {m: _start(m, s.name, dev, 1.0, max_launch_us) for m in mechanisms}
    if not dev.cuda:
        torch.set_num_threads(1)  # serving on one core, the rollout process on another
    serve = Decoder(s, dev, s.serving_batch, seed=1)
    warm_up(serve)
    out: dict = {"shape": shape, "device": dev.device.type, "mechanisms": {}}
    out["gpu_name"] = torch.cuda.get_device_name(dev.device) if dev.cuda else None
    try:
        for ro in waiting.values():
            ro.ready()
        t0 = time.perf_counter()
        alone = _phase(serving_steps(serve, n), None, 0.0, None, time.perf_counter() - t0)
        out["serving_alone"] = alone
        for mech, ro in waiting.items():
            out["mechanisms"][mech] = _mechanism(mech, ro, serve, dev, alone, shares, n, max_launch_us, solo_s)
    finally:
        for ro in waiting.values():
            ro.close()
    return out


def _start(mech: str, shape: str, dev: _Device, share: float, max_launch_us: int) -> RolloutProcess:
    """A rollout process for `mech`; under MPS its SM percentage is the share."""
    pct = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(max(1, round(share * 100)))}
    env = {**os.environ, **pct} if mech == "separate_process_mps" else None
    return RolloutProcess(shape, str(dev.device), mech == "separate_process_bounded_launch", max_launch_us, env)


def _mechanism(mech, ro, serve: Decoder, dev: _Device, alone: dict, shares, n: int, max_launch_us: int, solo_s: float):
    """Rollout alone on the started process `ro`, then serving beside it at each share."""
    mps = mech == "separate_process_mps"
    phases: dict = {}
    solo = _solo_rate(ro.ready(), solo_s)
    for share in shares:
        # under MPS the SM percentage is fixed when a process starts: one process per share
        cur = ro if not mps or share == 1.0 else _start(mech, serve.shape.name, dev, share, max_launch_us).ready()
        try:
            phases[f"share_{share:g}"] = _beside(serve, cur, 1.0 if mps else share, share, alone, n, solo)
        finally:
            if cur is not ro:
                cur.close()
    return {
        "rollout_tokens_per_s_solo": round(solo, 2),
        "launch_sizing": ro.sized,
        "phases": phases,
        "points": [_point(p) for p in phases.values()],
    }


def _solo_rate(ro: RolloutProcess, secs: float) -> float:
    """Rollout tokens/s at share 1 with serving idle."""
    ro.run(1.0)
    time.sleep(min(1.0, secs / 4))  # past its first prefill
    k0, t0 = ro.tokens(), time.perf_counter()
    time.sleep(secs)
    rate = (ro.tokens() - k0) / (time.perf_counter() - t0)
    ro.pause()
    return rate


def _beside(serve: Decoder, ro: RolloutProcess, duty: float, share: float, alone: dict, n: int, solo: float) -> dict:
    ro.run(duty)
    time.sleep(0.05)
    k0, t0 = ro.tokens(), time.perf_counter()
    samples = serving_steps(serve, n)
    secs = time.perf_counter() - t0
    rate = (ro.tokens() - k0) / secs if secs > 0 else 0.0
    ro.pause()
    ph = _phase(samples, alone["p99_ms"], share, None, secs)
    ph["rollout_tokens_per_s"] = round(rate, 2)
    ph["rollout_fraction"] = round(rate / solo, 4) if solo > 0 else 0.0
    ph["serving_p99_ratio"] = round(ph["p99_ms"] / alone["p99_ms"], 4)
    ph["serving_mean_ratio"] = round(ph["mean_ms"] / alone["mean_ms"], 4)
    ph["meets_goal"] = ph["serving_p99_ratio"] <= GOAL_P99_RATIO and ph["rollout_fraction"] >= GOAL_ROLLOUT_FRACTION
    return ph


def _point(ph: dict) -> dict:
    """A profile point (rollout_fraction held to [0, 1]: timing noise can put it just above 1)."""
    return {
        "share": ph["share"],
        "serving_p99_ratio": ph["serving_p99_ratio"],
        "serving_mean_ratio": ph["serving_mean_ratio"],
        "rollout_fraction": min(1.0, max(0.0, ph["rollout_fraction"])),
    }


def write_profiles(result: dict, out: Path) -> dict[str, str]:
    """One `rose.interference_profile.v1` file per measured mechanism, validated by
    rose.sim.interference's reader before it is written; mechanism -> path."""
    import torch

    from rose.sim.interference import profile_from_json

    device = result["gpu_name"] or result["device"]
    date = time.strftime("%Y-%m-%d", time.gmtime())
    files = {}
    for mech, m in result["mechanisms"].items():
        source = (
            f"rose.bench.interference_profile on {device}, torch {torch.__version__}, shape {result['shape']}, "
            f"{date}: serving decode steps alone and beside a rollout process ({mech})"
        )
        doc = {"schema": "rose.interference_profile.v1", "mechanism": mech, "device": device, "source": source}
        doc["points"] = m["points"]
        prof = profile_from_json(doc)
        path = Path(out) / f"interference-profile-{result['shape']}-{mech}.json"
        body = prof.to_json()
        body["goal"] = _goal()
        body["meets_goal"] = {k: p["meets_goal"] for k, p in m["phases"].items()}
        path.write_text(json.dumps(body, indent=2) + "\n")
        files[mech] = str(path)
    return files


def run(
    out: Path, shapes: tuple[str, ...] = CUDA_SHAPES, steps: int | None = None, max_launch_us: int = MAX_LAUNCH_US
) -> dict:
    """The GPU check's part: each CUDA shape, each mechanism this machine has, profiles under `out`."""
    import torch

    mps = mps_daemon()
    p = plan(shapes, cuda=torch.cuda.is_available(), mps=mps, steps=steps)
    results: dict = {"plan": p, "mps_pipe": mps, "results": {}, "files": {}}
    for name, entry in p["shapes"].items():
        if "skipped" in entry:
            continue
        mechs = tuple(m for m, e in entry["mechanisms"].items() if "skipped" not in e)
        device = "cuda" if SHAPES[name].cuda else "cpu"
        r = measure(name, device, mechs, steps=steps, max_launch_us=max_launch_us)
        results["results"][name] = r
        results["files"][name] = write_profiles(r, out)
    return results
