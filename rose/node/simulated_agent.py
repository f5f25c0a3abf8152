"""The simulated serving-node agent (`rose agent --simulate TRACE`): a request trace spread over N
simulated GPUs (`{node}/{i}`) and turned into latency, memory and utilisation by
rose.sim.serving_model, one window per period, published like the real agent's. Event time is
the simulation time mapped onto the wall clock at start, so events are monotone per GPU also
without pacing. It follows the leases (rose.node.lease_view): an `active` lease runs rollout at
its share, a `paused` one holds memory only, so a pause or a revoke restores serving latency at
the next window. The GPUs of a tensor-parallel replica name it as their `replica` (CONTRACT §7):
the id of its first GPU."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rose.config import Config
from rose.node.agent_loop import GuardFeed, Window, run_agent
from rose.node.lease_view import LeaseView
from rose.node.telemetry import telemetry_records


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


class SimulatedSource:
    """The trace-driven serving model as a telemetry source: the trace's arrivals window by
    window, the GPUs' rollout set from the lease view, event time on the wall clock at start."""

    def __init__(self, cfg: Config, opt: SimOptions):
        from rose.sim.interference import read_profile
        from rose.sim.models import gpu_spec, model_size
        from rose.sim.serving_model import ServingSim, spread
        from rose.sim.traces import load_trace

        tc = cfg.telemetry
        self.cfg, self.opt = cfg, opt
        self.trace = load_trace(opt.trace).scaled(opt.speed)
        self.sim = ServingSim(
            gpu_spec(opt.gpu_type or tc.gpu_type),
            model_size(opt.model_size or tc.model_size),
            opt.gpus,
            alpha=tc.interference_alpha,
            profile=read_profile(Path(tc.interference_profile)) if tc.interference_profile else None,
        )
        self.gpu_of = spread(self.trace, self.sim.replicas, seed=opt.seed)  # a replica per GPU unless tensor parallel
        self.gpus = [f"{opt.node}/{i}" for i in range(opt.gpus)]
        self.replica = tensor_parallel_replicas(self.gpus, self.sim.tp)
        self.duration = opt.duration_s if opt.duration_s is not None else self.trace.duration_s
        self.run_id = uuid.uuid4().hex[:12]
        self.wall0 = time.time()
        self.t_end, self.sl = 0.0, slice(0, 0)  # the window now due: its end (simulation time) and arrivals

    def deadlines(self) -> Iterator[float]:
        from rose.sim.serving_model import windows

        self.wall0, mono0 = time.time(), time.monotonic()
        for t_end, sl in windows(self.trace.arrival_s, self.cfg.telemetry.period_s, t_end=self.duration):
            self.t_end, self.sl = t_end, sl
            yield mono0 + t_end if self.opt.pace else -math.inf

    def idle(self, budget_s: float) -> None:
        time.sleep(budget_s)

    def window(self, seq: int, view: LeaseView | None) -> Window:
        sim, tc, sl, tr = self.sim, self.cfg.telemetry, self.sl, self.trace
        if view is not None:
            for i, g in enumerate(self.gpus):
                if g in view.states or sim.rollout_running[i] or sim.rollout_mem[i]:
                    share, running, mem = view.rollout(g)
                    sim.set_rollout(i, share, running, mem)
        s = sim.advance(self.t_end, self.gpu_of[sl], tr.arrival_s[sl], tr.prompt_tokens[sl], tr.output_tokens[sl])
        ts = self.wall0 + self.t_end
        recs = telemetry_records(
            ts=ts,
            node=self.opt.node,
            gpus=self.gpus,
            pool=tc.pool,
            slo=(tc.slo_ttft_ms, tc.slo_tpot_ms),
            run_id=self.run_id,
            seq=seq,
            util=s.gpu_util.tolist(),
            mem_total=int(s.mem_total_bytes),
            mem_used=s.mem_used_bytes.tolist(),
            rollout_mem=s.rollout_mem_bytes.tolist(),
            ttft_ms=s.ttft_p99_ms.tolist(),
            tpot_ms=s.tpot_p99_ms.tolist(),
            rps=s.rps.tolist(),
            queue=s.queue_depth.tolist(),
            replica=self.replica,
        )
        guard = GuardFeed(self.gpus, s.ttft_p99_ms, s.tpot_p99_ms)
        return Window(ts, recs, guard, "telemetry.window", {"gpus": len(self.gpus), "window": seq})


def tensor_parallel_replicas(gpus: list[str], tp: int) -> dict[str, str]:
    """GPU -> its replica, where GPUs `r*tp .. r*tp+tp-1` are replica r (rose.sim.serving_model):
    the replica is named after its first GPU, so with tp 1 every GPU is a replica of its own."""
    return {g: gpus[i - i % tp] for i, g in enumerate(gpus)}


def run_simulated(
    cfg: Config, opt: SimOptions, stop: Callable[[], bool] = lambda: False, publisher=None, follow_leases: bool = True
) -> dict:
    """Publish simulated telemetry until the duration ends or `stop()`; returns counters."""
    out = run_agent(
        cfg, SimulatedSource(cfg, opt), stop=stop, publisher=publisher, leases=follow_leases, guard_dir=opt.guard_dir
    )
    return {"windows": out.pop("windows"), "gpus": opt.gpus, **out}
