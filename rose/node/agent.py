"""The serving-node agent (`rose agent --nvml --metrics-url URL`): NVML utilisation and memory
per GPU (rollout memory by PID) plus the serving engine's Prometheus metrics (p99 TTFT/TPOT from
histogram deltas, requests/s, queue, KV-cache usage when the engine reports it), one
rose.telemetry.v1 per GPU per period, published through
rose.kafka.telemetry_publisher. One metrics URL per GPU in index order, or a single URL for an
engine that spans all of the node's GPUs (tensor parallel). A GPU whose engine cannot be scraped
publishes nothing that period: without telemetry its lease is not renewed and expires (safe). A
window in which no request finished carries the last measured p99 (`LatencyCarry`), never 0 ms;
an engine that has finished no request since the agent started publishes its p99s at the SLO
(no headroom claimed) every window all the same: an idle replica is the one a pool can lend.
With `--feed-guard` each measured window's p99 also goes to the executor's local guard.
It follows the node's leases (rose.node.lease_view): each GPU's telemetry names its serving replica
(`--replica GPU=REPLICA`, else the GPU itself) and what the replica is doing (`serving_state`,
CONTRACT §7). A lent replica is out of its router and serves nothing, so its window is built
without its engine: rps 0, queue 0, the last measured p99 carried (docs/agent.md).
`NvmlSource` is a source of the agent's loop (rose.node.agent_loop), as is the simulated agent
(rose.node.simulated_agent)."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from rose.config import Config
from rose.node import prometheus
from rose.node.agent_loop import GuardFeed, Window, run_agent
from rose.node.lease_view import LeaseView
from rose.node.telemetry import telemetry_records
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
    replicas: dict[str, str] = field(default_factory=dict)  # GPU id -> its serving replica (absent: the GPU)
    follow_leases: bool = True  # read lease states and commands for each GPU's serving_state


@dataclass
class LatencyCarry:
    """The p99s one GPU publishes, window after window.

    A window in which no request finished has no latency sample (`prometheus.window` gives
    None: the histogram delta is empty), and publishing 0 ms would read as full headroom.
    Telemetry v1 requires both p99s, so per metric such a window carries the last measured
    p99: the policy sees the value it already acted on (no new evidence; a flat value adds no
    trend). A metric not measured yet is published at its SLO (`unmeasured`), which claims no
    headroom. The local guard is fed only windows that measured both metrics."""

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

    def unmeasured(self, slo: tuple[float, float]) -> tuple[float, float, bool]:
        """What a GPU publishes while a metric has never been measured (an engine that has
        finished no request since the agent started, or a one-token request that gives no TPOT)
        and what a lent GPU publishes (its replica serves no requests): per metric the last
        measured p99, else the SLO, which claims no headroom (no co-resident grant, no capacity
        estimate), never 0 ms, which would claim all of it. Nothing is measured."""
        return self.last.get("ttft_p99", slo[0]), self.last.get("tpot_p99", slo[1]), False


def next_due(due: float, period: float, now: float) -> float:
    """When the window after the one due at `due` is due: a period later, or, where the agent is
    later than that already (a slow scrape or a busy node), the first period boundary not yet
    passed. Missed windows are skipped, never run back to back: a window's rps is the requests
    finished over its time since the previous read, and a catch-up window a few milliseconds long
    turns one finished request into hundreds a second, which the pool's load (a mean of samples
    each taken as one period long, docs/policy.md) reads as a load rise."""
    nxt = due + period
    if nxt < now:
        nxt += math.ceil((now - nxt) / period) * period
    return nxt


def scrape(url: str, timeout_s: float) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 - operator-given URL
        return r.read().decode("utf-8", "replace")


class EngineMetrics:
    """One engine's /metrics read window by window: each read is a window of the histogram
    deltas since the previous read."""

    def __init__(self, url: str, names: dict[str, tuple[str, ...]]):
        self.url, self.names, self.keep = url, names, prometheus.all_names(names)
        self.prev: tuple[float, prometheus.Scrape] | None = None

    def read(self, timeout_s: float) -> prometheus.ServingWindow:
        """This read's `prometheus.ServingWindow`; raises OSError or prometheus.ExpositionError
        when the page cannot be read."""
        sc = prometheus.parse(scrape(self.url, timeout_s), self.keep)
        t, p = time.monotonic(), self.prev
        self.prev = (t, sc)
        return prometheus.window(sc, p[1] if p else None, t - p[0] if p else 0.0, self.names)


# a lent replica's window: out of its router, its engine serves no requests and is not read
LENT_WINDOW = prometheus.ServingWindow(None, None, 0.0, 0, 0)


class NvmlSource:
    """NVML and the engines' metrics as a telemetry source: every period a window of each
    engine's metrics, and one record for each GPU whose engine could be read (or is lent)."""

    def __init__(self, cfg: Config, opt: NvmlOptions, nvml):
        from rose.node.nvml import MIN_PERIOD_S

        tc = cfg.telemetry
        self.cfg, self.opt, self.nvml = cfg, opt, nvml
        self.period = max(MIN_PERIOD_S, opt.period_s or tc.period_s)
        self.names = prometheus.metric_names(tc.engine, tc.metrics)
        self.n = n = len(nvml)
        self.gpus = [f"{opt.node}/{i}" for i in range(n)]
        self.urls = opt.metrics_urls if len(opt.metrics_urls) == n else [opt.metrics_urls[0]] * n
        self.engines = {url: EngineMetrics(url, self.names) for url in self.urls}
        self.carry = [LatencyCarry() for _ in range(n)]
        self.slo = (tc.slo_ttft_ms, tc.slo_tpot_ms)
        # GPU-windows published with carried p99s / with a p99 never measured, at the SLO / while lent
        self.counts = {"carried": 0, "no_latency_yet": 0, "lent": 0}
        self.warned_missing: set[tuple[str, str]] = set()
        self.run_id = uuid.uuid4().hex[:12]
        self.last_warn = 0.0

    def deadlines(self) -> Iterator[float]:
        t = time.monotonic()
        while True:
            yield t
            t = next_due(t, self.period, time.monotonic())

    def idle(self, budget_s: float) -> None:
        time.sleep(budget_s)

    def _scrape(self, url: str) -> prometheus.ServingWindow | None:
        """This period's window of `url`'s metrics; None when it cannot be read, and on its first
        read, which is no window (nothing to take a difference from: no rate, no p99)."""
        first = self.engines[url].prev is None
        try:
            w = self.engines[url].read(min(self.opt.scrape_timeout_s, self.period))
        except (OSError, prometheus.ExpositionError) as e:
            if time.monotonic() - self.last_warn > 5.0:
                self.last_warn = time.monotonic()
                log.warning("cannot read serving metrics", url=url, error=str(e))
            return None
        for role in w.missing:
            if (url, role) not in self.warned_missing:
                self.warned_missing.add((url, role))
                log.warning(
                    "serving metrics lack a latency histogram: no p99 from it (a GPU publishes "
                    "nothing until both have been measured)",
                    url=url,
                    role=role,
                    looked_for=list(self.names[role]),
                )
        return None if first else w

    def window(self, seq: int, view: LeaseView | None) -> Window | None:
        from rose.node.nvml import read_pids

        now_wall = time.time()
        states = [view.serving_state(g) if view is not None else "serving" for g in self.gpus]
        serving = [self.urls[i] for i in range(self.n) if states[i] != "lent"]
        by_url = {url: self._scrape(url) for url in dict.fromkeys(serving)}
        pids = read_pids(self.opt.rollout_pids)
        idx, lat, ws = [], [], []  # the GPUs that publish, their p99s and windows
        for i in range(self.n):
            got = self._gpu_window(i, states[i], by_url)
            if got is not None:
                idx.append(i)
                ws.append(got[0])
                lat.append(got[1])
        if not idx:
            return None
        return Window(
            now_wall,
            self._records(now_wall, seq, idx, lat, ws, pids, [states[i] for i in idx]),
            self._fed(idx, lat),
            "telemetry.sample",
            {"gpus": len(idx)},
        )

    def _gpu_window(
        self, i: int, state: str, by_url: dict[str, prometheus.ServingWindow | None]
    ) -> tuple[prometheus.ServingWindow, tuple[float, float, bool]] | None:
        """GPU `i`'s window and p99s (ttft, tpot, measured); None: it publishes nothing this window."""
        if state == "lent":
            self.counts["lent"] += 1
            return LENT_WINDOW, self.carry[i].unmeasured(self.slo)
        w = by_url.get(self.urls[i])
        if w is None:
            return None
        p99 = self.carry[i].update(w.ttft_p99_ms, w.tpot_p99_ms)
        if p99 is None:  # up, but no latency yet: still published, an idle replica is one to lend
            self.counts["no_latency_yet"] += 1
            return w, self.carry[i].unmeasured(self.slo)
        self.counts["carried"] += not p99[2]
        return w, p99

    def _records(
        self, now_wall: float, seq: int, idx: list[int], lat: list, ws: list, pids, states: list[str]
    ) -> list[tuple[bytes, bytes]]:
        tc = self.cfg.telemetry
        samples = [self.nvml.sample(i, pids) for i in idx]
        return telemetry_records(
            ts=now_wall,
            node=self.opt.node,
            gpus=[self.gpus[i] for i in idx],
            pool=tc.pool,
            slo=self.slo,
            run_id=self.run_id,
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
            replica=self.opt.replicas,
            serving_state=states,
        )

    def _fed(self, idx: list[int], lat: list) -> GuardFeed | None:
        """The windows that measured something: only those go to the local guard."""
        fed = [k for k, x in enumerate(lat) if x[2]]
        if not fed:
            return None
        return GuardFeed([self.gpus[idx[k]] for k in fed], [lat[k][0] for k in fed], [lat[k][1] for k in fed])


def run_nvml(cfg: Config, opt: NvmlOptions, nvml, stop: Callable[[], bool] = lambda: False, publisher=None) -> dict:
    """Sample NVML + the engines' metrics every period until `stop()`; returns counters."""
    source = NvmlSource(cfg, opt, nvml)
    out = run_agent(cfg, source, stop=stop, publisher=publisher, leases=opt.follow_leases, guard_dir=opt.guard_dir)
    return {"samples": out.pop("windows"), "gpus": source.n, **source.counts, **out}
