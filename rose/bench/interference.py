"""Serving p99 of a real model step alone, beside rollout and beside protected rollout, with the rollout tokens/s each keeps."""

from __future__ import annotations

import os
import subprocess
import threading
import time

from rose.bench._stack import fill_tasks, percentiles_ms, private_stack
from rose.obs.stats import percentile
from rose.rollout.pause_flag import PAUSE, RUN, STOP, PauseFlag

GOAL_PROTECTED_OVER_ALONE = 1.05  # at most: serving p99 beside protected rollout / alone
PROTECTED_SHARE = 0.5  # compute share of the protected worker
# at least: rollout tokens/s kept under protection / unprotected. Protection grants the worker
# PROTECTED_SHARE of the compute, so it should keep at least that share of the rollout work.
GOAL_TOKENS_KEPT = PROTECTED_SHARE
SLO_OVER_ALONE = 1.5  # the serving SLO of this bench: 1.5 × the p99 measured alone
GPU = "bench/0"
WARM_DECODE_STEPS = 20  # decode steps a worker runs before its phase starts (model loaded, batch full)


def run(cfg, quick: bool, steps: int | None = None) -> dict:
    """`steps` serving steps per phase (default 200 quick, 2000 full). On a CUDA GPU: serving
    and rollout on CUDA stream priorities in one process, no Redis (rose.bench._cuda)."""
    import torch

    if torch.cuda.is_available():
        from rose.bench._cuda import interference

        out = interference("cuda", quick, steps=steps)
        out["goal_protected_p99_over_alone"] = GOAL_PROTECTED_OVER_ALONE
        p = out["protected_p99_over_alone"]
        out["protected_p99_over_goal"] = None if p is None else round(p / GOAL_PROTECTED_OVER_ALONE, 3)
        return out
    import redis

    device = "cpu"
    steps = steps or (200 if quick else 2000)
    job = "bench-interference"
    serve = _serving_model(device)
    with private_stack(cfg, "interference", kafka=False) as c:
        fill_tasks(c, job, 300 if quick else 3000, turns=8, tokens_per_turn=64)
        r = redis.Redis.from_url(c.redis.url)
        try:
            alone = percentiles_ms(_measure(serve, steps))
            slo_ms = alone["p99_ms"] * SLO_OVER_ALONE
            lat: dict[str, dict] = {"alone": alone}
            rollout: dict[str, dict] = {
                "alone": {
                    "tokens_per_s": 0.0,
                    "decode_steps_per_s": 0.0,
                    "paused_fraction": None,
                    "note": "no rollout worker",
                }
            }
            for mode in ("unprotected", "protected"):
                lat[mode], rollout[mode] = _beside_rollout(
                    cfg, c, r, job, device, serve, steps, slo_ms, protected=mode == "protected"
                )
        finally:
            r.close()
    a, u, p = lat["alone"]["p99_ms"], lat["unprotected"]["p99_ms"], lat["protected"]["p99_ms"]
    tu, tp = rollout["unprotected"]["tokens_per_s"], rollout["protected"]["tokens_per_s"]
    kept = tp / tu if tu > 0 else None
    return {
        "device": device,
        "serving_steps_per_phase": steps,
        "serving_step": "a 2-layer transformer encoder forward pass, batch 4 × 64 tokens, d_model 256 (1 thread on CPU)",
        "rollout_work": "the rollout worker's real policy model (rose.rollout.policy_model, default ModelSpec) "
        "decoding agentic episodes from the task queue, continuous batching; tokens/s from the "
        "worker's own counters (Redis heartbeat), decode steps/s from its pause flag",
        "alone_ms": lat["alone"],
        "unprotected_ms": lat["unprotected"],
        "protected_ms": lat["protected"],
        "rollout": rollout,
        "unprotected_p99_over_alone": round(u / a, 3),
        "protected_p99_over_alone": round(p / a, 3),
        "goal_protected_p99_over_alone": GOAL_PROTECTED_OVER_ALONE,
        "protected_p99_over_goal": round(p / a / GOAL_PROTECTED_OVER_ALONE, 3),
        "rollout_tokens_per_s_unprotected": tu,
        "rollout_tokens_per_s_protected": tp,
        "protected_over_unprotected_tokens_per_s": None if kept is None else round(kept, 3),
        "goal_protected_over_unprotected_tokens_per_s": GOAL_TOKENS_KEPT,
        "protected_tokens_per_s_over_goal": None if kept is None else round(kept / GOAL_TOKENS_KEPT, 3),
        "goals": {
            "protected_p99_over_alone": f"<= {GOAL_PROTECTED_OVER_ALONE} (p99_over_goal <= 1 is met)",
            "protected_over_unprotected_tokens_per_s": f">= {GOAL_TOKENS_KEPT}, the compute share "
            "protection grants (tokens_per_s_over_goal >= 1 is met)",
        },
        "slo_ms": round(slo_ms, 3),
        "protection": f"worker at nice 19 with compute_share {PROTECTED_SHARE} (CPU: that share of the cores; "
        "CUDA: the lowest-priority stream), plus the local guard: the serving loop writes its "
        "rolling p99 each step, the guard pauses the worker below 10% headroom and resumes it at "
        "30%; unprotected = nice 0, every core, no guard",
        "cpu_count": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


class _Rollout:
    """One rollout worker beside the serving loop: its pause flag (and the time the flag was
    up), its decode steps (counted in the flag) and its tokens (from its Redis heartbeat)."""

    def __init__(self, c, r, job: str, device: str, mode: str, protected: bool):
        from rose.rollout.launcher import WorkerConfig, launch

        self.r = r
        self.flag = PauseFlag(f"rose-bench-{os.getpid()}-{mode}", create=True)
        self.flag.set(RUN)
        self._lock = threading.Lock()
        self._paused_ns = 0
        self._paused_since: int | None = None
        config = WorkerConfig.from_config(
            c,
            gpu=GPU,
            worker_id=f"bench-{mode}",
            job=job,
            model="bench",
            device=device,
            mem_bytes=2 << 30,
            compute_share=PROTECTED_SHARE if protected else 1.0,
            pause_flag=self.flag.name,
            dedicated=False,
            nice=19 if protected else 0,
            seed=1,
        )
        self.worker_id = config.worker_id
        from rose.contract.records import WorkerRegistry  # not at import: the GPU check has no orjson

        self.workers = WorkerRegistry(r, c.redis.key)
        self.proc = launch(config, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)

    def wait_decoding(self, n: int = WARM_DECODE_STEPS, timeout_s: float = 120.0) -> None:
        """Until the worker has run `n` decode steps (model loaded, episodes admitted)."""
        deadline = time.monotonic() + timeout_s
        while self.flag.steps < n:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"interference bench: rollout worker exited with code {self.proc.returncode} before decoding"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"interference bench: rollout worker ran {self.flag.steps} decode steps in {timeout_s:g} s"
                )
            time.sleep(0.01)

    def set(self, state: int) -> None:
        """Raise or lower the flag (the guard's callbacks), keeping the time it is up."""
        now = time.monotonic_ns()
        with self._lock:
            if state == PAUSE and self._paused_since is None:
                self._paused_since = now
            elif state != PAUSE and self._paused_since is not None:
                self._paused_ns += now - self._paused_since
                self._paused_since = None
        self.flag.set(state)

    def heartbeat(self) -> tuple[float, int]:
        """(worker's wall time, tokens decoded) of its last heartbeat."""
        hb = self.workers.read(self.worker_id)
        return (0.0, 0) if hb is None else (hb.ts, hb.tokens)

    def fresh_heartbeat(self, timeout_s: float = 2.0) -> tuple[float, int]:
        """The worker's next heartbeat (it publishes every Worker.HEARTBEAT_S)."""
        first = self.heartbeat()
        deadline = time.monotonic() + timeout_s
        while (hb := self.heartbeat())[0] == first[0] and time.monotonic() < deadline:
            time.sleep(0.002)
        return hb

    def mark(self) -> dict:
        now = time.monotonic_ns()
        with self._lock:
            paused = self._paused_ns + (now - self._paused_since if self._paused_since is not None else 0)
        ts, tokens = self.heartbeat()
        return {"ns": now, "paused_ns": paused, "steps": self.flag.steps, "hb_ts": ts, "tokens": tokens}

    def close(self) -> int:
        return stop_process(self.proc, self.flag, 10.0)


def stop_process(proc: subprocess.Popen, flag, timeout_s: float) -> int:
    """Set the process's pause flag to STOP, wait up to `timeout_s` for it to exit (then kill
    it), close and remove the flag; its exit code."""
    flag.set(STOP)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    flag.close()
    flag.unlink()
    return proc.wait()  # exited: its code


def rollout_figures(start: dict, end: dict) -> dict:
    """Rollout work between two `_Rollout.mark`s: tokens/s over the worker's own heartbeat
    times, decode steps/s and the fraction of the phase the pause flag was up."""
    dt = (end["ns"] - start["ns"]) / 1e9
    hb_dt = end["hb_ts"] - start["hb_ts"]
    return {
        "tokens_per_s": round((end["tokens"] - start["tokens"]) / hb_dt, 1) if hb_dt > 0 else 0.0,
        "decode_steps_per_s": round((end["steps"] - start["steps"]) / dt, 1) if dt > 0 else 0.0,
        "paused_fraction": round((end["paused_ns"] - start["paused_ns"]) / (end["ns"] - start["ns"]), 3)
        if end["ns"] > start["ns"]
        else 0.0,
        "phase_s": round(dt, 3),
    }


def _beside_rollout(
    cfg, c, r, job: str, device: str, serve, steps: int, slo_ms: float, protected: bool
) -> tuple[dict, dict]:
    """Serving latency and rollout work with one worker running beside the serving loop."""
    from rose.contract.events import Latency
    from rose.executor.guard import FileLatencySource, Guard, LatencySample, default_latency_dir, write_latency

    mode = "protected" if protected else "unprotected"
    w = _Rollout(c, r, job, device, mode, protected)
    guard, report = None, None
    lat_dir = default_latency_dir() / f"bench-{os.getpid()}"
    try:
        w.wait_decoding()
        if protected:
            guard = Guard(
                [GPU],
                FileLatencySource(lat_dir),
                on_trip=lambda _g: w.set(PAUSE),
                on_clear=lambda _g: w.set(RUN),
                trip_headroom=cfg.policy.revoke_headroom,
                clear_headroom=cfg.policy.grant_headroom,
                period_s=0.0005,
            ).start()
            slo = Latency(slo_ms, slo_ms)

            def report(p99: float) -> None:
                write_latency(lat_dir, GPU, LatencySample(time.time(), Latency(p99, p99), slo))

        w.fresh_heartbeat()
        start = w.mark()
        samples = _measure(serve, steps, report=report)
        end = w.mark()
    finally:
        if guard is not None:
            guard.stop()
        code = w.close()
        for f in lat_dir.glob("*"):
            f.unlink()
        if lat_dir.exists():
            lat_dir.rmdir()
    work = {**rollout_figures(start, end), "worker_exit_code": code}
    if guard is not None:
        work["guard_trips"] = guard.trips
    return percentiles_ms(samples), work


def _serving_model(device: str):
    import torch

    if device == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).to(device).eval()
    x = torch.randn(4, 64, 256, device=device)

    def step():
        with torch.inference_mode():
            model(x)
        if device != "cpu":
            torch.cuda.synchronize()

    for _ in range(10):
        step()
    return step


def _measure(step, n: int, report=None, window: int = 20) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        step()
        out.append(time.perf_counter_ns() - t0)
        if report is not None:
            report((percentile(out[-window:], 0.99) or 0.0) / 1e6)
    return out
