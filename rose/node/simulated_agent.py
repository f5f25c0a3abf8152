"""The simulated serving-node agent (`rose agent --simulate TRACE`): a request trace spread over N
simulated GPUs (`{node}/{i}`) and turned into latency, memory and utilisation by
rose.sim.serving_model, one window per period, published like the real agent's. Event time is
the simulation time mapped onto the wall clock at start, so events are monotone per GPU also
without pacing. It follows the leases (rose.node.lease_view): an `active` lease runs rollout at
its share, a `paused` one holds memory only, so a pause or a revoke restores serving latency at
the next window."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rose.config import Config
from rose.node.lease_view import LeaseFollower, LeaseView
from rose.node.telemetry import feed_guard, telemetry_records, window_span
from rose.obs.logs import get_logger

log = get_logger("rose.agent")


@dataclass
class SimOptions:
    trace: str
    gpus: int
    duration_s: float | None = None  # default: the (scaled) trace's length
    speed: float = 1.0
    model_size: str | None = None  # default: telemetry.model_size
    gpu_type: str | None = None  # default: telemetry.gpu_type
    node: str = "sim"
    seed: int = 0
    pace: bool = True  # False: as fast as possible (bench, tests of the encoding)
    guard_dir: str | None = None  # also feed each window's p99 to the executor's local guard here


def run_simulated(
    cfg: Config, opt: SimOptions, stop: Callable[[], bool] = lambda: False, publisher=None, follow_leases: bool = True
) -> dict:
    """Publish simulated telemetry until the duration ends or `stop()`; returns counters."""
    from rose.kafka.telemetry_publisher import TelemetryPublisher
    from rose.sim.interference import read_profile
    from rose.sim.models import gpu_spec, model_size
    from rose.sim.serving_model import ServingSim, spread, windows
    from rose.sim.traces import load_trace

    tc = cfg.telemetry
    trace = load_trace(opt.trace).scaled(opt.speed)
    sim = ServingSim(
        gpu_spec(opt.gpu_type or tc.gpu_type),
        model_size(opt.model_size or tc.model_size),
        opt.gpus,
        alpha=tc.interference_alpha,
        profile=read_profile(Path(tc.interference_profile)) if tc.interference_profile else None,
    )
    gpu_of = spread(trace, sim.replicas, seed=opt.seed)  # a replica per GPU unless tensor parallel
    gpus = [f"{opt.node}/{i}" for i in range(opt.gpus)]
    duration = opt.duration_s if opt.duration_s is not None else trace.duration_s
    pub = publisher or TelemetryPublisher.for_config(cfg)
    view = LeaseView(default_share=cfg.policy.max_compute_share)
    follower = None
    if follow_leases:
        from rose.kafka.producer import dead_letter

        follower = LeaseFollower(
            cfg,
            view,
            dlq=lambda m, reason, fld: dead_letter(
                pub.producer, cfg.kafka.dlq_topic, m, reason, fld, consumer="rose-agent"
            ),
        )
    run_id = uuid.uuid4().hex[:12]
    slo = (tc.slo_ttft_ms, tc.slo_tpot_ms)
    wall0, mono0 = time.time(), time.monotonic()
    last_health = mono0
    windows_done = 0
    a, pt, ot = trace.arrival_s, trace.prompt_tokens, trace.output_tokens
    try:
        for w, (t_end, sl) in enumerate(windows(a, tc.period_s, t_end=duration)):
            if stop():
                break
            if opt.pace:
                while (left := mono0 + t_end - time.monotonic()) > 0 and not stop():
                    pub.tick()
                    time.sleep(min(left, 0.02))
                if stop():
                    break
            if follower is not None:
                follower.poll()
                for i, g in enumerate(gpus):
                    if g in view.states or sim.rollout_running[i] or sim.rollout_mem[i]:
                        share, running, mem = view.rollout(g)
                        sim.set_rollout(i, share, running, mem)
            s = sim.advance(t_end, gpu_of[sl], a[sl], pt[sl], ot[sl])
            ts = wall0 + t_end
            recs = telemetry_records(
                ts=ts,
                node=opt.node,
                gpus=gpus,
                pool=tc.pool,
                slo=slo,
                run_id=run_id,
                seq=w,
                util=s.gpu_util.tolist(),
                mem_total=int(s.mem_total_bytes),
                mem_used=s.mem_used_bytes.tolist(),
                rollout_mem=s.rollout_mem_bytes.tolist(),
                ttft_ms=s.ttft_p99_ms.tolist(),
                tpot_ms=s.tpot_p99_ms.tolist(),
                rps=s.rps.tolist(),
                queue=s.queue_depth.tolist(),
            )
            with window_span("telemetry.window", gpus=len(gpus), window=w):
                pub.publish(recs, ts_ms=int(ts * 1000))
            if opt.guard_dir:
                feed_guard(opt.guard_dir, gpus, ts, s.ttft_p99_ms, s.tpot_p99_ms, slo)
            windows_done += 1
            if time.monotonic() - last_health >= 10.0:
                last_health = time.monotonic()
                log.info("agent health", windows=windows_done, **pub.counters())
    finally:
        if follower is not None:
            follower.close()
    return {"windows": windows_done, "gpus": opt.gpus, **pub.counters()}
