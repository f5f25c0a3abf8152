"""The full-system harness of tests/faults/test_full_system.py: every ROSE process of one node
(`rose scheduler`, `rose executor --simulate 4`, a dedicated rollout worker, `rose weights
follow`, optionally `rose agent --simulate`) as a `Proc` each, plus in-process threads feeding
telemetry and publishing weight versions, on the test's topics and keys (`System`); it submits
tasks, waits until the run is under load, drains it, stops it and hands it to
tests/faults/audit.py. The trainer's versions are a function of its seed (`trainer_states`),
which the audit recomputes rather than trusting what the run kept."""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np
import orjson
import psutil
import redis as redis_lib

from rose.contract.wire import encode
from rose.kafka.admin import partitions_of
from rose.kafka.consumer import KafkaException, TopicPartition, make_consumer, read_all
from rose.kafka.producer import make_producer, produce
from rose.rollout.episode import Task, ToolLatency
from rose.rollout.launcher import WorkerConfig, launch
from rose.rollout.tasks import TaskQueue
from rose.scheduler.service import SCHEDULER_GROUP
from rose.sim.telemetry_workload import workload
from tests.faults import audit
from tests.kafka_checks import OpenTransactions

JOB = "fullsys"
MODEL = "policy"
N_GPUS = 4  # sim/0 … sim/3: the agent's and `rose executor --simulate 4`'s ids
REVOKE_DEADLINE_S = 2.0
SMALL = {"d_model": 64, "n_heads": 4, "d_ff": 128, "n_layers": 2, "max_seq": 256}
SHARD = 16 << 10
TURNS = 3
TOOL_S = 1.5  # tool calls of seconds keep episodes in flight without costing CPU


QUIET = logging.getLogger("tests.full_system.librdkafka")
QUIET.addHandler(logging.NullHandler())
QUIET.propagate = False
QUIET.setLevel(logging.CRITICAL)  # a refused connection per retry would bury a failure's report


def fault_rng(name: str) -> tuple[random.Random, int]:
    seed = int(os.environ.get("ROSE_FAULT_SEED", random.SystemRandom().randrange(1 << 30)))
    return random.Random(f"{seed}-{name}"), seed


def trainer_states(seed: int, versions: int) -> Iterator[dict[str, np.ndarray]]:
    """The trainer's versions 1..`versions`: a sparse update of `w` per step, a bias shifted by
    the step, the step itself. A pure function of `seed`, so the audit can recompute them."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(40_000).astype(np.float32)
    b = rng.standard_normal(300).astype(np.float32)
    for v in range(1, versions + 1):
        w = w + rng.standard_normal(w.size).astype(np.float32) * np.float32(1e-3) * (rng.random(w.size) < 0.2)
        yield {"w": w.copy(), "b": b + np.float32(v), "step": np.array([v], dtype=np.int64)}


def wait_for(pred, timeout: float, what: str, every: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout:.0f}s")


def log_records(log: Path) -> list[dict]:
    """The JSON lines of a ROSE process's log, each with its timestamp parsed into `_at`."""
    out = []
    for line in log.read_bytes().splitlines():
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "timestamp" in rec:
            rec["_at"] = datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00"))
            out.append(rec)
    return out


@dataclass
class Proc:
    """A service run as a subprocess; restarts get a new log file."""

    name: str
    argv: list[str]
    env: dict
    logs: Path
    proc: subprocess.Popen | None = None
    starts: int = 0
    kills: list[float] = field(default_factory=list)
    stop_s: float | None = None

    def start(self, argv: list[str] | None = None, worker: WorkerConfig | None = None) -> Proc:
        self.starts += 1
        io = {
            "env": self.env,
            "stdin": subprocess.DEVNULL,
            "stdout": open(self.logs / f"{self.name}.{self.starts}.out", "wb"),
            "stderr": open(self.logs / f"{self.name}.{self.starts}.log", "wb"),
        }
        self.proc = launch(worker, **io) if worker is not None else subprocess.Popen(argv or self.argv, **io)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> float:
        t = time.time()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.kills.append(t)
        return t

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM; `stop_s` is how long the process took to be gone."""
        if self.alive():
            t0 = time.monotonic()
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.stop_s = round(time.monotonic() - t0, 2)
        return self.proc.returncode if self.proc else None

    def lines(self) -> list[dict]:
        out = []
        for i in range(1, self.starts + 1):
            for raw in (self.logs / f"{self.name}.{i}.log").read_bytes().splitlines():
                try:
                    out.append(orjson.loads(raw))
                except orjson.JSONDecodeError:
                    pass
        return out


class System:
    """Every ROSE process of one node plus a trainer, on the test's topics and keys."""

    def __init__(
        self,
        cfg,
        tmp_path: Path,
        *,
        agent_trace: Path | None = None,
        duration_s: float = 30.0,
        versions: int = 6,
        tasks_per_wave: int = 12,
        seed: int = 1,
        gpus: int = N_GPUS,
    ):
        self.cfg, self.tmp, self.duration_s, self.versions = cfg, tmp_path, duration_s, versions
        self.gpus = gpus  # simulated GPUs: the executor's, the agent's and the feeder's
        self.tasks_per_wave = tasks_per_wave
        self.logs = tmp_path / "logs"
        self.logs.mkdir()
        self.weights_dir = tmp_path / "follower"
        self.env = {
            **os.environ,
            "ROSE_KAFKA_BOOTSTRAP": cfg.kafka.bootstrap,
            "ROSE_REDIS_URL": cfg.redis.url,
            "ROSE_KAFKA__TOPIC_PREFIX": cfg.kafka.topic_prefix,
            "ROSE_REDIS__KEY_PREFIX": cfg.redis.key_prefix,
            "ROSE_KAFKA__PARTITIONS": str(cfg.kafka.partitions),
            "ROSE_EXECUTOR__LATENCY_DIR": str(tmp_path / "latency"),
            "ROSE_EXECUTOR__JOB": JOB,
            "ROSE_EXECUTOR__REVOKE_DEADLINE_S": str(REVOKE_DEADLINE_S),
        }
        self.env.pop("ROSE_CONFIG", None)
        rose = [sys.executable, "-m", "rose"]
        self.procs = {
            "scheduler": Proc("scheduler", rose + ["scheduler", "--instance", "fs"], self.env, self.logs),
            "executor": Proc("executor", rose + ["executor", "--simulate", str(gpus)], self.env, self.logs),
            "follower": Proc(
                "follower",
                rose
                + [
                    "weights",
                    "follow",
                    "--model",
                    MODEL,
                    "--out",
                    str(self.weights_dir),
                    "--until-version",
                    str(versions),
                ],
                self.env,
                self.logs,
            ),
            "worker": Proc("worker", [], self.env, self.logs),
        }
        self.agent_trace = agent_trace
        if agent_trace is not None:
            self.procs["agent"] = Proc(
                "agent",
                rose + ["agent", "--simulate", str(agent_trace), "--gpus", str(gpus), "--speed", "4"],
                self.env,
                self.logs,
            )
        self.r = redis_lib.Redis.from_url(cfg.redis.url)
        self.queue = TaskQueue(self.r, cfg.redis, JOB)
        self.submitted: dict[str, int] = {}
        self.published = 0
        self.trainer_retries = 0
        self.submit_retries = 0  # a wave's submission retried after a Redis error
        self.extra_waves = 0  # waves submitted because a fault found no episode in flight
        self.feeder_events = 0
        self.seed = seed
        self.t0 = time.time()
        self._stop = threading.Event()
        self._stopping = threading.Event()
        # the trainer publishes its last version once this is set: the follower exits at that
        # version, so a test killing the follower holds it until its kills have landed
        self.last_version_gate = threading.Event()
        self.last_version_gate.set()
        # telemetry flows for `duration_s`, and past it (up to twice as long) while this is clear:
        # a scheduler only opens transactions while telemetry arrives, so a test killing it
        # keeps the load on until its kills have landed
        self.faults_done_gate = threading.Event()
        self.faults_done_gate.set()
        self.worker_restarts = 0
        self._threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []
        self.stop_s: dict[str, float | None] = {}  # seconds from SIGTERM to gone, per process
        self._open: OpenTransactions | None = None

    # ---- parts ---------------------------------------------------------------------------
    def worker_config(self) -> WorkerConfig:
        n = self.procs["worker"].starts + 1
        return WorkerConfig(
            gpu="rollout/0",
            worker_id=f"dedicated-{n}",
            redis=self.cfg.redis,
            job=JOB,
            model=MODEL,
            dedicated=True,
            nice=5,
            max_batch=4,
            model_spec=SMALL,
            # min_idle_ms as the executor's workers have it (WorkerConfig's default): they touch
            # their episodes every min_idle_ms / 3, so a shorter one here would take over the
            # episodes of live (or briefly paused) leased workers and run them twice
            reclaim_every_ms=500,
            seed=n,
        )

    def start_worker(self) -> None:
        self.procs["worker"].start(worker=self.worker_config())

    def start_agent(self) -> None:
        left = max(5.0, self.duration_s - (time.time() - self.t0))
        p = self.procs["agent"]
        p.start(p.argv + ["--duration", f"{left:.1f}"])

    def submit(self, wave: int, n: int) -> None:
        for i in range(n):
            tid = f"w{wave}-{i}"
            if tid in self.submitted:
                continue  # a retried wave: submitted before the error
            self.queue.submit(
                Task(
                    task_id=tid,
                    prompt=[1 + (i * 7 + wave) % 200, 2, 3, 4],
                    max_turns=TURNS,
                    tokens_per_turn=12,
                    obs_tokens=4,
                    tool=ToolLatency(mu=math.log(TOOL_S), sigma=0.3),
                    seed=i + 100 * wave,
                )
            )
            self.submitted[tid] = TURNS

    def _thread(self, fn) -> None:
        def run():
            try:
                fn()
            except BaseException as e:  # surfaced by finish()
                self.errors.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self._threads.append(t)

    def _feed(self) -> None:
        """Calm/spiky telemetry (rose.telemetry_workload) for sim/0 .. sim/{gpus-1}, each event produced
        at its own timestamp, so leases are granted, renewed and revoked in real time; for
        `duration_s`, or longer while `faults_done_gate` is clear."""
        n = int(self.duration_s / 0.5)
        start = time.time() + 0.5
        events = workload(self.gpus, 2 * n, seed=self.seed, t0=start, prefix="sim")
        # buffers and retries through a broker outage (without a log line per reconnect attempt)
        p = make_producer(self.cfg.kafka, logger=QUIET)
        for ev in events:
            if ev.ts >= start + n * 0.5 and self.faults_done_gate.is_set():
                break
            while (left := ev.ts - time.time()) > 0:
                if self._stop.wait(min(left, 0.05)):
                    break
            if self._stop.is_set():
                break
            produce(p, self.cfg.kafka.telemetry_topic, encode(ev), ev.gpu)
            p.poll(0)
            self.feeder_events += 1
        assert p.flush(120) == 0, "telemetry lost by the feeder's producer"

    def _train(self) -> None:
        """A trainer: a version every few seconds, retried while Redis is away."""
        from rose.weights.stream import WeightPublisher

        pub = WeightPublisher(self.r, self.cfg.redis, MODEL, shard_bytes=SHARD, chunk_bytes=8192)
        every = (self.duration_s * 0.8) / self.versions
        for v, state in enumerate(trainer_states(self.seed, self.versions), 1):
            if self._stop.wait(every if v > 1 else 2.0):
                return
            if v == self.versions:
                self.last_version_gate.wait(self.duration_s + 120)
            deadline = time.monotonic() + 60
            while True:
                try:
                    pub.publish(state)
                    break
                except (redis_lib.ConnectionError, redis_lib.TimeoutError, redis_lib.BusyLoadingError):
                    self.trainer_retries += 1
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            self.published = v
            if v < self.versions:  # a wave of episodes per step: workers stay busy through the faults
                self._retrying(lambda: self.submit(v + 1, self.tasks_per_wave // 2))

    def supervise_worker(self) -> None:
        """Restart the dedicated worker when it exits on its own, as its service manager would
        (a leased worker is restarted by its executor)."""

        def loop():
            while not self._stopping.wait(0.5):
                if not self.procs["worker"].alive():
                    self.worker_restarts += 1
                    self.start_worker()

        threading.Thread(target=loop, daemon=True).start()

    def _retrying(self, fn):
        deadline = time.monotonic() + 60
        while True:
            try:
                return fn()
            except (redis_lib.ConnectionError, redis_lib.BusyLoadingError):
                if time.monotonic() > deadline:
                    raise
                self.submit_retries += 1  # the submission in flight may have landed: its task twice
                time.sleep(0.5)

    # ---- run -----------------------------------------------------------------------------
    def start(self) -> System:
        self.submit(1, self.tasks_per_wave)
        for name in ("scheduler", "executor", "follower"):
            self.procs[name].start()
        self.start_worker()
        self.t0 = time.time()
        if self.agent_trace is not None:
            self.start_agent()
        else:
            self._thread(self._feed)
        self._thread(self._train)
        return self

    def lease_states(self) -> list[dict]:
        return [
            {**orjson.loads(m.value()), "_ts": m.timestamp()[1] / 1000}
            for m in read_all(self.cfg.kafka, [self.cfg.kafka.lease_state_topic])
            if m.value()
        ]

    def wait_loaded(self, timeout: float = 60) -> None:
        """Under load: a lease active (its worker running) and episodes completing."""
        wait_for(lambda: any(s["state"] == "active" for s in self.lease_states()), timeout, "no lease granted")
        wait_for(lambda: self.r.xlen(self.queue.results_stream) > 0, timeout, "no episode completed")

    def in_flight(self) -> int:
        """Episodes submitted and not finished yet."""
        return len(self.submitted) - self.r.hlen(self.queue.done_key)

    def ensure_in_flight(self, wait_s: float = 10) -> None:
        """Episodes in flight before a fault: wait up to `wait_s` for the trainer's next wave;
        if the waves are over (a fast run), submit one more, so the fault still lands under load."""
        try:
            wait_for(lambda: self.in_flight() > 0, wait_s, "no episode in flight", every=0.1)
        except AssertionError:
            self.extra_waves += 1
            self.submit(1000 + self.extra_waves, self.tasks_per_wave // 2)
            wait_for(lambda: self.in_flight() > 0, wait_s, "no episode in flight after an extra wave", every=0.1)

    def leased_worker_pids(self) -> list[int]:
        pids = [ln["pid"] for ln in self.procs["executor"].lines() if ln.get("event") == "worker.started"]
        return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]

    def scheduler_caught_up(self) -> bool:
        k = self.cfg.kafka
        c = make_consumer(k, f"{k.topic_prefix}{SCHEDULER_GROUP}")
        try:
            tps = [TopicPartition(k.telemetry_topic, p) for p in partitions_of(k, k.telemetry_topic)]
            committed = c.committed(tps, timeout=10)
            for tp in committed:
                _lo, hi = c.get_watermark_offsets(tp, timeout=10)
                if hi > 0 and tp.offset < hi:
                    return False
            return True
        except KafkaException:  # e.g. NOT_COORDINATOR while the group coordinator moves after a restart
            return False
        finally:
            c.close()

    def finish(self, drain_s: float = 90) -> dict:
        """Let the run end, drain everything, stop every process cleanly; what it counted."""
        if self.agent_trace is not None:
            wait_for(lambda: not self.procs["agent"].alive(), self.duration_s + 60, "the agent did not finish")
        for t in self._threads:
            t.join(self.duration_s + 120)
        assert not self.errors, f"feeder/trainer failed: {self.errors!r}"
        wait_for(self.scheduler_caught_up, drain_s, "the scheduler did not consume all telemetry", every=1)
        wait_for(
            lambda: self.r.hlen(self.queue.done_key) >= len(self.submitted),
            drain_s,
            f"tasks not all done ({self.r.hlen(self.queue.done_key)}/{len(self.submitted)})",
            every=1,
        )
        wait_for(lambda: not self.procs["follower"].alive(), 60, "the follower did not reach the last version")
        fol = self.procs["follower"]
        assert fol.proc.returncode == 0, (
            f"the follower exited {fol.proc.returncode}: {(self.logs / f'follower.{fol.starts}.log').read_text()[-800:]}"
        )
        self._stopping.set()
        time.sleep(0.6)
        codes = {}
        for name in ("agent", "scheduler", "executor", "worker", "follower"):
            if name in self.procs:
                codes[name] = self.procs[name].stop()
                self.stop_s[name] = self.procs[name].stop_s
        return codes

    def print_log_tails(self, n: int = 30) -> None:
        """On failure: the last log lines of every process (librdkafka's chatter left out)."""
        for name, p in self.procs.items():
            for i in range(max(1, p.starts - 1), p.starts + 1):
                f = self.logs / f"{name}.{i}.log"
                if f.exists():
                    keep = [ln for ln in f.read_text(errors="replace").splitlines() if not ln.startswith("%")]
                    print(f"---- {f.name} (last {n} lines, exit {p.proc.poll() if p.proc else None}) ----")
                    print("\n".join(ln[:400] for ln in keep[-n:]))

    def stop_all(self) -> None:
        self._stop.set()
        self._stopping.set()
        for p in self.procs.values():
            if p.alive():
                p.stop(20)
        self.close_watermarks()
        self.r.close()

    # ---- the scheduler's transactions ----------------------------------------------------
    def open_transaction(self) -> dict[tuple[str, int], tuple[int, int]]:
        """The scheduler's output not yet committed or aborted (`OpenTransactions` over
        `commands` and `scheduler-state`): only the scheduler writes there, so the ranges are its
        open transaction's records."""
        if self._open is None:
            k = self.cfg.kafka
            self._open = OpenTransactions(
                k, (k.commands_topic, k.topic("scheduler-state")), f"{k.topic_prefix}watermarks"
            )
        return self._open()

    def kill_scheduler_in_transaction(self, timeout: float = 60) -> tuple[float, dict]:
        """SIGKILL the scheduler while one of its transactions is open: watch for one, freeze the
        scheduler (SIGSTOP), check that it is still open, and again 0.2 s later (so that not
        even a commit already on its way to the broker closes it), then kill it; if it closed,
        thaw the scheduler and watch on. The kill time and the open transaction's offsets ({}
        if none was caught within `timeout`: then it is killed anyway)."""
        p = self.procs["scheduler"]
        ps = psutil.Process(p.proc.pid)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.open_transaction():
                continue
            p.proc.send_signal(signal.SIGSTOP)
            wait_for(lambda: ps.status() == psutil.STATUS_STOPPED, 5, "the scheduler did not stop", every=0.001)
            if self.open_transaction():
                time.sleep(0.2)
                if still := self.open_transaction():
                    return p.kill(), still
            p.proc.send_signal(signal.SIGCONT)
        return p.kill(), {}

    def close_watermarks(self) -> None:
        if self._open is not None:
            self._open.close()
            self._open = None

    # ---- the audit -------------------------------------------------------------------------
    def audit(
        self,
        executor_kills: list[float] = (),
        max_duplicates: int = 0,
        open_at_kills: list[dict] = (),
        rebuilds: list[tuple[float, float]] = (),
    ) -> dict:
        """The common audit (tests/faults/audit.py); the records it read go to logs/records.ndjson.
        Every GPU's commands must equal the pure policy's outside the fault windows (`rebuilds`)."""
        assert self.published == self.versions
        audit.dump_records(self.cfg, self.logs / "records.ndjson")
        return {
            "commands": audit.audit_commands(self.cfg, list(rebuilds)),
            "transactions": audit.audit_aborted(self.cfg, list(open_at_kills)),
            "leases": audit.audit_leases(self.cfg, REVOKE_DEADLINE_S, list(executor_kills)),
            "tasks": audit.audit_tasks(self.queue, self.submitted, max_duplicates, self.submit_retries),
            "weights": audit.audit_weights(
                self.r,
                self.cfg.redis.key("weights", MODEL),
                self.weights_dir,
                list(trainer_states(self.seed, self.versions)),
                SHARD,
            ),
        }
