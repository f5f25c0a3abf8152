"""The demo's run, phase by phase: start-up (every process up and ready: not counted in
--duration) → the measured run, alternating leases-off and leases-on windows
(rose.demo.windows.plan: off first) → the drain (until the episodes started in the run have
finished, bounded) → shutdown (executors first: they revoke their leases and drain their
workers; then the rest).

Leases off: the scheduler is not running, so no grant or renewal is issued; a lease of the
window before lapses at its expiry (policy.ttl_s), as the protocol ends any lease its scheduler
stops renewing, and the executors are then idle. Leases on: the scheduler is started, deciding
on telemetry from that moment on. Executors, serving, the dedicated worker and the trainer run
throughout, so the windows differ only in whether leases are issued.

On CPU each window also records what the device's core did in it (`core`: idle, serving and
rollout seconds, rose.demo.device_core), from the core's /proc/stat line read as it opens and
as it closes.
"""

from __future__ import annotations

import sys
import time

from rose.contract.records import WorkerRegistry
from rose.demo import device_core, live_view
from rose.demo.processes import Processes
from rose.demo.run_setup import MEASURE_KEY, DemoError, DemoSetup


class DemoPhases(DemoSetup):
    """Waits for start-up, runs the windows with the live view, drains, and stops every process."""

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
                coserve = r.hget(key("demo:coserve"), "state")
                if coserve not in (b"warm", b"measuring", b"serving"):
                    missing.append("co-served device")
                if int(r.hget(key("demo:trainer"), "version") or 0) < 1:
                    missing.append("trainer")
                if r.hlen(key("demo:ready")) < 2:
                    missing.append("executors")
                if WorkerRegistry(r, key).read(f"dedicated-{self.run_id}") is None:
                    missing.append("dedicated worker")
                if not missing and coserve != b"serving":
                    r.set(key(MEASURE_KEY), 1)  # the rest runs: the device measures its capacity beside it
                    missing.append("co-served device's capacity measurement")
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
        from rose.demo.windows import plan

        o = self.opts
        t0 = time.time()
        t_end = t0 + o.duration_s
        schedule = [(t0 + a, on) for a, _b, on in plan(o.duration_s, o.window_s)]
        windows: list[dict] = []
        self.timeline = {"t0": t0, "t_end": t_end, "windows": windows}
        live = sys.stdout.isatty() if o.live is None else o.live

        def snap():
            now = time.time()
            w = windows[-1] if windows else {"leases": False}
            phase = f"window {len(windows)}/{len(schedule)}: leases {'on' if w['leases'] else 'off'}"
            return live_view.snapshot(collector.obs, phase, now - t0, o.duration_s, now, self.real_gpu)

        def tick() -> None:
            while len(windows) < len(schedule) and time.time() >= schedule[len(windows)][0]:
                self._enter_window(procs, argv, windows, schedule[len(windows)][1])
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
        if windows:
            self._close_window(windows[-1], self.timeline["t_end"], self._core_sample())
        self.cpu_seconds = procs.cpu_seconds()
        self._drain(collector)

    def _enter_window(self, procs: Processes, argv, windows: list[dict], leases: bool) -> None:
        """Close the current window and open the next: start or stop the scheduler."""
        now = time.time()
        core = self._core_sample()
        if windows:
            self._close_window(windows[-1], now, core)
        windows.append({"start": now, "end": None, "leases": leases, "core_start": core})
        running = "scheduler" in procs.procs and procs.procs["scheduler"].poll() is None
        if leases and not running:
            self._skip_to_now()
            procs.start("scheduler", argv["scheduler"], self.host_cpus)
        elif not leases and running:
            killed = procs.stop(["scheduler"], timeout_s=12.0)
            if killed:
                self.problems.append("scheduler killed after the SIGTERM deadline at a window's end")

    def _core_sample(self) -> device_core.CoreSample | None:
        """The device core's times now (None: no device core, or /proc/stat unreadable)."""
        if not self.device_cpus:
            return None
        try:
            return device_core.read_core(min(self.device_cpus))
        except (OSError, ValueError):
            return None

    @staticmethod
    def _close_window(w: dict, now: float, core: device_core.CoreSample | None) -> None:
        """End window `w` at `now`; its core split from the sample it opened with to `core`."""
        w["end"] = now
        start = w.pop("core_start", None)
        w["core"] = device_core.split(start, core) if start is not None and core is not None else None

    def _drain(self, collector) -> None:
        """Keep everything running until every episode started before t_end has finished (its
        trajectory is in), at most `drain_s`: an episode started near the end of the last window
        counts for it like any other. What is still unfinished then is in the report."""
        t_end = self.timeline["t_end"]
        deadline = time.monotonic() + self.opts.drain_s
        while time.monotonic() < deadline:
            started = dict(collector.obs.started)
            done = {e["task_id"] for e in list(collector.obs.episodes)}
            if all(tid in done for tid, t in started.items() if t < t_end):
                break
            time.sleep(0.25)
        self.timeline["t_drained"] = time.time()

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
