"""The real co-served device of the demo: a serving engine answering requests replayed from a
trace, with latency MEASURED, publishing rose.telemetry.v1 for one GPU id (default `real/0`).

    python -m rose.demo.coserve --spec '<CoserveSpec JSON>'      (config from ROSE_* env)

Two engines (`server`):

- "torch": a small torch transformer in this process (`rose.rollout.engine.TorchEngine`,
  continuous batching); the device measures TTFT and TPOT of every request by the wall clock and
  publishes the p99 of each over the last `lookback_s` seconds every telemetry period (and writes
  it for the executor's local guard every `guard_every_s`).
- "vllm": vLLM's OpenAI server on the checkpoint `model` (rose.vllm_server), started here in
  a session of its own; each request is a streaming `/v1/completions` of token ids. The published
  p99s and KV-cache usage are the server's own, read from its /metrics every telemetry period by
  the agent's reader (`rose.node.agent.scrape`, `rose.node.prometheus`), and each measured window
  goes to the local guard.

Either way the client keeps every request's TTFT and mean TPOT. Its SLO is the run's configured
serving SLO (`telemetry.slo_ttft_ms`, `telemetry.slo_tpot_ms`), the same as every other serving
GPU of the run reports. At exit it leaves every request's latency in its status hash, each marked
with whether a rollout lease was running on the device. Load, latency, SLO and memory
definitions: docs/demo.md.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Iterator

import numpy as np

from rose.demo.coserve_device import (
    CoserveSpec,
    Reading,
    Request,
    TorchServer,
    VllmServerDevice,
    latency_summary,
    scaled_lengths,
)
from rose.demo.spec_process import spec_main
from rose.node.agent_loop import GuardFeed, Window, run_agent
from rose.node.lease_view import LeaseView
from rose.node.telemetry import feed_guard, telemetry_records


class CoServed:
    """The trace replay, the telemetry, the guard file and the status hash, around one serving
    engine: `TorchServer` (spec.server "torch") or `VllmServerDevice` ("vllm")."""

    def __init__(self, spec: CoserveSpec, cfg, r):
        from rose.sim.serving_model import spread
        from rose.sim.traces import load_trace

        if spec.server not in ("torch", "vllm"):
            raise ValueError(f"server: expected torch or vllm, got {spec.server!r}")
        if spec.server == "vllm" and not spec.model:
            raise ValueError("server vllm needs model (a Hugging Face checkpoint directory)")
        if spec.peak_fraction and (spec.server != "vllm" or not 0 < spec.peak_fraction <= 1):
            raise ValueError(f"peak_fraction: needs server vllm and a value in (0, 1], got {spec.peak_fraction}")
        self.spec, self.cfg, self.r = spec, cfg, r
        tr = load_trace(spec.trace).scaled(spec.speed)
        mine = spread(tr, spec.replicas, seed=spec.seed) == 0
        self.arrival = tr.arrival_s[mine]
        self.p_len, self.o_len = scaled_lengths(tr.prompt_tokens[mine], tr.output_tokens[mine], spec)
        self.rng = np.random.default_rng(spec.seed)
        self.stop = False
        self.served = 0
        self.rollout_now = False
        # per request: (finish wall time, ttft ms, mean tpot ms, rollout running on this device)
        self.done: list[tuple[float, float, float, bool]] = []
        self.is_cuda = spec.device.startswith("cuda")
        self.run_id = uuid.uuid4().hex[:12]
        self.t0 = self.util_t0 = self.next_guard = 0.0  # the replay's clock (set when serving starts)
        self.nxt, self.arrivals_in_window = 0, 0  # the trace's next request, arrivals in this window
        self.server: TorchServer | VllmServerDevice
        if spec.server == "vllm":
            self.server = VllmServerDevice(spec, self._finish, cfg.telemetry.period_s)
        else:
            self.server = TorchServer(spec, self._finish)

    def _finish(self, q: Request) -> None:
        """A request answered: its latency as the client saw it (queueing included in TTFT)."""
        self.served += 1
        tpot_mean = (q.last_t - q.first_t) * 1000.0 / max(1, q.got - 1)
        self.done.append((time.time(), (q.first_t - q.arrival) * 1000.0, tpot_mean, self.rollout_now))

    def run(self) -> dict:
        spec, cfg, r, server = self.spec, self.cfg, self.r, self.server
        key = cfg.redis.key
        slo = (cfg.telemetry.slo_ttft_ms, cfg.telemetry.slo_tpot_ms)
        status = {
            "device": spec.device,
            "gpu": spec.gpu,
            "slo_ttft_ms": slo[0],
            "slo_tpot_ms": slo[1],
            "slo_source": "telemetry.slo_ttft_ms / telemetry.slo_tpot_ms of the run's config",
        }
        r.hset(key(spec.status_key), mapping={"state": "starting", **status, "server": spec.server})
        try:
            status.update(server.start())
            if spec.peak_fraction:
                self._await_measure(status)
                status.update(self._scale_to_capacity())
            return self._serve(status)
        finally:
            server.close()

    def _await_measure(self, status: dict) -> None:
        """With `measure_when_key`: report "warm" and wait until the key exists (the demo sets it
        once its other processes run, so the capacity is measured beside them as the run will be)."""
        if not self.spec.measure_when_key:
            return
        key = self.cfg.redis.key
        self.r.hset(key(self.spec.status_key), mapping={"state": "warm", **status})
        while not self.stop and not self.r.exists(key(self.spec.measure_when_key)):
            time.sleep(0.25)
        self.r.hset(key(self.spec.status_key), "state", "measuring")

    def _scale_to_capacity(self) -> dict:
        """Measure the replica's capacity alone and scale the replay to `peak_fraction` of it at
        the trace's peak (rose.demo.capacity); the figures go to the status hash."""
        from rose.demo.capacity import measure, replayed, scaled_load

        spec, slo, server = self.spec, self._slo(), self.server
        assert isinstance(server, VllmServerDevice)  # __init__: peak_fraction needs server vllm

        def shown(lv) -> None:
            print(
                f"[coserve] capacity: {lv.clients} client(s) {lv.rps:.3f} req/s, p99 TTFT {lv.ttft_p99_ms} ms "
                f"TPOT {lv.tpot_p99_ms} ms (n={lv.requests})",
                flush=True,
            )

        levels = measure(
            server.serve_one, self.p_len, self.o_len, spec.capacity_clients, spec.capacity_level_s, slo,
            seed=spec.seed, progress=shown, meter=server.meter(),
        )  # fmt: skip
        load = scaled_load(
            levels, self.arrival, self.p_len, self.o_len, slo, spec.peak_fraction, spec.peak_bin_s, spec.replay_s
        )
        sent = replayed(len(self.arrival), load.keep, spec.seed)
        first = float(self.arrival[sent].min()) if sent.any() else 0.0
        self.arrival = (self.arrival[sent] - first) / load.speed
        self.p_len, self.o_len = self.p_len[sent], self.o_len[sent]
        held = load.held_back(slo)
        print(
            f"[coserve] capacity {load.capacity_rps} req/s; the trace ×{load.speed} as fast, {load.keep} of its requests; {held}",
            flush=True,
        )
        return {"serving_load": json.dumps({**load.to_dict(), "held_back": held})}

    def _serve(self, status: dict) -> dict:
        """Serve the trace and publish the device's telemetry through the node agent's loop
        (this device is its source) until `stop`; then leave the summary in the status hash."""
        from rose.kafka.telemetry_publisher import TelemetryPublisher

        spec, cfg, r = self.spec, self.cfg, self.r
        key = cfg.redis.key
        pub = TelemetryPublisher.for_config(cfg)
        r.hset(key(spec.status_key), mapping={"state": "serving", **status})
        run_agent(cfg, self, stop=lambda: self.stop, publisher=pub, leases=True, guard_dir=spec.latency_dir or None)
        pub.flush(5.0)
        done = list(self.done)
        summary = latency_summary(done)
        rows = [(round(t, 3), round(a, 3), round(b, 3), int(f)) for t, a, b, f in done]
        extra = getattr(self.server, "counts", {})
        r.hset(
            key(spec.status_key),
            mapping={"state": "stopped", "summary": json.dumps(summary), "requests": json.dumps(rows), **extra},
        )
        return summary

    # ---- the device as a telemetry source of the node agent's loop (rose.node.agent_loop) ----
    def deadlines(self) -> Iterator[float]:
        """A window every telemetry period from the replay's start; after a stall the period is
        kept and the missed windows skipped."""
        period = self.cfg.telemetry.period_s
        self.t0 = self.util_t0 = self.next_guard = time.monotonic()
        self.nxt, self.arrivals_in_window = 0, 0
        due = self.t0 + period
        while True:
            yield due
            due += period
            if due < (now := time.monotonic()):
                due = now + period

    def idle(self, budget_s: float) -> None:
        """Between windows: submit the trace's arrivals (the replay clock is the process's own;
        it loops over the trace), run an engine step and keep the guard file fresh."""
        server, now = self.server, time.monotonic()
        while self.nxt < len(self.arrival) and self.arrival[self.nxt] <= now - self.t0:
            n = int(self.p_len[self.nxt])
            arrival = self.t0 + float(self.arrival[self.nxt])
            server.submit(
                Request(f"r{self.nxt}", arrival, self.rng.integers(1, 256, n).tolist(), int(self.o_len[self.nxt]))
            )
            self.nxt += 1
            self.arrivals_in_window += 1
        if not server.step():
            wait = min(0.005, budget_s)
            if self.nxt < len(self.arrival):
                wait = min(wait, max(0.0, self.t0 + float(self.arrival[self.nxt]) - time.monotonic()))
            time.sleep(wait)
        now = time.monotonic()
        if server.continuous_guard and now >= self.next_guard and self.spec.latency_dir:
            self.next_guard = now + self.spec.guard_every_s
            if (g := server.reading(now)) is not None:
                feed_guard(self.spec.latency_dir, [self.spec.gpu], time.time(), [g.ttft_ms], [g.tpot_ms], self._slo())
        if self.nxt >= len(self.arrival) and not server.pending():
            self.t0, self.nxt = time.monotonic(), 0  # replay the trace again

    def window(self, seq: int, view: LeaseView | None) -> Window | None:
        """The window's record of this device (None: no window of the server's metrics yet)."""
        period, server, now = self.cfg.telemetry.period_s, self.server, time.monotonic()
        share, running, rmem = view.rollout(self.spec.gpu) if view is not None else (0.0, False, 0)
        self.rollout_now = running
        util = server.util(max(1e-6, now - self.util_t0))
        self.util_t0 = now
        rps, self.arrivals_in_window = self.arrivals_in_window / period, 0
        reading = server.reading(now)
        if reading is None:
            return None
        ts = time.time()
        fed = not server.continuous_guard and reading.measured  # a continuous guard is fed between windows
        guard = GuardFeed([self.spec.gpu], [reading.ttft_ms], [reading.tpot_ms]) if fed else None
        return Window(ts, self._records(reading, ts, seq, util, rmem, rps), guard)

    def _slo(self) -> tuple[float, float]:
        return self.cfg.telemetry.slo_ttft_ms, self.cfg.telemetry.slo_tpot_ms

    def _records(
        self, reading: Reading, ts: float, seq: int, util: float, rmem: int, rps: float
    ) -> list[tuple[bytes, bytes]]:
        """The window's rose.telemetry.v1 record of this device."""
        spec = self.spec
        total, used = self._memory()
        return telemetry_records(
            ts=ts,
            node=spec.node,
            gpus=[spec.gpu],
            pool=self.cfg.telemetry.pool,
            slo=self._slo(),
            run_id=self.run_id,
            seq=seq,
            util=[min(1.0, util)],
            mem_total=total,
            mem_used=[max(used, rmem)],
            rollout_mem=[rmem],
            ttft_ms=[reading.ttft_ms],
            tpot_ms=[reading.tpot_ms],
            rps=[rps],
            queue=[reading.queue],
            kv_cache_usage=[reading.kv_cache_usage],
        )

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
