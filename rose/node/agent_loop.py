"""The node agent's one loop: a telemetry source gives a window when it is due, and the loop
publishes it through rose.kafka.telemetry_publisher (buffering while Kafka is away, counting
what it drops), feeds the executor's local guard, follows the leases when asked to, paces the
windows and stops on `stop()`. The sources: NVML with the engine's metrics (rose.node.agent),
the trace-driven serving model (rose.node.simulated_agent) and the demo's co-served device
(rose.demo.coserve)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from rose.config import Config
from rose.node.lease_view import LeaseFollower, LeaseView
from rose.node.telemetry import feed_guard, window_span
from rose.obs.logs import get_logger

log = get_logger("rose.agent")

HEALTH_EVERY_S = 10.0  # how often the loop logs its counters


@dataclass
class GuardFeed:
    """The p99s a window measured, per GPU, for the executor's local guard."""

    gpus: list[str]
    ttft_ms: Any  # one entry per GPU
    tpot_ms: Any


@dataclass
class Window:
    """What a source gives for one window: its telemetry records, their event time and what
    the local guard is fed (None: the window measured nothing)."""

    ts: float  # event time, wall clock seconds
    records: list[tuple[bytes, bytes]]
    guard: GuardFeed | None = None
    span: str = "telemetry.window"
    span_attrs: dict[str, Any] = field(default_factory=dict)


class TelemetrySource(Protocol):
    """What the loop needs of a source."""

    def deadlines(self) -> Iterator[float]:
        """The monotonic time each window is due; the source ends when this does."""
        ...

    def window(self, seq: int, view: LeaseView | None) -> Window | None:
        """Window `seq` (None: nothing to publish); `view` holds the leases when they are followed."""
        ...

    def idle(self, budget_s: float) -> None:
        """Wait (or serve) for at most `budget_s` while the next window is not yet due."""
        ...


def follow_leases(cfg: Config, pub) -> tuple[LeaseView, LeaseFollower]:
    """The node's lease view, fed from the commands and lease states, malformed ones to the DLQ."""
    from rose.kafka.producer import dead_letter

    view = LeaseView(default_share=cfg.policy.max_compute_share)
    follower = LeaseFollower(
        cfg,
        view,
        dlq=lambda m, reason, fld: dead_letter(
            pub.producer, cfg.kafka.dlq_topic, m, reason, fld, consumer="rose-agent"
        ),
    )
    return view, follower


def run_agent(
    cfg: Config,
    source: TelemetrySource,
    *,
    stop: Callable[[], bool] = lambda: False,
    publisher=None,
    leases: bool = False,
    guard_dir: str | None = None,
) -> dict:
    """Publish `source`'s windows until it ends or `stop()`; returns the windows done and the
    publisher's counters."""
    from rose.kafka.telemetry_publisher import TelemetryPublisher

    tc = cfg.telemetry
    slo = (tc.slo_ttft_ms, tc.slo_tpot_ms)
    pub = publisher or TelemetryPublisher.for_config(cfg)
    view, follower = follow_leases(cfg, pub) if leases else (None, None)
    done, last_health = 0, time.monotonic()
    try:
        for seq, due in enumerate(source.deadlines()):
            if stop():
                break
            while (left := due - time.monotonic()) > 0 and not stop():
                pub.tick()
                source.idle(min(left, 0.02))
            if stop():
                break
            if follower is not None:
                follower.poll()
            w = source.window(seq, view)
            if w is not None and w.records:
                with window_span(w.span, **w.span_attrs):
                    pub.publish(w.records, ts_ms=int(w.ts * 1000))
            if w is not None and w.guard is not None and guard_dir:
                feed_guard(guard_dir, w.guard.gpus, w.ts, w.guard.ttft_ms, w.guard.tpot_ms, slo)
            done += 1
            if time.monotonic() - last_health >= HEALTH_EVERY_S:
                last_health = time.monotonic()
                log.info("agent health", windows=done, **pub.counters())
    finally:
        if follower is not None:
            follower.close()
    return {"windows": done, **pub.counters()}
