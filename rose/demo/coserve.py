"""The real co-served device of the demo: a small torch transformer answering requests replayed
from a trace, with latency MEASURED by the wall clock, publishing rose.telemetry.v1 for one GPU
id (default `real/0`).

    python -m rose.demo.coserve --spec '<CoserveSpec JSON>'      (config from ROSE_* env)

It serves with `rose.rollout.engine.TorchEngine` (continuous batching), measures TTFT and TPOT of
every request, and publishes the p99 of each over the last `lookback_s` seconds every telemetry
period (and writes it for the executor's local guard). Its SLO is the run's configured serving
SLO (`telemetry.slo_ttft_ms`, `telemetry.slo_tpot_ms`), the same as every other serving GPU of
the run reports. At exit it leaves every request's latency in its status hash, each marked with
whether a rollout lease was running on the device. Load, latency, SLO and memory definitions:
docs/demo.md.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rose.demo.spec_process import JsonSpec, spec_main
from rose.obs.stats import percentile


@dataclass(frozen=True)
class CoserveSpec(JsonSpec):
    trace: str
    gpu: str = "real/0"
    node: str = "real"
    replicas: int = 1  # the trace is spread over this many replicas; this device takes one share
    speed: float = 1.0
    device: str = "cpu"
    seed: int = 7
    prompt_scale: float = 1 / 16
    output_scale: float = 1 / 8
    max_prompt: int = 192
    max_output: int = 48
    max_batch: int = 8
    d_model: int = 256
    n_layers: int = 4
    lookback_s: float = 2.0
    latency_dir: str = ""  # where the local guard reads this device's latency ("" = no guard file)
    guard_every_s: float = 0.02
    status_key: str = "demo:coserve"  # Redis hash: SLO, state; at exit the summary and every request
    threads: int = 1


# ---- pure parts ----------------------------------------------------------------------------
def scaled_lengths(prompt: np.ndarray, output: np.ndarray, spec: CoserveSpec) -> tuple[np.ndarray, np.ndarray]:
    """Trace token counts scaled to this small model (at least 4 prompt tokens, 2 output tokens)."""
    p = np.clip(np.rint(prompt * spec.prompt_scale), 4, spec.max_prompt).astype(int)
    o = np.clip(np.rint(output * spec.output_scale), 2, spec.max_output).astype(int)
    return p, o


@dataclass
class LatencyWindow:
    """Samples (time, ms) of one metric; p99 over the last `lookback_s` (the last value when
    the lookback is empty: a device without traffic does not look faster than it was)."""

    lookback_s: float
    samples: deque = field(default_factory=deque)
    last: float = 0.0

    def add(self, t: float, ms: float) -> None:
        self.samples.append((t, ms))

    def p99(self, now: float) -> float:
        while self.samples and self.samples[0][0] < now - self.lookback_s:
            self.samples.popleft()
        if self.samples:
            self.last = percentile([ms for _, ms in self.samples], 0.99) or 0.0
        return self.last


def latency_summary(rows: list[tuple[float, float, float, bool]]) -> dict:
    """Per-request latency, split by whether a rollout lease was running on the device: rows are
    (finish wall time, TTFT ms, mean TPOT ms, rollout running)."""
    out: dict[str, Any] = {"requests": len(rows)}
    for name, flag in (("with_rollout", True), ("without_rollout", False)):
        sel = [d for d in rows if bool(d[3]) is flag]
        out[name] = {
            "requests": len(sel),
            "ttft_p50_ms": percentile([d[1] for d in sel], 0.5, 3),
            "ttft_p99_ms": percentile([d[1] for d in sel], 0.99, 3),
            "tpot_p50_ms": percentile([d[2] for d in sel], 0.5, 3),
            "tpot_p99_ms": percentile([d[2] for d in sel], 0.99, 3),
        }
    return out


# ---- the device ----------------------------------------------------------------------------
@dataclass
class _Req:
    rid: str
    arrival: float  # monotonic
    prompt: list[int]
    n_out: int
    got: int = 0
    first_t: float = 0.0
    last_t: float = 0.0


class CoServed:
    def __init__(self, spec: CoserveSpec, cfg, r):
        import torch

        from rose.rollout.engine import MemoryBudget, TorchEngine
        from rose.rollout.policy_model import ModelSpec, init_state_dict
        from rose.sim.serving_model import spread
        from rose.sim.traces import load_trace

        self.spec, self.cfg, self.r = spec, cfg, r
        torch.set_num_threads(spec.threads)
        self.mspec = ModelSpec(
            d_model=spec.d_model,
            n_layers=spec.n_layers,
            n_heads=max(1, spec.d_model // 32),
            d_ff=4 * spec.d_model,
            max_seq=spec.max_prompt + spec.max_output + 8,
        )
        self.engine = TorchEngine(
            self.mspec, MemoryBudget(2 << 30, self.mspec), max_batch=spec.max_batch, device=spec.device
        )
        self.engine.load_weights(0, init_state_dict(self.mspec, spec.seed))
        tr = load_trace(spec.trace).scaled(spec.speed)
        mine = spread(tr, spec.replicas, seed=spec.seed) == 0
        self.arrival = tr.arrival_s[mine]
        self.p_len, self.o_len = scaled_lengths(tr.prompt_tokens[mine], tr.output_tokens[mine], spec)
        self.rng = np.random.default_rng(spec.seed)
        self.ttft = LatencyWindow(spec.lookback_s)
        self.tpot = LatencyWindow(spec.lookback_s)
        self.queue: deque[_Req] = deque()
        self.running: dict[str, _Req] = {}
        self.stop = False
        self.served = 0
        # per request: (finish wall time, ttft ms, mean tpot ms, rollout running on this device)
        self.done: list[tuple[float, float, float, bool]] = []
        self.is_cuda = spec.device.startswith("cuda")

    def _warm(self) -> None:
        from rose.rollout.engine import GenRequest

        for i in range(3):
            self.engine.generate([GenRequest(f"warm{i}", [1] * 16, 0)], 1)
            self.engine.release(f"warm{i}")

    def run(self) -> dict:
        import psutil

        from rose.contract.events import Latency
        from rose.executor.guard import LatencySample, write_latency
        from rose.kafka.telemetry_publisher import TelemetryPublisher
        from rose.node.lease_view import LeaseFollower, LeaseView
        from rose.node.telemetry import telemetry_records
        from rose.rollout.engine import GenRequest

        spec, cfg, r = self.spec, self.cfg, self.r
        key = cfg.redis.key
        self._warm()
        pub = TelemetryPublisher(cfg.kafka, cfg.kafka.telemetry_topic, linger_ms=cfg.telemetry.linger_ms)
        view = LeaseView(default_share=cfg.policy.max_compute_share)
        follower = LeaseFollower(cfg, view)
        proc = psutil.Process()
        period = cfg.telemetry.period_s
        run_id = uuid.uuid4().hex[:12]
        slo = (cfg.telemetry.slo_ttft_ms, cfg.telemetry.slo_tpot_ms)
        t0 = time.monotonic()
        nxt = 0
        seq = 0
        next_tel = t0 + period
        next_guard = t0
        cpu0 = proc.cpu_times()
        cpu_t0 = time.monotonic()
        busy_s = 0.0
        arrivals_in_window = 0
        rollout_now = False
        r.hset(
            key(spec.status_key),
            mapping={
                "state": "serving",
                "device": spec.device,
                "gpu": spec.gpu,
                "slo_ttft_ms": slo[0],
                "slo_tpot_ms": slo[1],
                "slo_source": "telemetry.slo_ttft_ms / telemetry.slo_tpot_ms of the run's config",
            },
        )
        while not self.stop:
            now = time.monotonic()
            # arrivals (the replay clock is the process's own; it loops over the trace)
            t_rel = now - t0
            while nxt < len(self.arrival) and self.arrival[nxt] <= t_rel:
                n = int(self.p_len[nxt])
                self.queue.append(
                    _Req(
                        f"r{nxt}",
                        t0 + float(self.arrival[nxt]),
                        self.rng.integers(1, 256, n).tolist(),
                        int(self.o_len[nxt]),
                    )
                )
                nxt += 1
                arrivals_in_window += 1
            while self.queue and len(self.running) < self.engine.n_slots:
                q = self.queue.popleft()
                self.running[q.rid] = q
            if self.running:
                reqs = [GenRequest(q.rid, q.prompt if q.got == 0 else [], None) for q in self.running.values()]
                for q in self.running.values():
                    q.prompt = []
                s0 = time.monotonic()
                self.engine.generate(reqs, 1)
                if self.is_cuda:
                    import torch

                    torch.cuda.synchronize()
                t = time.monotonic()
                busy_s += t - s0
                for q in list(self.running.values()):
                    if q.got == 0:
                        q.first_t = t
                        self.ttft.add(t, (t - q.arrival) * 1000.0)
                    else:
                        self.tpot.add(t, (t - q.last_t) * 1000.0)
                    q.last_t = t
                    q.got += 1
                    if q.got >= q.n_out:
                        self.engine.release(q.rid)
                        del self.running[q.rid]
                        self.served += 1
                        tpot_mean = (q.last_t - q.first_t) * 1000.0 / max(1, q.got - 1)
                        self.done.append((time.time(), (q.first_t - q.arrival) * 1000.0, tpot_mean, rollout_now))
            else:
                wait = 0.005
                if nxt < len(self.arrival):
                    wait = min(wait, max(0.0, t0 + float(self.arrival[nxt]) - time.monotonic()))
                time.sleep(wait)
            now = time.monotonic()
            if spec.latency_dir and now >= next_guard:
                next_guard = now + spec.guard_every_s
                write_latency(
                    spec.latency_dir,
                    spec.gpu,
                    LatencySample(time.time(), Latency(self.ttft.p99(now), self.tpot.p99(now)), Latency(*slo)),
                )
            if now >= next_tel:
                next_tel += period
                if next_tel < now:  # fell behind (a stall): keep the period, skip the missed ticks
                    next_tel = now + period
                follower.poll()
                share, running, rmem = view.rollout(spec.gpu)
                rollout_now = running
                cpu1, cpu_t1 = proc.cpu_times(), time.monotonic()
                dt = max(1e-6, cpu_t1 - cpu_t0)
                util = (busy_s / dt) if self.is_cuda else ((cpu1.user + cpu1.system - cpu0.user - cpu0.system) / dt)
                cpu0, cpu_t0, busy_s = cpu1, cpu_t1, 0.0
                total, used = self._memory()
                recs = telemetry_records(
                    ts=time.time(),
                    node=spec.node,
                    gpus=[spec.gpu],
                    pool=cfg.telemetry.pool,
                    slo=slo,
                    run_id=run_id,
                    seq=seq,
                    util=[min(1.0, util)],
                    mem_total=total,
                    mem_used=[max(used, rmem)],
                    rollout_mem=[rmem],
                    ttft_ms=[self.ttft.p99(now)],
                    tpot_ms=[self.tpot.p99(now)],
                    rps=[arrivals_in_window / period],
                    queue=[len(self.queue)],
                )
                pub.publish(recs, ts_ms=int(time.time() * 1000))
                seq += 1
                arrivals_in_window = 0
                pub.tick()
            if nxt >= len(self.arrival) and not self.running and not self.queue:
                t0, nxt = time.monotonic(), 0  # replay the trace again
        pub.flush(5.0)
        follower.close()
        summary = latency_summary(self.done)
        rows = [(round(t, 3), round(a, 3), round(b, 3), int(f)) for t, a, b, f in self.done]
        r.hset(
            key(spec.status_key),
            mapping={"state": "stopped", "summary": json.dumps(summary), "requests": json.dumps(rows)},
        )
        return summary

    def _memory(self) -> tuple[int, int]:
        if self.is_cuda:
            import torch

            free, total = torch.cuda.mem_get_info(torch.device(self.spec.device))
            return int(total), int(total - free)
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.total - vm.available)


def main(argv: list[str] | None = None) -> int:
    return spec_main("rose.demo.coserve", CoserveSpec, CoServed, argv)


if __name__ == "__main__":
    sys.exit(main())
