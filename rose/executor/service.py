"""`rose executor`: obey the lease command stream on one serving node and run rollout workers
inside the leases (the imperative shell around rose.executor.lease_machine).

The executor assigns itself the partitions of the commands topic that hold its GPUs' keys
(`rose.kafka.producer.partition_for`) rather than joining a consumer group, and reads them
read_committed. State is never trusted from memory: at start each GPU's highest epoch and last
word are rebuilt from the compacted lease-state topic. A command's TTL counts on this host's
monotonic clock from receipt, less its transit age. Workers get PR_SET_PDEATHSIG=SIGTERM, so
they drain and exit with their executor. Every command is a `process {topic}` span, each
transition a `lease.apply` span; malformed or badly signed commands go to the dead-letter topic.
Why assignment rather than a group, and the rest in full: docs/executor.md.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import psutil

from rose.config import Config
from rose.contract.events import Command, InvalidEvent, LeaseState
from rose.contract.signing import SIGNATURE_HEADER, verify
from rose.contract.wire import decode, encode
from rose.executor import lease_machine as lm
from rose.executor.guard import FileLatencySource, Guard, LatencySource
from rose.kafka.admin import partitions_of, retrying
from rose.kafka.consumer import (
    OFFSET_END,
    Consumer,
    KafkaError,
    Message,
    TopicPartition,
    consume_batch,
    header,
    make_consumer,
    read_partitions,
)
from rose.kafka.producer import Producer, dead_letter, make_producer, partition_for, produce
from rose.obs import metrics
from rose.obs.logs import get_logger
from rose.obs.tracing import inject_headers, process_span, send_span, tracer
from rose.rollout.launcher import LeaseRecord, WorkerConfig, launch, spawn
from rose.shutdown import Shutdown

if TYPE_CHECKING:
    from opentelemetry.util.types import AttributeValue

    from rose.rollout.pause_flag import PauseFlag

COMMANDS_IN = metrics.counter("rose_executor_commands_total", "Commands for this node's GPUs, by kind")
TRANSITIONS = metrics.counter("rose_executor_transitions_total", "Lease states published, by state")
DLQ = metrics.counter("rose_executor_dlq_total", "Commands sent to the dead-letter topic")
GUARD_TRIPS = metrics.counter("rose_executor_guard_trips_total", "Local guard pauses")
KILLS = metrics.counter("rose_executor_worker_kills_total", "Workers killed at the revoke deadline")
WORKERS = metrics.gauge("rose_executor_workers", "Rollout workers alive")
ROLLOUT_MEM = metrics.gauge("rose_executor_rollout_mem_bytes", "Measured rollout memory, by gpu")
WARM = metrics.gauge("rose_executor_warm_workers", "Warm workers in the pool, by whether they are ready")
STARTS = metrics.counter("rose_executor_worker_starts_total", "Lease workers, by how they started (warm | cold)")


def simulated_gpus(n: int) -> list[str]:
    return [f"sim/{i}" for i in range(n)]


def command_group(gpus: list[str]) -> str:
    """Offsets are committed under a group id that is stable for a node's set of GPUs."""
    return "rose-executor-" + hashlib.sha1(",".join(sorted(gpus)).encode()).hexdigest()[:16]


# A stand-in process for a worker (`executor.worker = "placeholder"`): it holds the lease's slot
# and dies on SIGTERM, so load and soak runs exercise the whole control plane on fleets of
# thousands of GPUs without a model per lease.
PLACEHOLDER_ARGV = ("sleep", "infinity")


def worker_config(cfg: Config, start: lm.Start, flag_name: str, device: str, seed: int) -> WorkerConfig:
    """The configuration of a lease's rollout worker (rose.rollout.worker): the lease's share,
    and `cfg`'s Redis connection, weights key, job and model. `rose.rollout.launcher.launch`
    hands it to the worker off the command line."""
    return WorkerConfig.from_config(
        cfg,
        gpu=start.gpu,
        worker_id=f"{socket.gethostname()}:{start.gpu}:{start.epoch}",
        device=device,
        mem_bytes=start.mem_bytes,
        compute_share=start.compute_share,
        pause_flag=flag_name,
        dedicated=False,
        nice=cfg.executor.worker_nice,
        seed=seed,
        weights=cfg.executor.worker_weights,
        max_staleness=cfg.executor.max_staleness,
    )


def measure_rollout_mem(pid: int, device: str) -> int:
    """Bytes the worker holds: NVML per-process memory on CUDA when available, else RSS."""
    if device.startswith("cuda"):
        try:
            import pynvml

            pynvml.nvmlInit()
            idx = int(device.split(":")[1]) if ":" in device else 0
            h = pynvml.nvmlDeviceGetHandleByIndex(idx)
            used = sum(p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == pid)
            if used:
                return int(used)
        except Exception:  # noqa: BLE001 - NVML absent or no permission: fall back to RSS
            pass
    try:
        proc = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0


@dataclass
class WorkerHandle:
    gpu: str
    proc: subprocess.Popen
    flag: PauseFlag | None  # None once the worker is reaped
    epoch: int
    started_ns: int = field(default_factory=time.monotonic_ns)
    lease_file: str = ""  # a warm worker's lease record, removed with the flag
    warm: bool = False  # taken from the pool rather than started for this lease


@dataclass
class WarmWorker:
    """A worker of the executor's pool: started and paused with no lease. It builds its model
    and applies the newest weights, then says so in its flag (`ready_ns`); a grant hands it the
    lease through a `LeaseRecord` in `lease_file` and the flag's assignment counter."""

    proc: subprocess.Popen
    flag: PauseFlag
    config: WorkerConfig
    started_ns: int = field(default_factory=time.monotonic_ns)
    ready_said: bool = False

    @property
    def ready(self) -> bool:
        return self.flag.ready_ns > 0 and self.proc.poll() is None


# A refill waits until the lease the last warm worker took has decoded its first token (at most
# this long), so that the new worker's imports and model build do not compete with it for the CPU.
POOL_HOLD_S = 2.0


def lease_file_for(flag_name: str) -> str:
    """Where the lease record of a warm worker goes: next to its flag (in /dev/shm when there)."""
    d = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(d, f"{flag_name}.lease")


def _unlink(path: str) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class Executor:
    """One node's executor. `start()`, then `run_once()` in a loop (or `run()`), `shutdown()`."""

    def __init__(
        self,
        cfg: Config,
        gpus: list[str],
        device: str = "cpu",
        latency_source: LatencySource | None = None,
        guard: bool = True,
        worker_config=worker_config,
        log_name: str = "rose.executor",
    ):
        if not gpus:
            raise ValueError("executor: no GPUs to manage")
        self.cfg = cfg
        self.k = cfg.kafka
        self.gpus = list(dict.fromkeys(gpus))
        self.device = device
        self.params = lm.Params(
            revoke_deadline_s=cfg.executor.revoke_deadline_s, restart_backoff_s=cfg.executor.restart_backoff_s
        )
        self.states: dict[str, lm.GpuLease] = {g: lm.initial(g) for g in self.gpus}
        self.workers: dict[str, WorkerHandle] = {}
        if cfg.executor.worker not in ("rollout", "placeholder"):
            raise ValueError(f"executor.worker: expected rollout or placeholder, got {cfg.executor.worker!r}")
        if cfg.executor.warm_workers < 0:
            raise ValueError(f"executor.warm_workers: expected >= 0, got {cfg.executor.warm_workers}")
        self.worker_config = worker_config  # (cfg, Start, flag name, device, seed) -> WorkerConfig
        # the warm pool (shell state; the lease machine only says Start): filled from start()
        self.pool: list[WarmWorker] = []
        self.pool_size = cfg.executor.warm_workers if cfg.executor.worker == "rollout" else 0
        self._pool_on = False
        self._pool_retry_at = 0.0
        self._pool_failures = 0  # warm workers in a row that exited before they were ready
        self._pool_hold: tuple[PauseFlag, float] | None = None  # refill waits for this lease's first token
        self.log = get_logger(log_name, gpus=",".join(self.gpus) if len(self.gpus) <= 8 else f"{len(self.gpus)} GPUs")
        self._tracer = tracer("rose.executor")
        self._hmac = cfg.security.command_hmac_key or None
        self._stopping = False
        self._flag_seq = 0
        self._seed = 0
        self._last_commit = 0.0
        self._next_housekeeping = 0.0
        self.published: list[LeaseState] = []  # kept for in-process benches and tests (bounded)
        self.guard: Guard | None = None
        if guard and cfg.executor.guard_period_s > 0:
            self.guard = Guard(
                self.gpus,
                latency_source or FileLatencySource(cfg.executor.latency_dir or None),
                on_trip=self._guard_pause,
                on_clear=None,
                trip_headroom=cfg.policy.revoke_headroom,
                clear_headroom=cfg.policy.grant_headroom,
                period_s=cfg.executor.guard_period_s,
            )
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self.group = command_group(self.gpus)
        self._lease_partitions: int | None = None  # partition count of lease-state, for spans

    # ---- life cycle ------------------------------------------------------------------------
    def start(self) -> Executor:
        self.producer = make_producer(self.k)
        retrying(self._rebuild)
        self.consumer = make_consumer(self.k, self.group, **{"fetch.wait.max.ms": 10})
        retrying(self._assign)
        self._pool_on = self.pool_size > 0
        self._tend_pool()
        if self.guard is not None:
            # the guard thread must get the interpreter within its poll period, not CPython's default 5 ms
            sys.setswitchinterval(min(sys.getswitchinterval(), self.cfg.executor.guard_period_s))
            self.guard.start()
        self.log.info("executor.ready", device=self.device, guard=self.guard is not None)
        return self

    def _rebuild(self) -> None:
        topic = self.k.lease_state_topic
        n = self._lease_partitions = len(partitions_of(self.k, topic))
        mine = sorted({partition_for(g, n) for g in self.gpus})
        last: dict[str, LeaseState] = {}
        highest: dict[str, int] = {}
        for m in read_partitions(self.k, [(topic, p) for p in mine]):
            raw_key = m.key()
            key = raw_key.decode("utf-8", "replace") if raw_key else None
            if key not in self.states:
                continue
            try:
                ls = decode(m.value(), expect=LeaseState)
            except InvalidEvent:
                continue  # not ours to judge here; the topic's producers are executors
            last[key] = ls
            highest[key] = max(highest.get(key, -1), ls.epoch)
        for gpu, ls in last.items():
            rec = lm.Record(ls.lease_id, max(ls.epoch, highest[gpu]), ls.state, ls.command_id)
            self.states[gpu], actions = lm.restore(gpu, rec)
            self._act(actions)
        self.log.info("executor.rebuilt", gpus_with_history=len(last))

    def _assign(self) -> None:
        topic = self.k.commands_topic
        n = len(partitions_of(self.k, topic))
        parts = sorted({partition_for(g, n) for g in self.gpus})
        consumer = self.consumer
        assert consumer is not None  # start() made it
        committed = consumer.committed([TopicPartition(topic, p) for p in parts], timeout=10)
        since_ms = int((time.time() - self.cfg.executor.lookback_s) * 1000)
        need_time = [TopicPartition(topic, tp.partition, since_ms) for tp in committed if tp.offset < 0]
        by_time = {
            tp.partition: tp.offset for tp in (consumer.offsets_for_times(need_time, timeout=10) if need_time else [])
        }
        assign = []
        for tp in committed:
            off = tp.offset if tp.offset >= 0 else by_time.get(tp.partition, OFFSET_END)
            assign.append(TopicPartition(topic, tp.partition, off if off >= 0 else OFFSET_END))
        consumer.assign(assign)

    def run(self, stop: threading.Event | None = None) -> None:
        """Until SIGTERM/SIGINT (or `stop` is set); then drain and exit cleanly. A caller that
        passes `stop` owns the signal handling (rose.shutdown)."""
        if stop is None:
            stop = Shutdown.install(name="rose-executor").stop
        while not stop.is_set():
            self.run_once()
        self.shutdown()

    def run_once(self, timeout: float | None = None) -> None:
        timeout = self.cfg.executor.tick_s if timeout is None else timeout
        msgs = consume_batch(self.consumer, 256, timeout) if self.consumer else []
        for m in msgs:
            self._message(m)
        now = time.monotonic()
        if now >= self._next_housekeeping:  # once a tick, however often commands arrive
            self._next_housekeeping = now + self.cfg.executor.tick_s
            self._housekeeping()
        if msgs and now - self._last_commit > 0.5:
            self._commit()

    def _housekeeping(self) -> None:
        if self.guard is not None:
            while not self.guard.events.empty():
                ev = self.guard.events.get_nowait()
                self._apply(ev.gpu, lm.GuardTrip() if ev.tripped else lm.GuardClear(), None)
        for gpu, h in list(self.workers.items()):
            if h.proc.poll() is not None:
                self._reap(gpu)
        for gpu in self.gpus:
            self._apply(gpu, lm.Tick(), None, quiet=True)
        WORKERS.set(len(self.workers))
        if self._pool_on or self.pool:
            self._tend_pool()
        if self.producer is not None:
            self.producer.poll(0)

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Revoke every lease (drain workers; kill at the deadline), publish the final states, flush."""
        if self._stopping:
            return
        self._stopping = True
        self.log.info("executor.stopping")
        self._pool_on = False
        for w in self.pool:  # nothing to drain: STOP and SIGTERM end a warm worker at once
            self._stop_warm(w)
        for gpu in self.gpus:
            self._apply(gpu, lm.Shutdown(), None)
        deadline = time.monotonic() + (timeout_s or self.params.revoke_deadline_s + 5.0)
        while (self.workers or self.pool) and time.monotonic() < deadline:
            self._housekeeping()
            time.sleep(self.cfg.executor.tick_s)
        for gpu in list(self.workers):  # the kernel did not deliver the kill in time: never leave one behind
            self.workers[gpu].proc.kill()
            self.workers[gpu].proc.wait(5)
            self._reap(gpu)
        for w in list(self.pool):
            w.proc.kill()
            w.proc.wait(5)
            self._reap_warm(w)
        if self.guard is not None:
            self.guard.stop()
        if self.producer is not None:
            self.producer.flush(10)
        if self.consumer is not None:
            self._commit(asynchronous=False)
            self.consumer.close()
            self.consumer = None
        self.log.info("executor.stopped")

    def _commit(self, asynchronous: bool = True) -> None:
        try:
            if self.consumer is not None:
                # the stubs overload commit() on Literal[True] / Literal[False] only, not on a bool
                self.consumer.commit(asynchronous=asynchronous)  # type: ignore[call-overload]
        except Exception:  # noqa: BLE001 - nothing consumed yet, or the broker is away: retry later
            pass
        self._last_commit = time.monotonic()

    # ---- commands --------------------------------------------------------------------------
    def _message(self, m: Message) -> None:
        if err := m.error():
            if err.code() != KafkaError._PARTITION_EOF:
                self.log.warning("executor.consume_error", error=str(err))
            return
        raw_key = m.key()
        key = raw_key.decode("utf-8", "replace") if raw_key is not None else None
        if key is not None and key not in self.states:
            return  # another node's GPU sharing the partition
        with process_span(self._tracer, m, self.group):
            self._command(m, key)

    def _command(self, m: Message, key: str | None) -> None:
        """Check, decode and apply a command for one of this node's GPUs (inside its span)."""
        if self._hmac:
            why = verify(self._hmac, m.value(), header(m, SIGNATURE_HEADER))
            if why:
                return self._dlq(m, why, SIGNATURE_HEADER)
        try:
            cmd = decode(m.value(), expect=Command)
        except InvalidEvent as e:
            return self._dlq(m, str(e), e.field)
        if cmd.gpu not in self.states:
            if key is not None:
                self._dlq(m, f"gpu: {cmd.gpu!r} does not match the message key {key!r}", "gpu")
            return
        if key is not None and key != cmd.gpu:
            return self._dlq(m, f"gpu: {cmd.gpu!r} does not match the message key {key!r}", "gpu")
        COMMANDS_IN.inc(kind=cmd.kind)
        ts_type, ts_ms = m.timestamp()
        age = max(0.0, time.time() - ts_ms / 1000.0) if ts_ms and ts_ms > 0 else 0.0
        self._apply(cmd.gpu, lm.Received(cmd, age_s=age), None)  # a child of the `process` span

    def _dlq(self, m: Message, reason: str, field_: str) -> None:
        DLQ.inc()
        self.log.warning("executor.dlq", reason=reason, field=field_, offset=m.offset(), partition=m.partition())
        assert self.producer is not None  # start() made it
        dead_letter(self.producer, self.k.dlq_topic, m, reason, field_, consumer="rose-executor")

    # ---- the machine -----------------------------------------------------------------------
    def _apply(self, gpu: str, inp: lm.Input, parent, quiet: bool = False) -> tuple[lm.Action, ...]:
        now = time.monotonic()
        before = self.states[gpu]
        after, actions = lm.step(before, inp, now, self.params)
        self.states[gpu] = after
        if quiet and not actions:
            return actions
        attrs: dict[str, AttributeValue] = {
            "rose.gpu": gpu,
            "rose.input": type(inp).__name__,
            "rose.epoch": after.highest_epoch,
            "rose.actions": ",".join(type(a).__name__ for a in actions),
        }
        if isinstance(inp, lm.Received):
            c = inp.command
            attrs.update(
                {
                    "rose.kind": c.kind,
                    "rose.command_id": c.command_id,
                    "rose.lease_id": c.lease_id,
                    "rose.command_epoch": c.epoch,
                    "rose.age_s": inp.age_s,
                }
            )
        with self._tracer.start_as_current_span("lease.apply", context=parent, attributes=attrs):
            self._act(actions)
        return actions

    def _act(self, actions) -> None:
        for a in actions:
            if isinstance(a, lm.Pause):
                self._signal_flag(a.gpu, "PAUSE")
            elif isinstance(a, lm.Resume):
                self._signal_flag(a.gpu, "RUN")
            elif isinstance(a, lm.Throttle):
                self._throttle(a)
            elif isinstance(a, lm.Stop):
                self._stop_worker(a.gpu)
            elif isinstance(a, lm.Kill):
                self._kill_worker(a.gpu)
            elif isinstance(a, lm.Start):
                self._start_worker(a)
            elif isinstance(a, lm.Publish):
                self._publish(a)

    def _publish(self, a: lm.Publish) -> None:
        h = self.workers.get(a.gpu)
        mem = measure_rollout_mem(h.proc.pid, self.device) if h is not None else 0
        ROLLOUT_MEM.set(mem, gpu=a.gpu)
        r = a.record
        ls = LeaseState(
            gpu=a.gpu,
            lease_id=r.lease_id,
            epoch=r.epoch,
            state=r.state,
            ts=time.time(),
            rollout_mem_bytes=mem,
            command_id=r.command_id,
        )
        topic, n = self.k.lease_state_topic, self._lease_partitions
        assert self.producer is not None  # start() made it
        with send_span(self._tracer, topic, key=a.gpu, partition=partition_for(a.gpu, n) if n else None):
            produce(self.producer, topic, encode(ls), a.gpu, inject_headers())
        self.producer.poll(0)
        TRANSITIONS.inc(state=r.state)
        self.published.append(ls)
        del self.published[:-1000]
        self.log.info(
            "lease.state",
            gpu=a.gpu,
            state=r.state,
            epoch=r.epoch,
            lease_id=r.lease_id,
            command_id=r.command_id,
            rollout_mem_bytes=mem,
        )

    # ---- workers ---------------------------------------------------------------------------
    def _start_worker(self, a: lm.Start) -> None:
        """Carry out `Start`: hand the lease to a ready warm worker of the pool when one fits,
        else start a worker for it (cold)."""
        from rose.rollout.pause_flag import PAUSE, RUN, PauseFlag

        self._flag_seq += 1
        name = f"rose-{os.getpid()}-{self._flag_seq}"
        self._seed += 1
        wc = None
        if self.cfg.executor.worker != "placeholder":
            wc = self.worker_config(self.cfg, a, name, self.device, self._seed)
            warm = next((w for w in self.pool if w.ready and w.config.can_run_as(wc)), None)
            if warm is not None:
                return self._assign_warm(warm, a, wc)
        flag = PauseFlag(name, create=True)
        flag.set(PAUSE if a.paused else RUN)
        flag.set_share(a.compute_share)
        if wc is None:
            proc = spawn(PLACEHOLDER_ARGV, stdin=subprocess.DEVNULL)
        else:
            proc = launch(wc, stdin=subprocess.DEVNULL)
        self.workers[a.gpu] = WorkerHandle(a.gpu, proc, flag, a.epoch)
        STARTS.inc(how="cold")
        self.log.info(
            "worker.started",
            gpu=a.gpu,
            pid=proc.pid,
            epoch=a.epoch,
            mem_bytes=a.mem_bytes,
            compute_share=a.compute_share,
            paused=a.paused,
            warm=False,
        )

    def _assign_warm(self, w: WarmWorker, a: lm.Start, wc: WorkerConfig) -> None:
        """The lease goes to warm worker `w`: its lease record first, then the flag's state and
        share, then the assignment counter that the worker polls (so it reads a complete record
        and starts in the lease's state)."""
        from rose.rollout.pause_flag import PAUSE, RUN

        self.pool.remove(w)
        flag = w.flag
        rec = LeaseRecord(
            assignment=(flag.assignment + 1) & 0xFFFFFFFF,
            gpu=wc.gpu,
            worker_id=wc.worker_id,
            lease_id=a.lease_id,
            epoch=a.epoch,
            mem_bytes=wc.mem_bytes,
            compute_share=wc.compute_share,
        )
        rec.write(w.config.lease_file)
        flag.set(PAUSE if a.paused else RUN)
        flag.set_share(a.compute_share)
        flag.assign()
        self.workers[a.gpu] = WorkerHandle(a.gpu, w.proc, flag, a.epoch, lease_file=w.config.lease_file, warm=True)
        STARTS.inc(how="warm")
        self._pool_hold = (flag, time.monotonic() + POOL_HOLD_S)
        self.log.info(
            "worker.started",
            gpu=a.gpu,
            pid=w.proc.pid,
            epoch=a.epoch,
            mem_bytes=a.mem_bytes,
            compute_share=a.compute_share,
            paused=a.paused,
            warm=True,
            warm_for_s=round((time.monotonic_ns() - w.started_ns) / 1e9, 3),
            weights_version=flag.version,
        )

    # ---- the warm pool ---------------------------------------------------------------------
    def _tend_pool(self) -> None:
        """Reap warm workers that exited, note those that became ready, and start a new one
        while the pool is short (it imports and builds on its own: the executor does not wait)."""
        now = time.monotonic()
        for w in list(self.pool):
            if w.proc.poll() is not None:
                if not w.ready_said:  # died on the way up: back off, a broken set-up must not spin
                    self._pool_failures += 1
                    delay = self.params.restart_backoff_s * 2 ** min(self._pool_failures - 1, 5)
                    self._pool_retry_at = now + min(30.0, delay)
                self._reap_warm(w)
            elif not w.ready_said and w.flag.ready_ns > 0:
                w.ready_said = True
                self._pool_failures = 0
                self.log.info(
                    "worker.warm_ready",
                    pid=w.proc.pid,
                    after_s=round((w.flag.ready_ns - w.started_ns) / 1e9, 3),
                    weights_version=w.flag.version,
                )
        if self._pool_hold is not None:
            flag, until = self._pool_hold
            try:
                if now >= until or flag.first_token_ns > 0:
                    self._pool_hold = None
            except TypeError:  # the lease's worker is gone already (its flag is closed)
                self._pool_hold = None
        if self._pool_on and len(self.pool) < self.pool_size and now >= self._pool_retry_at and not self._pool_hold:
            self._start_warm()
        ready = sum(w.ready_said for w in self.pool)
        WARM.set(ready, ready="yes")
        WARM.set(len(self.pool) - ready, ready="no")

    def _start_warm(self) -> None:
        from rose.rollout.pause_flag import PAUSE, PauseFlag

        self._flag_seq += 1
        name = f"rose-{os.getpid()}-{self._flag_seq}"
        self._seed += 1
        # the stock config of this executor's workers, less everything a lease decides
        template = lm.Start(gpu="", lease_id="", epoch=0, mem_bytes=0, compute_share=0.0, paused=True)
        wc = replace(
            self.worker_config(self.cfg, template, name, self.device, self._seed),
            gpu="",
            worker_id="",
            warm=True,
            lease_file=lease_file_for(name),
        )
        _unlink(wc.lease_file)
        flag = PauseFlag(name, create=True)
        flag.set(PAUSE)
        flag.set_share(0.0)
        try:
            proc = launch(wc, stdin=subprocess.DEVNULL)
        except OSError as e:
            flag.close()
            flag.unlink()
            self._pool_failures += 1
            self._pool_retry_at = time.monotonic() + min(30.0, self.params.restart_backoff_s * 2**self._pool_failures)
            self.log.warning("worker.warm_failed", error=str(e))
            return
        self.pool.append(WarmWorker(proc, flag, wc))
        self.log.info("worker.warming", pid=proc.pid, device=wc.device)

    def _stop_warm(self, w: WarmWorker) -> None:
        from rose.rollout.pause_flag import STOP

        w.flag.set(STOP)
        try:
            w.proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass

    def _reap_warm(self, w: WarmWorker) -> None:
        if w in self.pool:
            self.pool.remove(w)
        code = w.proc.wait()
        w.flag.close()
        w.flag.unlink()
        _unlink(w.config.lease_file)
        log = self.log.info if code == 0 or self._stopping else self.log.warning
        log("worker.warm_exited", pid=w.proc.pid, code=code, ready=w.ready_said)

    def _signal_flag(self, gpu: str, state: str) -> None:
        from rose.rollout import pause_flag

        h = self.workers.get(gpu)
        if h is not None:
            assert h.flag is not None  # a running worker's
            h.flag.set(getattr(pause_flag, state))

    def _throttle(self, a: lm.Throttle) -> None:
        """The lease's new compute share, in place: 0 pauses the worker at its next decode step;
        its process, weights, KV cache and in-flight episodes stay."""
        h = self.workers.get(a.gpu)
        if h is not None:
            assert h.flag is not None  # a running worker's
            h.flag.set_share(a.compute_share)
            self.log.info("worker.throttled", gpu=a.gpu, pid=h.proc.pid, compute_share=a.compute_share)

    def _guard_pause(self, gpu: str) -> None:
        """Called on the guard's thread the instant headroom collapses: no queue, no Kafka."""
        GUARD_TRIPS.inc()
        h = self.workers.get(gpu)
        if h is not None:
            try:
                from rose.rollout.pause_flag import PAUSE

                flag = h.flag
                if flag is not None:  # None: reaped this instant
                    flag.set(PAUSE)
            except (TypeError, ValueError, AttributeError):
                pass  # the worker is being reaped this instant; nothing left to pause

    def _stop_worker(self, gpu: str) -> None:
        from rose.rollout.pause_flag import STOP

        h = self.workers.get(gpu)
        if h is None:
            return
        assert h.flag is not None  # a running worker's
        h.flag.set(STOP)
        try:
            # a draining worker launches no more compute; at nice 19 on a busy host it would
            # take seconds to get the CPU it needs to hand its episodes back and exit
            os.setpriority(os.PRIO_PROCESS, h.proc.pid, 0)
        except (PermissionError, ProcessLookupError, OSError):
            pass  # lowering niceness needs CAP_SYS_NICE; draining still works, only slower
        try:
            h.proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass

    def _kill_worker(self, gpu: str) -> None:
        h = self.workers.get(gpu)
        if h is not None:
            KILLS.inc()
            self.log.warning("worker.killed", gpu=gpu, pid=h.proc.pid)
            h.proc.kill()

    def _reap(self, gpu: str) -> None:
        h = self.workers.pop(gpu)
        code = h.proc.wait()
        flag = h.flag
        assert flag is not None  # reaped once: it has left self.workers
        h.flag = None
        flag.close()
        flag.unlink()
        _unlink(h.lease_file)
        self.log.info("worker.exited", gpu=gpu, pid=h.proc.pid, code=code)
        self._apply(gpu, lm.WorkerExited(), None)
