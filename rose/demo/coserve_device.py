"""The co-served device's parts: its spec (`CoserveSpec`), the pure parts (trace lengths scaled to
the device, the rolling latency window, the latency summary) and the two servers a device runs,
torch in this process (`TorchServer`) or vLLM's OpenAI server (`VllmServerDevice`), each taking
`Request`s and giving `Reading`s. rose.demo.coserve runs one as a telemetry source.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rose.demo.device_core import pin_process
from rose.demo.spec_process import JsonSpec
from rose.node import prometheus
from rose.obs.logs import get_logger
from rose.obs.stats import percentile
from rose.vllm_server import VllmServer, start_server, stop_server, stream_tokens, wait_healthy

log = get_logger("rose.coserve")


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
    # the serving engine: "torch" (the small model above, in this process) or "vllm" (vLLM's
    # OpenAI server on the checkpoint `model`; the model fields above then do not apply)
    server: str = "torch"
    model: str = ""  # server "vllm": a local Hugging Face checkpoint directory
    url: str = ""  # server "vllm": use the server already at this URL instead of starting one
    vllm_python: str = ""  # the interpreter that runs the server ("" = this one)
    port: int = 0  # the server's port (0 = a free one)
    max_model_len: int = 1024
    startup_timeout_s: float = 300.0  # until /health answers
    request_timeout_s: float = 120.0
    # server "vllm": once the server runs, this process (the load generator, the telemetry) moves
    # to these CPUs, off the device's core ((): it stays where it was started)
    client_cpus: tuple[int, ...] = ()
    clients: int = 64  # concurrent client connections; more requests wait on this side
    server_log: str = ""  # the directory of the server's log, coserve-vllm.log ("" = a new temporary one)
    # server "vllm": > 0 measures the replica's capacity at start and replays the trace so its peak
    # rate over bins of `peak_bin_s` (as recorded) is this fraction of it (rose.demo.capacity);
    # 0 replays it at `speed`
    peak_fraction: float = 0.0
    peak_bin_s: float = 60.0
    replay_s: float = 0.0  # with peak_fraction: the trace's whole course is compressed into this (0: not compressed)
    capacity_clients: tuple[int, ...] = (1, 2, 4, 8)
    # each level's length: one client alone served 0.3 req/s on the demo's model on one core
    # (docs/measured/cpu/demo-vllm-capacity.json), so 30 s holds about 9 requests for its p99s, not 3
    capacity_level_s: float = 30.0
    measure_when_key: str = ""  # Redis key: measure once it exists (state "warm" until then); "" = at once


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
class Request:
    rid: str
    arrival: float  # monotonic
    prompt: list[int]
    n_out: int
    got: int = 0
    first_t: float = 0.0
    last_t: float = 0.0


@dataclass(frozen=True)
class Reading:
    """What one telemetry window publishes for the device."""

    ttft_ms: float
    tpot_ms: float
    measured: bool  # False: the p99s are carried over from an earlier window (no request finished)
    queue: int
    kv_cache_usage: float | None = None


class TorchServer:
    """The small torch model in this process (`rose.rollout.engine.TorchEngine`, continuous
    batching): one `generate(..., 1)` per step, TTFT/TPOT measured by the wall clock and their
    p99 taken over the last `lookback_s`."""

    continuous_guard = True  # its p99s are fresh at any moment: the guard file is written every guard_every_s

    def __init__(self, spec: CoserveSpec, finish):
        import torch

        from rose.rollout.engine import MemoryBudget, TorchEngine
        from rose.rollout.policy_model import ModelSpec, init_state_dict

        self.spec, self.finish = spec, finish
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
        self.ttft = LatencyWindow(spec.lookback_s)
        self.tpot = LatencyWindow(spec.lookback_s)
        self.queue: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self.is_cuda = spec.device.startswith("cuda")
        self.busy_s = 0.0
        self.proc: Any = None

    def start(self) -> dict:
        import psutil

        from rose.rollout.engine import GenRequest

        for i in range(3):
            self.engine.generate([GenRequest(f"warm{i}", [1] * 16, 0)], 1)
            self.engine.release(f"warm{i}")
        self.proc = psutil.Process()
        self.cpu0 = self._cpu()
        return {"server": "torch"}

    def submit(self, q: Request) -> None:
        self.queue.append(q)

    def pending(self) -> bool:
        return bool(self.running or self.queue)

    def step(self) -> bool:
        """One engine step over the running requests; False when there was nothing to run."""
        from rose.rollout.engine import GenRequest

        while self.queue and len(self.running) < self.engine.n_slots:
            q = self.queue.popleft()
            self.running[q.rid] = q
        if not self.running:
            return False
        reqs = [GenRequest(q.rid, q.prompt if q.got == 0 else [], None) for q in self.running.values()]
        for q in self.running.values():
            q.prompt = []
        s0 = time.monotonic()
        self.engine.generate(reqs, 1)
        if self.is_cuda:
            import torch

            torch.cuda.synchronize()
        t = time.monotonic()
        self.busy_s += t - s0
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
                self.finish(q)
        return True

    def reading(self, now: float) -> Reading | None:
        return Reading(self.ttft.p99(now), self.tpot.p99(now), True, len(self.queue))

    def _cpu(self) -> float:
        t = self.proc.cpu_times()
        return t.user + t.system

    def util(self, dt: float) -> float:
        """Busy share of the last `dt` seconds: engine time (CUDA) or the process's CPU time (CPU)."""
        cpu1 = self._cpu()
        busy = self.busy_s if self.is_cuda else cpu1 - self.cpu0
        self.cpu0, self.busy_s = cpu1, 0.0
        return busy / dt

    def close(self) -> None:
        pass


class VllmServerDevice:
    """vLLM's OpenAI server on `spec.model` (started here in a session of its own, or the one at
    `spec.url`): each request is a streaming `/v1/completions` with token ids as the prompt, timed
    by the client as the torch path times its own; the published p99s are the server's, read
    from its /metrics by the agent's reader every telemetry period."""

    continuous_guard = False  # the guard file gets each measured window, as `rose agent --feed-guard` feeds it

    def __init__(self, spec: CoserveSpec, finish, period_s: float):
        from concurrent.futures import ThreadPoolExecutor

        self.spec, self.finish, self.period_s = spec, finish, period_s
        self.names = prometheus.metric_names("auto")
        self.pool = ThreadPoolExecutor(spec.clients, thread_name_prefix="coserve-client")
        self.inflight: set[str] = set()
        self.lock = threading.Lock()
        self.srv: Any = None
        self.latest: Reading | None = None  # the newest window not yet published
        self.closing = threading.Event()
        self.counts = {"submitted": 0, "answered": 0, "wrong_length": 0, "failed": 0, "scrape_failed": 0}
        self.cpu0 = 0.0

    def start(self) -> dict:
        import tempfile
        from pathlib import Path

        spec = self.spec
        if spec.url:
            self.srv = VllmServer(spec.url.rstrip("/"), spec.model, Path(spec.server_log or "-"))
            wait_healthy(self.srv, spec.startup_timeout_s)
        else:
            log = Path(spec.server_log or tempfile.mkdtemp(prefix="rose-coserve-vllm-")) / "coserve-vllm.log"
            self.srv = start_server(
                spec.model,
                log,
                port=spec.port,
                max_model_len=spec.max_model_len,
                threads=spec.threads,
                python=spec.vllm_python,
                timeout_s=spec.startup_timeout_s,
            )
        if spec.client_cpus:  # the server keeps the device's core; its clients run on the host's
            pin_process(set(spec.client_cpus))
        for i in range(2):  # first-request costs stay out of the measured windows
            list(self._stream([1 + i] * 16, 2))
        self.cpu0 = self._cpu()
        threading.Thread(target=self._scrape_loop, name="coserve-metrics", daemon=True).start()
        return {"server": "vllm", "model": spec.model, "server_url": self.srv.url, "server_log": str(self.srv.log)}

    def _stream(self, prompt: list[int], n: int):
        return stream_tokens(self.srv, prompt, n, timeout_s=self.spec.request_timeout_s)

    def serve_one(self, prompt: list[int], n: int) -> tuple[float, float]:
        """One request alone, outside the replay (the capacity measurement): (TTFT ms, mean TPOT ms)."""
        t0 = time.monotonic()
        first = last = t0
        got = 0
        for k in self._stream(prompt, n):
            last = time.monotonic()
            first = last if got == 0 else first
            got += k
        return (first - t0) * 1000.0, (last - first) * 1000.0 / max(1, got - 1)

    def meter(self):
        """A level meter for rose.demo.capacity: each call reads the server's /metrics as the
        agent does; the p99s (ms) of TTFT and of the inter-token latency since the previous call."""
        from rose.node.agent import EngineMetrics

        metrics = EngineMetrics(self.srv.url + "/metrics", self.names)

        def read() -> tuple[float | None, float | None]:
            w = metrics.read(10.0)
            r = lambda v: None if v is None else round(v, 3)  # noqa: E731
            return r(w.ttft_p99_ms), r(w.tpot_p99_ms)

        return read

    def submit(self, q: Request) -> None:
        with self.lock:
            self.inflight.add(q.rid)
            self.counts["submitted"] += 1
        self.pool.submit(self._serve, q)

    def _serve(self, q: Request) -> None:
        try:
            for k in self._stream(q.prompt, q.n_out):
                t = time.monotonic()
                if q.got == 0:
                    q.first_t = t
                q.got += k
                q.last_t = t
        except Exception as e:  # noqa: BLE001 - HTTP, connection, a malformed event: the request failed
            if not self.closing.is_set():
                with self.lock:
                    self.counts["failed"] += 1
                log.warning("request failed", rid=q.rid, error=repr(e))
            q.got = 0
        with self.lock:
            self.inflight.discard(q.rid)
            if q.got:
                self.counts["answered"] += 1
                self.counts["wrong_length"] += q.got != q.n_out
        if q.got:
            self.finish(q)

    def pending(self) -> bool:
        with self.lock:
            return bool(self.inflight)

    def step(self) -> bool:
        return False  # the server runs the requests; the client threads time them

    def _scrape_loop(self) -> None:
        """A window of the server's metrics every telemetry period, read as `rose agent` reads it
        (`EngineMetrics`), the last measured p99s carried over (`LatencyCarry`)."""
        from rose.node.agent import EngineMetrics, LatencyCarry

        metrics = EngineMetrics(self.srv.url + "/metrics", self.names)
        carry = LatencyCarry()
        nxt = time.monotonic()
        while not self.closing.is_set():
            try:
                w = metrics.read(max(1.0, self.period_s))
            except (OSError, prometheus.ExpositionError) as e:
                self.counts["scrape_failed"] += 1
                log.warning("cannot read the server's metrics", url=metrics.url, error=str(e))
            else:
                p99 = carry.update(w.ttft_p99_ms, w.tpot_p99_ms)
                if p99 is not None:
                    with self.lock:
                        backlog = max(0, len(self.inflight) - self.spec.clients)  # not yet sent
                    self.latest = Reading(p99[0], p99[1], p99[2], (w.queue_depth or 0) + backlog, w.kv_cache_usage)
            nxt += self.period_s
            self.closing.wait(max(0.0, nxt - time.monotonic()))

    def reading(self, now: float) -> Reading | None:
        r, self.latest = self.latest, None
        return r

    def _cpu(self) -> float:
        from rose.demo.processes import _tree_cpu

        return _tree_cpu(self.srv.proc.pid) if self.srv.proc is not None else 0.0

    def util(self, dt: float) -> float:
        """The server's (and its engine core's) CPU time over the last `dt` seconds."""
        cpu1 = self._cpu()
        busy, self.cpu0 = max(0.0, cpu1 - self.cpu0), cpu1
        return busy / dt

    def close(self) -> None:
        self.closing.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.srv is not None:
            stop_server(self.srv)
