"""Serving p99 of a real model step beside a rollout worker: alone, unprotected, and with ROSE protection (nice, compute share, guard + pause flag)."""

from __future__ import annotations

import subprocess
import time

GOAL_PROTECTED_OVER_ALONE = 1.05
SLO_OVER_ALONE = 1.5  # the serving SLO of this bench: 1.5 × the p99 measured alone
GPU = "bench/0"


def run(cfg, quick: bool) -> dict:
    import os

    import torch

    from rose.bench._stack import fill_tasks, percentiles_ms, private_stack
    from rose.contract.events import Latency
    from rose.executor.guard import FileLatencySource, Guard, LatencySample, default_latency_dir, write_latency
    from rose.rollout.pause_flag import PAUSE, RUN, PauseFlag
    from rose.rollout.worker import WorkerSpec

    device = "cuda" if torch.cuda.is_available() else "cpu"
    steps = 200 if quick else 2000
    job = "bench-interference"
    serve = _serving_model(device)
    with private_stack(cfg, "interference", kafka=False) as c:
        fill_tasks(c, job, 300 if quick else 3000, turns=8, tokens_per_turn=64)
        alone = _measure(serve, steps, device)
        alone_p99 = percentiles_ms(alone)["p99_ms"]
        slo_ms = alone_p99 * SLO_OVER_ALONE

        def worker(nice: int, share: float, flag: PauseFlag):
            spec = WorkerSpec(gpu=GPU, worker_id=f"bench-{nice}", redis_url=c.redis.url, key_prefix=c.redis.key_prefix,
                              job=job, model="bench", device=device, mem_bytes=2 << 30, compute_share=share,
                              pause_flag=flag.name, dedicated=False, nice=nice, seed=1)
            proc = subprocess.Popen(spec.to_argv(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            b0, deadline = flag.heartbeat, time.monotonic() + 60
            while flag.heartbeat < b0 + 20 and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.01)
            return proc

        def stop(proc, flag):
            flag.set(2)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

        results = {}
        for mode in ("unprotected", "protected"):
            flag = PauseFlag(f"rose-bench-{os.getpid()}-{mode}", create=True)
            flag.set(RUN)
            protected = mode == "protected"
            proc = worker(19 if protected else 0, 0.5 if protected else 1.0, flag)
            guard = None
            lat_dir = default_latency_dir() / f"bench-{os.getpid()}"
            if protected:
                guard = Guard([GPU], FileLatencySource(lat_dir), on_trip=lambda _g: flag.set(PAUSE),
                              on_clear=lambda _g: flag.set(RUN), trip_headroom=cfg.policy.revoke_headroom,
                              clear_headroom=cfg.policy.grant_headroom, period_s=0.0005).start()
            b0, t0 = flag.heartbeat, time.monotonic()
            try:
                lat = _measure(serve, steps, device,
                               report=(lambda p99: write_latency(lat_dir, GPU, LatencySample(
                                   time.time(), Latency(p99, p99), Latency(slo_ms, slo_ms)))) if protected else None)
            finally:
                beats = flag.heartbeat - b0
                dt = time.monotonic() - t0
                if guard is not None:
                    guard.stop()
                stop(proc, flag)
                flag.close()
                flag.unlink()
                for f in lat_dir.glob("*"):
                    f.unlink()
                if lat_dir.exists():
                    lat_dir.rmdir()
            results[mode] = {**percentiles_ms(lat), "rollout_loop_iters_per_s": round(beats / dt, 1),
                             "worker_exit_code": proc.returncode}
            if guard is not None:
                results[mode]["guard_trips"] = guard.trips
    a = percentiles_ms(alone)
    u, p = results["unprotected"], results["protected"]
    return {
        "device": device,
        "serving_steps_per_phase": steps,
        "serving_step": "a 2-layer transformer encoder forward pass, batch 4 × 64 tokens, d_model 256 (1 thread on CPU)",
        "alone_ms": a,
        "unprotected_ms": {k: v for k, v in u.items()},
        "protected_ms": {k: v for k, v in p.items()},
        "unprotected_p99_over_alone": round(u["p99_ms"] / a["p99_ms"], 3),
        "protected_p99_over_alone": round(p["p99_ms"] / a["p99_ms"], 3),
        "goal_protected_p99_over_alone": GOAL_PROTECTED_OVER_ALONE,
        "protected_over_goal": round(p["p99_ms"] / a["p99_ms"] / GOAL_PROTECTED_OVER_ALONE, 3),
        "slo_ms": round(slo_ms, 3),
        "protection": "worker at nice 19 with half the cores (compute_share 0.5), plus the local guard: the serving "
                      "loop writes its rolling p99 each step, the guard pauses the worker below 10% headroom and "
                      "resumes it at 30%; unprotected = nice 0, every core, no guard",
        "cpu_count": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


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


def _measure(step, n: int, device: str, report=None, window: int = 20) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        step()
        out.append(time.perf_counter_ns() - t0)
        if report is not None:
            recent = sorted(out[-window:])
            report(recent[min(len(recent) - 1, int(0.99 * len(recent)))] / 1e6)
    return out
