"""Serving-node agents: one rose.telemetry.v1 per GPU per period, published to Kafka.

Two sources, one publishing path (rose.kafka.telemetry_publisher: idempotent, keyed by GPU,
trace context in headers, bounded buffer, never blocking):

* `run_simulated`: a request trace spread over N simulated GPUs (`{node}/{i}`) and turned
  into latency, memory and utilisation by rose.serving_model, one window per period. Event
  time is the simulation time mapped onto the wall clock at start (and the Kafka record
  timestamp is the event time), so events are monotone per GPU also without pacing. It
  follows the lease state: a lease in state `active` on one of its GPUs is a running
  rollout, holding `rollout_mem_bytes` and using the `compute_share` of the grant/renew
  that created the lease (read from the commands topic; `policy.max_compute_share` when
  that command was not seen). Any other state (revoking, revoked, expired, rejected)
  means no rollout, so a revoke restores serving latency at the next window.
* `run_nvml`: NVML utilisation and memory per GPU (rollout memory by PID) plus the serving
  engine's Prometheus metrics (p99 TTFT/TPOT from histogram deltas, requests/s, queue).
  One metrics URL per GPU in index order, or a single URL for an engine that spans all
  of the node's GPUs (tensor parallel). A GPU whose engine cannot be scraped publishes
  nothing that period: without telemetry its lease is not renewed and expires (safe).
  A window in which no request finished has no latency sample (`LatencyCarry`): it carries
  the last measured p99, and a GPU publishes nothing before its first sample, so an idle
  engine never reads as 0 ms, full headroom.

Both can feed the executor's local guard (`feed_guard`, `--feed-guard`) with each window's p99.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

from rose.config import Config
from rose.contract.events import TELEMETRY_SCHEMA, Command, LeaseState
from rose.obs.logs import get_logger

log = get_logger("rose.agent")


# ---- the lease view (pure) ---------------------------------------------------------------
@dataclass
class LeaseView:
    """Latest lease state per GPU and the compute share granted to each lease."""

    default_share: float = 0.5
    states: dict[str, LeaseState] = field(default_factory=dict)
    shares: dict[str, float] = field(default_factory=dict)  # lease_id -> compute_share

    def on_command(self, c: Command) -> None:
        if c.kind in ("grant", "renew"):
            self.shares[c.lease_id] = c.compute_share

    def on_lease_state(self, s: LeaseState) -> None:
        old = self.states.get(s.gpu)
        if old is None or (s.epoch, s.ts) >= (old.epoch, old.ts):
            self.states[s.gpu] = s

    def rollout(self, gpu: str) -> tuple[float, bool, int]:
        """(compute_share, running, rollout_mem_bytes) of `gpu` now."""
        s = self.states.get(gpu)
        if s is None or s.state != "active":
            return 0.0, False, 0
        return self.shares.get(s.lease_id, self.default_share), True, s.rollout_mem_bytes


class LeaseFollower:
    """Reads lease-state and commands from their beginning, without ever blocking."""

    def __init__(self, cfg: Config, view: LeaseView, dlq: Callable | None = None):
        from rose.kafka.consumer import OFFSET_BEGINNING, TopicPartition, make_consumer

        self.k, self.view, self.dlq = cfg.kafka, view, dlq
        self.consumer = make_consumer(
            cfg.kafka, group_id=f"rose-agent-{uuid.uuid4().hex[:12]}", **{"socket.timeout.ms": 2000}
        )
        self.assigned = False
        self._tp, self._begin = TopicPartition, OFFSET_BEGINNING

    def _assign(self) -> None:
        try:
            md = self.consumer.list_topics(timeout=0.5)
        except Exception:  # noqa: BLE001 - broker away: try again next poll
            return
        tps = []
        for t in (self.k.lease_state_topic, self.k.commands_topic):
            if t in md.topics:
                tps += [self._tp(t, p, self._begin) for p in md.topics[t].partitions]
        if tps:
            self.consumer.assign(tps)
            self.assigned = True

    def poll(self, max_batches: int = 20) -> int:
        from rose.contract.codec import decode
        from rose.contract.events import InvalidEvent

        if not self.assigned:
            self._assign()
            if not self.assigned:
                return 0
        n = 0
        for _ in range(max_batches):
            msgs = self.consumer.consume(num_messages=1000, timeout=0)
            for m in msgs:
                if m.error() or m.value() is None:  # errors are transient here; tombstones clear nothing
                    continue
                try:
                    ev = decode(m.value())
                except InvalidEvent as e:
                    if self.dlq:
                        self.dlq(m, str(e), e.field)
                    continue
                if isinstance(ev, LeaseState):
                    self.view.on_lease_state(ev)
                elif isinstance(ev, Command):
                    self.view.on_command(ev)
                n += 1
            if len(msgs) < 1000:
                break
        return n

    def close(self) -> None:
        self.consumer.close()


# ---- encoding (pure, hot path) -----------------------------------------------------------
def telemetry_records(
    *,
    ts: float,
    node: str,
    gpus: list[str],
    pool: str,
    slo: tuple[float, float],
    run_id: str,
    seq: int,
    util,
    mem_total,
    mem_used,
    rollout_mem,
    ttft_ms,
    tpot_ms,
    rps,
    queue,
) -> list[tuple[bytes, bytes]]:
    """(value, key) of one telemetry event per GPU; array-likes hold one entry per GPU
    (`mem_total` may also be one int for all).

    Built as plain dicts and encoded with orjson (not through the dataclass) because this
    runs for every GPU every period; tests check the output with Telemetry.from_dict and the
    JSON Schema."""
    dumps = orjson.dumps
    slo_d = {"ttft_p99": slo[0], "tpot_p99": slo[1]}
    out = []
    totals = [mem_total] * len(gpus) if isinstance(mem_total, int) else mem_total
    for i, g in enumerate(gpus):
        used = int(mem_used[i])
        d = {
            "schema": TELEMETRY_SCHEMA,
            "event_id": f"{run_id}:{g}:{seq}",
            "ts": ts,
            "node": node,
            "gpu": g,
            "pool": pool,
            "gpu_util": min(1.0, max(0.0, float(util[i]))),
            "mem_total_bytes": int(totals[i]),
            "mem_used_bytes": used,
            "rollout_mem_bytes": min(int(rollout_mem[i]), used),
            "latency_ms": {"ttft_p99": float(ttft_ms[i]), "tpot_p99": float(tpot_ms[i])},
            "slo_ms": slo_d,
            "rps": float(rps[i]),
            "queue_depth": int(queue[i]),
        }
        out.append((dumps(d), g.encode()))
    return out


def _span(name: str, **attrs):
    """The span of one published window; the publisher's `send` span is its child."""
    from rose.obs.tracing import tracer

    return tracer("rose.agent").start_as_current_span(name, attributes=attrs)


def feed_guard(directory: str, gpus: list[str], ts: float, ttft_ms, tpot_ms, slo: tuple[float, float]) -> None:
    """Hand each GPU's newest p99 to the executor's local guard (a file in shared memory per
    GPU, no broker on the path), so a latency collapse pauses rollout before Kafka carries
    the revoke."""
    from rose.contract.events import Latency
    from rose.executor.guard import LatencySample, write_latency

    slo_l = Latency(*slo)
    for g, a, b in zip(gpus, ttft_ms, tpot_ms):
        write_latency(directory, g, LatencySample(ts, Latency(float(a), float(b)), slo_l))


# ---- the simulated agent -----------------------------------------------------------------
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
    )
    gpu_of = spread(trace, opt.gpus, seed=opt.seed)
    gpus = [f"{opt.node}/{i}" for i in range(opt.gpus)]
    duration = opt.duration_s if opt.duration_s is not None else trace.duration_s
    pub = publisher or TelemetryPublisher(
        cfg.kafka, cfg.kafka.telemetry_topic, buffer_max=tc.buffer_max, linger_ms=tc.linger_ms
    )
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
            with _span("telemetry.window", gpus=len(gpus), window=w):
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


# ---- the real agent ----------------------------------------------------------------------
@dataclass
class NvmlOptions:
    metrics_urls: list[str]
    node: str
    rollout_pids: str | None = None
    period_s: float | None = None  # default telemetry.period_s (never below nvml.MIN_PERIOD_S)
    scrape_timeout_s: float = 2.0
    guard_dir: str | None = None  # also feed each measured window's p99 to the executor's local guard here


@dataclass
class LatencyCarry:
    """The p99s one GPU publishes, window after window.

    A window in which no request finished has no latency sample (`prometheus.window` gives
    None: the histogram delta is empty), and publishing 0 ms would read as full headroom.
    Telemetry v1 requires both p99s, so per metric such a window carries the last measured
    p99: the policy sees the value it already acted on (no new evidence; a flat value adds no
    trend). Before both metrics have been measured once the GPU publishes nothing, as when its
    engine cannot be scraped. The local guard is fed only windows that measured something."""

    last: dict[str, float] = field(default_factory=dict)  # metric -> last measured p99, ms

    def update(self, ttft_ms: float | None, tpot_ms: float | None) -> tuple[float, float, bool] | None:
        """(ttft_p99, tpot_p99, measured): what to publish, and whether this window measured either;
        None while a metric has never been measured."""
        measured = False
        for m, v in (("ttft_p99", ttft_ms), ("tpot_p99", tpot_ms)):
            if v is not None:
                self.last[m] = v
                measured = True
        if len(self.last) < 2:
            return None
        return self.last["ttft_p99"], self.last["tpot_p99"], measured


def scrape(url: str, timeout_s: float) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 - operator-given URL
        return r.read().decode("utf-8", "replace")


def run_nvml(cfg: Config, opt: NvmlOptions, nvml, stop: Callable[[], bool] = lambda: False, publisher=None) -> dict:
    """Sample NVML + the engines' metrics every period until `stop()`; returns counters."""
    from rose.kafka.telemetry_publisher import TelemetryPublisher
    from rose.node import prometheus
    from rose.node.nvml import MIN_PERIOD_S, read_pids

    tc = cfg.telemetry
    period = max(MIN_PERIOD_S, opt.period_s or tc.period_s)
    names = prometheus.metric_names(tc.engine, tc.metrics)
    keep = prometheus.all_names(names)
    n = len(nvml)
    gpus = [f"{opt.node}/{i}" for i in range(n)]
    urls = opt.metrics_urls if len(opt.metrics_urls) == n else [opt.metrics_urls[0]] * n
    pub = publisher or TelemetryPublisher(
        cfg.kafka, cfg.kafka.telemetry_topic, buffer_max=tc.buffer_max, linger_ms=tc.linger_ms
    )
    prev: dict[str, tuple[float, prometheus.Scrape]] = {}
    carry = [LatencyCarry() for _ in range(n)]
    counts = {"carried": 0, "no_latency_yet": 0}  # GPU-windows published with carried p99s / not published
    warned_missing: set[tuple[str, str]] = set()
    run_id = uuid.uuid4().hex[:12]
    slo = (tc.slo_ttft_ms, tc.slo_tpot_ms)
    seq, next_t, last_warn = 0, time.monotonic(), 0.0
    while not stop():
        next_t += period
        now_wall = time.time()
        windows_by_url: dict[str, prometheus.ServingWindow | None] = {}
        for url in dict.fromkeys(urls):
            try:
                text = scrape(url, min(opt.scrape_timeout_s, period))
                sc = prometheus.parse(text, keep)
            except (OSError, prometheus.ExpositionError) as e:
                windows_by_url[url] = None
                if time.monotonic() - last_warn > 5.0:
                    last_warn = time.monotonic()
                    log.warning("cannot read serving metrics", url=url, error=str(e))
                continue
            t = time.monotonic()
            p = prev.get(url)
            w = windows_by_url[url] = prometheus.window(sc, p[1] if p else None, t - p[0] if p else 0.0, names)
            prev[url] = (t, sc)
            for role in w.missing:
                if (url, role) not in warned_missing:
                    warned_missing.add((url, role))
                    log.warning(
                        "serving metrics lack a latency histogram: no p99 from it (a GPU publishes "
                        "nothing until both have been measured)",
                        url=url,
                        role=role,
                        looked_for=list(names[role]),
                    )
        pids = read_pids(opt.rollout_pids)
        idx, lat = [], []
        for i in range(n):
            w = windows_by_url.get(urls[i])
            if w is None:
                continue
            p99 = carry[i].update(w.ttft_p99_ms, w.tpot_p99_ms)
            if p99 is None:
                counts["no_latency_yet"] += 1
                continue
            counts["carried"] += not p99[2]
            idx.append(i)
            lat.append(p99)
        if idx:
            samples = [nvml.sample(i, pids) for i in idx]
            ws = [windows_by_url[urls[i]] for i in idx]
            recs = telemetry_records(
                ts=now_wall,
                node=opt.node,
                gpus=[gpus[i] for i in idx],
                pool=tc.pool,
                slo=slo,
                run_id=run_id,
                seq=seq,
                util=[s.util for s in samples],
                mem_total=[s.mem_total_bytes for s in samples],
                mem_used=[s.mem_used_bytes for s in samples],
                rollout_mem=[s.rollout_mem_bytes for s in samples],
                ttft_ms=[x[0] for x in lat],
                tpot_ms=[x[1] for x in lat],
                rps=[w.rps or 0.0 for w in ws],
                queue=[w.queue_depth or 0 for w in ws],
            )
            with _span("telemetry.sample", gpus=len(idx)):
                pub.publish(recs, ts_ms=int(now_wall * 1000))
            fed = [k for k, x in enumerate(lat) if x[2]]  # windows that measured something
            if opt.guard_dir and fed:
                feed_guard(
                    opt.guard_dir,
                    [gpus[idx[k]] for k in fed],
                    now_wall,
                    [lat[k][0] for k in fed],
                    [lat[k][1] for k in fed],
                    slo,
                )
        seq += 1
        while (left := next_t - time.monotonic()) > 0 and not stop():
            pub.tick()
            time.sleep(min(left, 0.02))
    return {"samples": seq, "gpus": n, **counts, **pub.counters()}
