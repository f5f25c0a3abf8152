"""`rose executor`: obey the lease command stream on one serving node and run rollout workers
inside the leases (the imperative shell around rose.executor.lease_machine).

The executor assigns itself the partitions of the commands topic that hold its GPUs' keys
(`rose.kafka.producer.partition_for`) rather than joining a consumer group, and reads them
read_committed. State is never trusted from memory: at start each GPU's highest epoch and last
word are rebuilt from the compacted lease-state topic. A command's TTL counts on this host's
monotonic clock from receipt, less its transit age. Workers get PR_SET_PDEATHSIG=SIGTERM, so
they drain and exit with their executor. Every command is a `process {topic}` span, each
transition a `lease.apply` span; malformed or badly signed commands go to the dead-letter topic.
A lease's worker process (start, stop, reap, its memory) is rose.executor.workers; the pool of
warm workers a `Start` may take instead, rose.executor.warm_pool; the partitions it reads and the
rebuild from them, rose.executor.partitions.
Why assignment rather than a group, and the rest in full: docs/executor.md.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from rose.config import Config
from rose.contract.events import Command, InvalidEvent, LeaseState
from rose.contract.signing import SIGNATURE_HEADER, verify
from rose.contract.wire import decode, encode
from rose.executor import lease_machine as lm
from rose.executor import replica_lease as rl
from rose.executor.guard import FileLatencySource, Guard, LatencySource
from rose.executor.memory_cap import MemoryWatchdog
from rose.executor.partitions import command_assignment, command_group, rebuilt_records
from rose.executor.replica_shell import ReplicaShell
from rose.executor.warm_pool import WarmPool, lease_file_for
from rose.executor.workers import (
    STARTS,
    WorkerHandle,
    log_started,
    measure_rollout_mem,
    reap_worker,
    refused_why,
    start_worker,
    stop_worker,
    worker_config,
)
from rose.kafka.admin import retrying
from rose.kafka.consumer import (
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    consume_batch,
    header,
    make_consumer,
)
from rose.kafka.producer import Producer, dead_letter, make_producer, partition_for, produce
from rose.kafka.transactional import bounded
from rose.obs import metrics
from rose.obs.logs import get_logger
from rose.obs.tracing import carried_traceparent, inject_headers, process_span, send_span, tracer
from rose.rollout.launcher import WorkerConfig
from rose.rollout.pause_flag import PAUSE, RUN
from rose.router.base import Router
from rose.shutdown import Shutdown

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.util.types import AttributeValue

_FLAG_NUMBERS = itertools.count(1)  # pause-flag names, unique in the process (see _next_flag_name)
SHUTDOWN_KAFKA_S = 1.5  # each Kafka call of a shutdown (flush, commit, close): with the revoke deadline + 1 s, within rose.shutdown's grace (8 s)
COMMANDS_IN = metrics.counter("rose_executor_commands_total", "Commands for this node's GPUs, by kind")
TRANSITIONS = metrics.counter("rose_executor_transitions_total", "Lease states published, by state")
DLQ = metrics.counter("rose_executor_dlq_total", "Commands sent to the dead-letter topic")
CLOCK_SKEW = metrics.counter(
    "rose_executor_clock_skew_total", "Commands stamped further ahead of this clock than executor.max_clock_skew_s"
)
GUARD_TRIPS = metrics.counter("rose_executor_guard_trips_total", "Local guard pauses")
KILLS = metrics.counter("rose_executor_worker_kills_total", "Workers killed at the revoke deadline")
WORKERS = metrics.gauge("rose_executor_workers", "Rollout workers alive")
ROLLOUT_MEM = metrics.gauge("rose_executor_rollout_mem_bytes", "Measured rollout memory, by gpu")


def simulated_gpus(n: int) -> list[str]:
    return [f"sim/{i}" for i in range(n)]


class Executor:
    """One node's executor. `start()`, then `run_once()` in a loop (or `run()`), `shutdown()`."""

    def __init__(
        self,
        cfg: Config,
        gpus: list[str],
        device: str = "cpu",
        latency_source: LatencySource | None = None,
        guard: bool = True,
        worker_config: Callable[[Config, lm.Start, str, str, int], WorkerConfig] = worker_config,
        log_name: str = "rose.executor",
        replicas: Mapping[str, str] | None = None,
        router: Router | None = None,
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
        self.workers: dict[str, WorkerHandle] = {}  # a gang's members share their one worker's handle
        self._exited: dict[str, int] = {}  # gpu -> pid of the worker reaped this instant, measured once more
        # gang leases: the members that said Start and each GPU's gang (lm.gang_start, lm.gang_stop);
        # and the inputs for other GPUs raised while an input is being applied
        self.gangs: lm.Gangs = lm.NO_GANGS
        self._deferred: list[tuple[str, lm.Input]] = []
        if cfg.executor.worker not in ("rollout", "placeholder"):
            raise ValueError(f"executor.worker: expected rollout or placeholder, got {cfg.executor.worker!r}")
        if cfg.executor.warm_workers < 0:
            raise ValueError(f"executor.warm_workers: expected >= 0, got {cfg.executor.warm_workers}")
        self.worker_config = worker_config  # (cfg, Start, flag name, device, seed) -> WorkerConfig
        self.log = get_logger(log_name, gpus=",".join(self.gpus) if len(self.gpus) <= 8 else f"{len(self.gpus)} GPUs")
        # the warm pool (shell state; the lease machine only says Start): filled from start()
        self.pool = WarmPool(
            cfg.executor.warm_workers if cfg.executor.worker == "rollout" else 0,
            self.params.restart_backoff_s,
            self._new_warm_worker,
            self.log,
        )
        # lease workers over their grant's memory are stopped and their lease revoked (CPU)
        self.mem_watch = MemoryWatchdog.from_config(cfg.executor, device, self.log)
        self._tracer = tracer("rose.executor")
        # per GPU, the lease id and W3C traceparent of the last grant command: a worker started
        # for that lease (now or on a restart) links its spans to the decision (WorkerConfig)
        self._grants: dict[str, tuple[str, str]] = {}
        self._hmac = cfg.security.command_hmac_key or None
        self._stopping = False
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
        # replica leases (CONTRACT §7): each GPU that is a serving replica, by its URL in the router
        self.replica = ReplicaShell(self, dict(replicas or {}), router)

    # ---- life cycle ------------------------------------------------------------------------
    def start(self) -> Executor:
        self.producer = make_producer(self.k)
        retrying(self._rebuild)
        self.replica.reconcile()
        self.consumer = make_consumer(self.k, self.group, **{"fetch.wait.max.ms": 10})
        retrying(self._assign)
        self.pool.start()
        self.mem_watch.start()
        if self.guard is not None:
            # the guard thread must get the interpreter within its poll period, not CPython's default 5 ms
            sys.setswitchinterval(min(sys.getswitchinterval(), self.cfg.executor.guard_period_s))
            self.guard.start()
        self.log.info("executor.ready", device=self.device, guard=self.guard is not None)
        return self

    def _rebuild(self) -> None:
        self._lease_partitions, records = rebuilt_records(self.k, self.states)
        for gpu, rec in records.items():
            self.states[gpu], actions = lm.restore(gpu, rec)
            self._act(actions)
        self.log.info("executor.rebuilt", gpus_with_history=len(records))

    def _assign(self) -> None:
        consumer = self.consumer
        assert consumer is not None  # start() made it
        consumer.assign(command_assignment(self.k, consumer, self.gpus, self.cfg.executor.lookback_s))

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
        for breach in self.mem_watch.poll():
            self._revoke_itself(breach.gpu)
        for gpu in self.gpus:
            self._apply(gpu, lm.Tick(), None, quiet=True)
        self.replica.tick()
        WORKERS.set(len(self.workers))
        if self.pool.on or self.pool.workers:
            self.pool.tend()
        if self.producer is not None:
            self.producer.poll(0)

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Revoke every lease (drain workers; kill at the deadline), publish the final states, flush.
        Each Kafka call is bounded (`SHUTDOWN_KAFKA_S`): after a broker restart librdkafka's
        commit and close can wedge on the group coordinator, and the process must still be
        gone within rose.shutdown's grace (a restarted executor rebuilds from the lease states)."""
        if self._stopping:
            return
        self._stopping = True
        self.log.info("executor.stopping")
        self.pool.stop_all()  # nothing to drain: STOP and SIGTERM end a warm worker at once
        for gpu in self.gpus:
            self._apply(gpu, lm.Shutdown(), None)
        self.replica.shutdown()
        deadline = time.monotonic() + (timeout_s or self.params.revoke_deadline_s + 1.0)
        while (self.workers or self.pool.workers) and time.monotonic() < deadline:
            self._housekeeping()
            time.sleep(self.cfg.executor.tick_s)
        for gpu in list(self.workers):  # the kernel did not deliver the kill in time: never leave one behind
            self.workers[gpu].proc.kill()
            self.workers[gpu].proc.wait(5)
            self._reap(gpu)
        self.pool.kill_all()
        if self.guard is not None:
            self.guard.stop()
        left = 0
        if self.producer is not None:
            left = self.producer.flush(SHUTDOWN_KAFKA_S)
        if self.consumer is not None:
            c, self.consumer = self.consumer, None
            for what, call in (("consumer.commit", lambda: c.commit(asynchronous=False)), ("consumer.close", c.close)):
                try:
                    bounded(what, call, SHUTDOWN_KAFKA_S, RuntimeError)
                except (KafkaException, RuntimeError) as e:  # nothing consumed yet, or the broker is away
                    self.log.warning("executor.stop_incomplete", call=what, error=str(e))
        self.log.info("executor.stopped", unsent=left)

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
        if cmd.kind == "grant":
            self._grants[cmd.gpu] = (cmd.lease_id, carried_traceparent(m.headers()))
        ts_type, ts_ms = m.timestamp()
        age = time.time() - ts_ms / 1000.0 if ts_ms and ts_ms > 0 else 0.0
        if -age > self.cfg.executor.max_clock_skew_s:  # transit only adds age: this clock is that far behind
            CLOCK_SKEW.inc()
            self.log.warning(
                "executor.clock_skew",
                gpu=cmd.gpu,
                ahead_s=round(-age, 3),
                max_clock_skew_s=self.cfg.executor.max_clock_skew_s,
            )
        received = lm.Received(cmd, age_s=max(0.0, age))
        if not self.replica.receive(received):  # a replica's GPU: its path hands it on when due
            self._apply(cmd.gpu, received, None)  # a child of the `process` span

    def _dlq(self, m: Message, reason: str, field_: str) -> None:
        DLQ.inc()
        self.log.warning("executor.dlq", reason=reason, field=field_, offset=m.offset(), partition=m.partition())
        assert self.producer is not None  # start() made it
        dead_letter(self.producer, self.k.dlq_topic, m, reason, field_, consumer="rose-executor")

    # ---- the machine -----------------------------------------------------------------------
    def _apply(
        self, gpu: str, inp: lm.Input, parent: Context | None, quiet: bool = False
    ) -> tuple[rl.ShellAction, ...]:
        now = time.monotonic()
        before = self.states[gpu]
        after, machine_actions = lm.step(before, inp, now, self.params)
        self.states[gpu] = after
        actions = self.replica.on_lease_actions(gpu, machine_actions, now)
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
        while self._deferred:  # a gang member's end, carried to the other members
            g, deferred = self._deferred.pop(0)
            self._apply(g, deferred, None)
        return actions

    def _act(self, actions: Iterable[rl.ShellAction]) -> None:
        for a in actions:
            if isinstance(a, lm.Pause):
                self._signal_flag(a.gpu, PAUSE)
            elif isinstance(a, lm.Resume):
                self._signal_flag(a.gpu, RUN)
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
            else:
                self.replica.act(a)

    def _publish(self, a: lm.Publish) -> None:
        """Publish a lease state with the memory its worker holds, read now: a terminal state, published
        just after the worker was reaped, re-reads the exited worker's pid (0 because it is gone)."""
        h = self.workers.get(a.gpu)
        pid = h.proc.pid if h is not None else self._exited.get(a.gpu)
        mem = measure_rollout_mem(pid, self.device) if pid is not None else 0
        ROLLOUT_MEM.set(mem, gpu=a.gpu)
        r, ls = a.record, a.state(time.time(), mem)
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
            measured_pid=pid,
        )

    # ---- workers ---------------------------------------------------------------------------
    def _next_flag_name(self) -> tuple[str, int]:
        """A new worker's pause flag name and seed. The name's number counts in the process, not
        in the executor: an executor that died without unlinking its flags (killed, or an earlier
        one in the same process) must not leave a name the next one would take."""
        self._seed += 1
        return f"rose-{os.getpid()}-{next(_FLAG_NUMBERS)}", self._seed

    def _start_worker(self, a: lm.Start) -> None:
        """Carry out `Start`. A gang member's waits until every member of its group has said
        Start; then one worker, on the first member's GPU, holds the whole group's memory at
        the smallest share (on CPU one process stands for the tensor-parallel group)."""
        if a.group_size <= 1:
            self._start_one(a)
            return
        self.gangs, lead, members = lm.gang_start(self.gangs, a)
        if lead is None:
            self.log.info("gang.waiting", gpu=a.gpu, group_id=a.group_id, members=len(members), of=a.group_size)
            return
        self._start_one(lead)
        for g in members[1:]:
            self.workers[g] = self.workers[lead.gpu]
        self.log.info("gang.started", group_id=a.group_id, gpus=",".join(members), pid=self.workers[lead.gpu].proc.pid)

    def _start_one(self, a: lm.Start) -> None:
        """Carry out `Start` for one worker: hand the lease to a ready warm worker of the pool when one fits,
        else start a worker for it (cold)."""
        name, seed = self._next_flag_name()
        wc = None
        if self.cfg.executor.worker != "placeholder":
            wc = self._with_lease(self.worker_config(self.cfg, a, name, self.device, seed), a)
            warm = self.pool.ready_for(wc)
            if warm is not None:
                h = self.workers[a.gpu] = self.pool.hand_lease(warm, a, wc)
                self.mem_watch.watch(a.gpu, h.proc, a.mem_bytes)
                self.replica.lent_to(a.gpu, h.proc.pid)
                return
        h = self.workers[a.gpu] = start_worker(a, name, wc)
        self.mem_watch.watch(a.gpu, h.proc, a.mem_bytes)
        STARTS.inc(how="cold")
        log_started(self.log, a, h.proc.pid, warm=False)
        self.replica.lent_to(a.gpu, h.proc.pid)

    def _with_lease(self, wc: WorkerConfig, a: lm.Start) -> WorkerConfig:
        """`wc` told its lease: the id, and the grant command's trace context when it is known."""
        lease_id, tp = self._grants.get(a.gpu, ("", ""))
        return replace(wc, lease_id=a.lease_id, lease_traceparent=tp if lease_id == a.lease_id else "")

    def _new_warm_worker(self) -> tuple[str, WorkerConfig]:
        """A warm worker's pause flag name and config: the stock config of this executor's
        workers, less everything a lease decides."""
        name, seed = self._next_flag_name()
        template = lm.Start(gpu="", lease_id="", epoch=0, mem_bytes=0, compute_share=0.0, paused=True)
        wc = replace(
            self.worker_config(self.cfg, template, name, self.device, seed),
            gpu="",
            worker_id="",
            warm=True,
            lease_file=lease_file_for(name),
        )
        return name, wc

    def _signal_flag(self, gpu: str, state: int) -> None:
        h = self.workers.get(gpu)
        if h is not None and h.flag is not None:  # None: a gang's worker another member reaped
            h.flag.set(state)

    def _throttle(self, a: lm.Throttle) -> None:
        """The lease's new compute share, in place: 0 pauses the worker at its next decode step;
        its process, weights, KV cache and in-flight episodes stay."""
        h = self.workers.get(a.gpu)
        if h is not None and h.flag is not None:  # None: a gang's worker another member reaped
            h.flag.set_share(a.compute_share)
            self.log.info("worker.throttled", gpu=a.gpu, pid=h.proc.pid, compute_share=a.compute_share)

    def _guard_pause(self, gpu: str) -> None:
        """Called on the guard's thread the instant headroom collapses: no queue, no Kafka."""
        GUARD_TRIPS.inc()
        h = self.workers.get(gpu)
        if h is not None:
            try:
                flag = h.flag
                if flag is not None:  # None: reaped this instant
                    flag.set(PAUSE)
            except (TypeError, ValueError, AttributeError):
                pass  # the worker is being reaped this instant; nothing left to pause

    def _stop_worker(self, gpu: str) -> None:
        h = self.workers.get(gpu)
        if h is not None and h.flag is not None:
            stop_worker(h, self.log)
        # any member's end ends the gang: its one worker goes, so every member's lease does
        self.gangs, carry = lm.gang_stop(self.gangs, gpu)
        self._deferred.extend(carry)

    def _kill_worker(self, gpu: str) -> None:
        h = self.workers.get(gpu)
        if h is not None:
            KILLS.inc()
            self.log.warning("worker.killed", gpu=gpu, pid=h.proc.pid)
            h.proc.kill()

    def _revoke_itself(self, gpu: str) -> None:
        """End `gpu`'s lease from this side (its worker went over its memory cap): as at
        shutdown, the machine pauses and stops the worker, publishes `revoking`, and `revoked`
        once the worker is gone."""
        self._apply(gpu, lm.Shutdown(), None)

    def _reap(self, gpu: str) -> None:
        if self.mem_watch.unwatch(gpu) is not None:  # the kernel ended it at its cgroup's memory.max
            self._revoke_itself(gpu)
        h = self.workers.pop(gpu)
        code = reap_worker(h) if h.flag is not None else h.proc.returncode  # a gang's: reaped once
        self.log.info("worker.exited", gpu=gpu, pid=h.proc.pid, code=code)
        self._exited[gpu] = h.proc.pid  # only for the states this exit publishes: a pid is reused later
        try:
            self._apply(gpu, lm.WorkerExited(refused_why(code)), None)
        finally:
            del self._exited[gpu]
