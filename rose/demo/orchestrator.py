"""Starts, watches and stops every process of the demo, and writes the report.

Timeline: start-up (every process up and ready: not counted in --duration) → phase 1,
dedicated-only (the dedicated worker and the trainer run, serving runs, the co-served device
calibrates its SLO; no scheduler, so no lease) → phase 2 at t1 (the scheduler starts; leases
come and go) → t_end → shutdown (executors first: they revoke their leases and drain their
workers; then the rest) → the final read of every topic and key → the report.

Every process gets the run's configuration in one piece: `Demo.cfg` (the caller's config with
the run's topic and key prefixes, job, model and guard settings) is written to a 0600 TOML
file in a private directory, and each child loads it through `ROSE_CONFIG`, nothing else (the
caller's own ROSE_* settings are already in it and are not passed on). The dedicated rollout
worker gets its `WorkerConfig` from `rose.rollout.launcher.launch`, off the command line.

Shutdown is SIGTERM, then SIGKILL after a deadline, for every process this module started,
also on Ctrl-C or an error; children also get PR_SET_PDEATHSIG (`rose.rollout.launcher.spawn`)
so that none outlives a killed orchestrator. The local stack is stopped at the end only if this
run started it. The run's topics and Redis keys are deleted at the end unless `keep` is set;
the config file always is.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rose.config import Config, GiB, load_config
from rose.rollout.launcher import WorkerConfig, launch, spawn

REPO = Path(__file__).resolve().parent.parent.parent
DEFAULT_TRACE = "azure_llm2023_conv.csv"
# what load_config reads from the environment: the children get none of it but ROSE_CONFIG
_CONFIG_VARS = ("ROSE_CONFIG", "ROSE_KAFKA_BOOTSTRAP", "ROSE_REDIS_URL")


class DemoError(RuntimeError):
    """The demo cannot run; the message says why."""


@dataclass(frozen=True)
class DemoOptions:
    duration_s: float = 180.0
    report_dir: str = "reports/demo"
    gpus: int = 3
    trace: str | None = None
    speed: float = 0.5  # trace arrival rate × this (0.5: the trace's load over 3 GPUs at half rate)
    phase1_frac: float = 0.2  # dedicated-only share of the run (clamped to [10, 30] s)
    max_batch: int = 4  # KV slots (concurrent episodes) per rollout worker
    keep: bool = False  # keep the run's topics and Redis keys
    live: bool | None = None  # None: rich view on a terminal, progress lines otherwise
    startup_timeout_s: float = 240.0
    line_every_s: float = 5.0

    @property
    def phase1_s(self) -> float:
        return min(30.0, max(10.0, self.phase1_frac * self.duration_s))


def default_trace() -> Path:
    base = Path(os.environ.get("ROSE_TRACES", REPO.parent / "shared" / "traces"))
    return base / DEFAULT_TRACE


class Processes:
    """The child processes, each with its log file; stopped in a given order."""

    def __init__(self, log_dir: Path, env: dict):
        self.log_dir, self.env = log_dir, env
        self.procs: dict[str, subprocess.Popen] = {}
        self.reported: set[str] = set()

    def start(self, name: str, what: list[str] | WorkerConfig, cpus: set[int] | None = None) -> subprocess.Popen:
        """Start `what` (an argv, or a rollout worker's config) in its own session (Ctrl-C reaches
        only the orchestrator), SIGTERMed by the kernel if the orchestrator dies, on the CPUs
        `cpus` (None: any; a worker config names its own)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "ab")
        io: dict[str, Any] = {
            "env": self.env,
            "stdin": subprocess.DEVNULL,
            "stdout": log,
            "stderr": subprocess.STDOUT,
            "start_new_session": True,
            "cwd": str(REPO),
        }
        try:
            if isinstance(what, WorkerConfig):
                p = launch(dataclasses.replace(what, cpus=tuple(sorted(cpus or what.cpus))), **io)
            else:
                p = spawn(what, cpus=sorted(cpus or ()), **io)
        finally:
            log.close()
        self.procs[name] = p
        return p

    def exited(self) -> list[tuple[str, int]]:
        """Processes that ended on their own since the last call: (name, exit code)."""
        out = []
        for name, p in self.procs.items():
            if name not in self.reported and p.poll() is not None:
                self.reported.add(name)
                out.append((name, p.returncode))
        return out

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) of each process and its descendants so far."""
        import psutil

        out = {}
        for name, p in self.procs.items():
            try:
                root = psutil.Process(p.pid)
                total = 0.0
                for q in [root, *root.children(recursive=True)]:
                    t = q.cpu_times()
                    total += t.user + t.system + t.children_user + t.children_system
                out[name] = round(total, 1)
            except psutil.Error:
                continue
        return out

    def stop(self, names: list[str], timeout_s: float) -> list[str]:
        """SIGTERM these, wait up to timeout_s, SIGKILL what is left; names that needed a kill."""
        live = [n for n in names if n in self.procs and self.procs[n].poll() is None]
        for n in live:
            self.reported.add(n)
            try:
                self.procs[n].send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(self.procs[n].poll() is None for n in live):
            time.sleep(0.05)
        killed = []
        for n in live:
            if self.procs[n].poll() is None:
                self.procs[n].kill()
                killed.append(n)
            self.procs[n].wait()
        return killed

    def stop_all(self, order: list[str], timeout_s: float = 10.0) -> list[str]:
        first = [n for n in order if n in self.procs]
        killed = self.stop(first, timeout_s)
        return killed + self.stop([n for n in self.procs if n not in first], timeout_s)


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


class Demo:
    def __init__(self, cfg: Config, opts: DemoOptions, echo: Callable[[str], None] = print):
        from rose.executor.guard import default_latency_dir

        self.opts, self.echo = opts, echo
        self.run_id = uuid.uuid4().hex[:8]
        self.trace = str(Path(opts.trace) if opts.trace else default_trace())
        self.job, self.model = "demo", "policy"
        self.latency_dir = default_latency_dir() / f"demo-{self.run_id}"
        self.cfg = dataclasses.replace(
            cfg,
            kafka=dataclasses.replace(
                cfg.kafka, topic_prefix=f"{cfg.kafka.topic_prefix}demo-{self.run_id}.", partitions=4
            ),
            redis=dataclasses.replace(cfg.redis, key_prefix=f"{cfg.redis.key_prefix}demo-{self.run_id}:"),
            executor=dataclasses.replace(
                cfg.executor,
                job=self.job,
                model=self.model,
                worker_weights="follow",
                latency_dir=str(self.latency_dir),
                guard_period_s=0.002,
            ),
        )
        self.config_dir: str | None = None  # holds the run's config file (secrets: 0700 / 0600)
        self.real_gpu = "real/0"
        self.cuda = _cuda()
        self.real_device = "cuda:0" if self.cuda else "cpu"
        self.report_dir = Path(opts.report_dir)
        # On CPU the co-served "device" is one core: the serving model and its leased rollout worker
        # run there, every other process of the demo on the remaining cores.
        cpus = sorted(os.sched_getaffinity(0))
        self.device_cpus: set[int] | None
        self.host_cpus: set[int] | None
        if not self.cuda and len(cpus) >= 2:
            self.device_cpus, self.host_cpus = {cpus[-1]}, set(cpus[:-1])
        else:
            self.device_cpus = self.host_cpus = None
        self.problems: list[str] = []
        self.timeline: dict = {}

    # ---- set-up ------------------------------------------------------------------------------
    def _write_config(self) -> str:
        """The run's config as a TOML file only this user can read; its path."""
        self.config_dir = tempfile.mkdtemp(prefix=f"rose-demo-{self.run_id}-")
        path = os.path.join(self.config_dir, "config.toml")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(config_toml(self.cfg))
        if load_config(path, env={}) != self.cfg:
            raise DemoError("the run's config does not survive its TOML file (a value TOML cannot hold?)")
        return path

    def _env(self) -> dict:
        env = {
            k: v for k, v in os.environ.items() if k not in _CONFIG_VARS and not (k.startswith("ROSE_") and "__" in k)
        }
        env.update(
            {
                "ROSE_CONFIG": self._write_config(),
                "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])),
            }
        )
        return env

    def _argv(self) -> dict[str, list[str] | WorkerConfig]:
        from rose.demo.coserve import CoserveSpec
        from rose.demo.trainer import TrainerSpec

        py, o = sys.executable, self.opts
        worker = ["--max-batch", str(o.max_batch)]
        sims = ",".join(f"sim/{i}" for i in range(o.gpus))
        return {
            "coserve": [
                py,
                "-m",
                "rose.demo.coserve",
                "--spec",
                CoserveSpec(
                    trace=self.trace,
                    gpu=self.real_gpu,
                    speed=1.0,
                    device=self.real_device,
                    latency_dir=str(self.latency_dir),
                ).to_json(),
            ],
            "agent": [
                py,
                "-m",
                "rose",
                "agent",
                "--simulate",
                self.trace,
                "--gpus",
                str(o.gpus),
                "--speed",
                str(o.speed),
            ],
            "trainer": [
                py,
                "-m",
                "rose.demo.trainer",
                "--spec",
                TrainerSpec(job=self.job, model=self.model, inflight=max(24, 4 * o.max_batch * (o.gpus + 2))).to_json(),
            ],
            "dedicated": WorkerConfig.from_config(
                self.cfg,
                gpu="rollout/0",
                worker_id=f"dedicated-{self.run_id}",
                device="cpu",
                mem_bytes=2 * GiB,
                compute_share=0.5,
                dedicated=True,
                nice=0,
                seed=11,
                weights="follow",
                max_batch=o.max_batch,
            ),
            "executor-sim": [py, "-m", "rose.demo.executor_node", "--gpus", sims, "--no-guard", *worker],
            "executor-real": [
                py,
                "-m",
                "rose.demo.executor_node",
                "--gpus",
                self.real_gpu,
                "--device",
                self.real_device,
                *worker,
                "--worker-cpus",
                ",".join(map(str, sorted(self.device_cpus or ()))),
            ],
            "scheduler": [py, "-m", "rose", "scheduler", "--instance", f"demo-{self.run_id}"],
        }

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
        procs = Processes(self.report_dir / "logs", self._env())
        collector = None
        interrupted = False
        try:
            try:
                wait_for_broker(self.cfg.kafka, timeout_s=60)
                create_topics(self.cfg.kafka)
            except Exception as e:  # noqa: BLE001 - KafkaException, TimeoutError: one line for the user
                raise DemoError(f"Kafka at {self.cfg.kafka.bootstrap} is not answering: {e!r}") from None
            from rose.demo.observed import Collector

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
                self.timeline.setdefault("t0", time.time())
                self.timeline.setdefault("t1", time.time())
                self.timeline["t_end"] = time.time()
            return self._report(interrupted, procs, collector)
        finally:
            self._stop(procs, collector)
            self._cleanup()

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

    # ---- the end -----------------------------------------------------------------------------
    def _report(self, interrupted: bool, procs: Processes, collector) -> dict:
        """Stop every process (so the executors' final lease states are in), then read and report."""
        import platform

        from rose.demo import report
        from rose.demo.observed import read_final
        from rose.kafka.admin import KafkaException

        self._stop(procs, collector)
        live_obs = collector.obs if collector is not None else None

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
        meta = {
            "run_id": self.run_id,
            "trace": Path(self.trace).name,
            "speed": self.opts.speed,
            "gpus": self.opts.gpus,
            "real_gpu": self.real_gpu,
            "real_device": self.real_device,
            "duration_s": self.opts.duration_s,
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
            "topic_prefix": self.cfg.kafka.topic_prefix,
            "redis_key_prefix": self.cfg.redis.key_prefix,
        }
        if not self.timeline:
            now = time.time()
            self.timeline = {"t0": now, "t1": now, "t_end": now}
        rep = report.build(obs, self.timeline, meta)
        report.write(self.report_dir, rep, obs)
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


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def config_toml(cfg: Config) -> str:
    """`cfg` as a TOML document that `load_config` reads back to an equal Config."""
    lines: list[str] = []
    tables: list[tuple[str, Mapping]] = []
    for section in dataclasses.fields(cfg):
        part = getattr(cfg, section.name)
        lines.append(f"[{section.name}]")
        for f in dataclasses.fields(part):
            v = getattr(part, f.name)
            if isinstance(v, Mapping):
                tables.append((f"{section.name}.{f.name}", v))
            else:
                lines.append(f"{f.name} = {_toml_value(v)}")
    for name, table in tables:
        lines.append(f"[{name}]")
        lines += [f"{_toml_value(str(k))} = {_toml_value(str(v))}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)  # 0.5, 1e-05, inf: all TOML floats
    body = "".join(
        {'"': '\\"', "\\": "\\\\"}.get(ch, ch) if ord(ch) >= 0x20 and ord(ch) != 0x7F else f"\\u{ord(ch):04x}"
        for ch in str(v)
    )
    return f'"{body}"'
