"""The serving-node agent (`rose agent --nvml --metrics-url URL`): NVML utilisation and memory
per GPU (rollout memory by PID) plus the serving engine's Prometheus metrics (p99 TTFT/TPOT from
histogram deltas, requests/s, queue, KV-cache usage when the engine reports it), one
rose.telemetry.v1 per GPU per period, published through
rose.kafka.telemetry_publisher. One metrics URL per GPU in index order, or a single URL for an
engine that spans all of the node's GPUs (tensor parallel). A GPU whose engine cannot be scraped
publishes nothing that period: without telemetry its lease is not renewed and expires (safe). A
window in which no request finished carries the last measured p99 (`LatencyCarry`), never 0 ms.
With `--feed-guard` each measured window's p99 also goes to the executor's local guard.
The simulated agent is rose.node.simulated_agent."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from rose.config import Config
from rose.node.telemetry import feed_guard, telemetry_records, window_span
from rose.obs.logs import get_logger

log = get_logger("rose.agent")


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
    pub = publisher or TelemetryPublisher.for_config(cfg)
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
            scraped = windows_by_url[url] = prometheus.window(sc, p[1] if p else None, t - p[0] if p else 0.0, names)
            prev[url] = (t, sc)
            for role in scraped.missing:
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
        ws = []  # the window of each GPU that publishes
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
            ws.append(w)
        if idx:
            samples = [nvml.sample(i, pids) for i in idx]
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
                kv_cache_usage=[w.kv_cache_usage for w in ws],
            )
            with window_span("telemetry.sample", gpus=len(idx)):
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
