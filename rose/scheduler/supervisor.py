"""`rose scheduler`'s process: one `Scheduler` instance at a time, replaced by a fresh one
whenever its Kafka clients are fenced, wedge or cannot start, so that a broker outage of any
length leaves the process up (reporting unhealthy on /healthz) instead of ending it."""

from __future__ import annotations

import time
from typing import Any

from rose.config import Config
from rose.kafka.consumer import KafkaException
from rose.kafka.topics import missing_topics, report_missing_topics
from rose.obs import metrics
from rose.obs.logs import get_logger
from rose.policy.lease_policy import POLICY_VERSION
from rose.scheduler.service import FatalSchedulerError, Scheduler, SchedulerStats
from rose.shutdown import Shutdown

RESTARTS = metrics.counter("rose_scheduler_client_restarts_total", "Kafka clients replaced after fencing or a wedge")

TOPICS_RECHECK_S = 2.0  # how often a scheduler waiting for its topics looks again


def _topics_missing(cfg: Config, log: Any, left: float | None) -> bool:
    """Whether the contract's topics are missing (said in one line, at most every 30 s). That
    is a setup step not yet done, not a client failure: nothing is replaced or counted, and
    the process stays up until `rose topics create` has run. A cluster that does not answer
    is left to the client path, which reports and retries it."""
    try:
        missing = missing_topics(cfg.kafka, timeout_s=5.0 if left is None else max(0.5, min(5.0, left)))
    except KafkaException:
        return False
    if not cfg.policy.pools:  # the pool stage's topics are needed only with pools that lend replicas
        missing = [t for t in missing if t not in (cfg.kafka.pool_samples_topic, cfg.kafka.pool_intents_topic)]
    if missing:
        report_missing_topics(cfg.kafka, missing, log, "scheduler")
    return bool(missing)


def run_scheduler(
    cfg: Config,
    instance: str,
    metrics_port: int | None = None,
    max_seconds: float | None = None,
    max_failures: int | None = None,
    shutdown: Shutdown | None = None,
) -> SchedulerStats:
    """Run until SIGTERM. A client that is fenced, wedged, or cannot start (the broker is
    down) is replaced by a fresh one (new producer and consumer; init_transactions fences the
    old producer), which rebuilds its view from the log like any new instance. Replacement
    backs off up to 5 s and never gives up by default: a broker outage of any length leaves
    the process up, reporting unhealthy on /healthz until a client works again.
    `max_failures` bounds consecutive failed clients (none of whose transactions committed).
    `shutdown`: the process's SIGTERM handling, when the caller installed it already."""
    current: list[Scheduler] = []
    shutdown = shutdown or Shutdown.install(name="rose-scheduler")

    def stop_current() -> None:
        for s in current:
            s.stop()

    shutdown.hooks.append(stop_current)
    stop = shutdown.stop
    health = {"ok": True}
    if metrics_port is not None:
        metrics.serve(metrics_port, health=lambda: health["ok"] and not stop.is_set())
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    total = SchedulerStats()
    restarts = failures = 0
    log = get_logger("rose.scheduler", instance=instance)
    log.info("scheduler.start", config=cfg.redacted()["policy"], policy_version=POLICY_VERSION)
    while not stop.is_set():
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            break
        if _topics_missing(cfg, log, left):
            health["ok"] = False
            stop.wait(TOPICS_RECHECK_S)
            continue
        s = None
        try:
            s = Scheduler(cfg, instance=instance, init_timeout_s=30 if left is None else max(1.0, min(30.0, left)))
            current[:] = [s]
            health["ok"] = True  # its transactional producer is registered: the broker answers
            if stop.is_set():
                s.stop()
            s.run(max_seconds=left)
            break
        except (FatalSchedulerError, KafkaException) as e:
            restarts += 1
            RESTARTS.inc()
            health["ok"] = False
            failures = 1 if s is not None and s.stats.transactions else failures + 1
            log.error("scheduler.client_replaced", error=str(e), restarts=restarts, consecutive_failures=failures)
            if max_failures is not None and failures > max_failures:
                raise
            stop.wait(min(5.0, 0.5 * failures))
        finally:
            if s is not None:
                total.events += s.stats.events
                total.commands += s.stats.commands
                total.dlq += s.stats.dlq
    log.info("scheduler.stop", events=total.events, commands=total.commands, dlq=total.dlq, restarts=restarts)
    return total
