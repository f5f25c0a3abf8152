"""The demo's run, phase by phase: start-up (every process up and ready: not counted in
--duration) → phase 1, dedicated-only (the dedicated worker and the trainer run, serving runs,
the co-served device calibrates its SLO; no scheduler, so no lease) → phase 2 at t1 (the
scheduler starts, on telemetry from t1 on; leases come and go) → t_end → shutdown (executors
first: they revoke their leases and drain their workers; then the rest)."""

from __future__ import annotations

import sys
import time

from rose.demo.processes import Processes
from rose.demo.run_setup import DemoError, DemoSetup


class DemoPhases(DemoSetup):
    """Waits for start-up, runs the two phases with the live view, and stops every process."""

    def _stop(self, procs: Processes, collector) -> None:
        killed = procs.stop_all(
            ["executor-sim", "executor-real", "dedicated", "trainer", "scheduler", "agent", "coserve"], timeout_s=12.0
        )
        if killed:
            self.problems.append(f"killed after the SIGTERM deadline: {', '.join(killed)}")
        if collector is not None:
            collector.stop()

    def _wait_ready(self, procs: Processes, collector) -> None:
        import redis

        r = redis.Redis.from_url(self.cfg.redis.url)
        key = self.cfg.redis.key
        want = {f"sim/{i}" for i in range(self.opts.gpus)}
        deadline = time.monotonic() + self.opts.startup_timeout_s
        t_start = time.monotonic()
        last_echo = 0.0
        try:
            while True:
                missing = []
                if not want <= set(collector.obs.telemetry):
                    missing.append("agent telemetry")
                if r.hget(key("demo:coserve"), "state") not in (b"warming", b"calibrating", b"serving"):
                    missing.append("co-served device")
                if int(r.hget(key("demo:trainer"), "version") or 0) < 1:
                    missing.append("trainer")
                if r.hlen(key("demo:ready")) < 2:
                    missing.append("executors")
                if not r.exists(key("workers", f"dedicated-{self.run_id}")):
                    missing.append("dedicated worker")
                if not missing:
                    return
                for name, code in procs.exited():
                    raise DemoError(
                        f"{name} exited with code {code} during start-up; see "
                        f"{self.report_dir / 'logs' / (name + '.log')}"
                    )
                if time.monotonic() > deadline:
                    raise DemoError(
                        f"not ready after {self.opts.startup_timeout_s:.0f}s: waiting for {', '.join(missing)}"
                    )
                if time.monotonic() - last_echo >= 5.0:
                    last_echo = time.monotonic()
                    self.echo(f"[demo] starting ({time.monotonic() - t_start:.0f}s): waiting for {', '.join(missing)}")
                time.sleep(0.25)
        finally:
            r.close()

    def _phases(self, procs: Processes, collector, argv) -> None:
        import redis

        from rose.demo import live_view

        o = self.opts
        r = redis.Redis.from_url(self.cfg.redis.url)
        r.set(self.cfg.redis.key("demo:go"), 1)
        r.close()
        t0 = time.time()
        t1 = t0 + o.phase1_s
        t_end = t0 + o.duration_s
        self.timeline = {"t0": t0, "t1": t1, "t_end": t_end}
        live = sys.stdout.isatty() if o.live is None else o.live
        scheduler_started = False

        def snap():
            now = time.time()
            phase = "phase 2: leases on" if scheduler_started else "phase 1: dedicated only (leases off)"
            return live_view.snapshot(collector.obs, phase, now - t0, o.duration_s, now, self.real_gpu)

        def tick() -> None:
            nonlocal scheduler_started
            if not scheduler_started and time.time() >= t1:
                self._skip_to_now()
                procs.start("scheduler", argv["scheduler"], self.host_cpus)
                self.timeline["t1"] = time.time()
                scheduler_started = True
            for name, code in procs.exited():
                self.problems.append(f"{name} exited with code {code}")

        if live:
            from rich.live import Live

            with Live(live_view.render(snap()), refresh_per_second=2, transient=False) as lv:
                while time.time() < t_end:
                    tick()
                    lv.update(live_view.render(snap()))
                    time.sleep(0.5)
        else:
            next_line = 0.0
            while time.time() < t_end:
                tick()
                if time.monotonic() >= next_line:
                    next_line = time.monotonic() + o.line_every_s
                    self.echo(live_view.line(snap()))
                time.sleep(0.25)
        self.timeline["t_end"] = time.time()
        self.cpu_seconds = procs.cpu_seconds()

    def _skip_to_now(self) -> None:
        """Commit the scheduler group's offsets at the end of the telemetry topic: a scheduler that
        starts at t1 decides on telemetry from t1 on, not on phase 1's backlog (whose leases
        would be stale before they start)."""
        from rose.kafka.admin import partitions_of
        from rose.kafka.consumer import TopicPartition, make_consumer
        from rose.scheduler.service import SCHEDULER_GROUP

        k = self.cfg.kafka
        from rose.demo.observed import quiet_logger

        c = make_consumer(k, f"{k.topic_prefix}{SCHEDULER_GROUP}", logger=quiet_logger())

        def commit() -> None:
            ends = []
            for p in partitions_of(k, k.telemetry_topic):
                _lo, hi = c.get_watermark_offsets(TopicPartition(k.telemetry_topic, p), timeout=10)
                ends.append(TopicPartition(k.telemetry_topic, p, hi))
            c.commit(offsets=ends, asynchronous=False)

        from rose.kafka.admin import KafkaException

        deadline = time.monotonic() + 20.0
        try:
            while True:
                try:
                    return commit()
                except KafkaException:  # a partition without a leader for a moment (broker restart)
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.25)
        finally:
            c.close()
