"""`rose scheduler`: the stateless elastic lease scheduler.

Consume telemetry → decide (rose.policy.core, the fold around the pure decide()) → produce
commands, inside ONE Kafka transaction together with the consumed offsets and the scheduler's
view changelog (`<prefix>scheduler-state`). rose.kafka.transactional's `Transactor` runs the
transactions; this module decodes, decides and emits. A crash anywhere aborts the open
transaction, and whoever owns the partition next resumes from the committed offsets with the
view as of that commit: exactly once from telemetry to commands.

The per-GPU views are a cache, rebuilt on every partition assignment from `scheduler-state` and
the executors' `lease-state`, which the scheduler also keeps folding in between rebuilds. Why
both, why the fold matters after a fault, rebalances and zombies: docs/scheduler.md.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

from rose.config import Config
from rose.contract.events import Command, InvalidEvent, LeaseState, Telemetry
from rose.contract.signing import sign_headers
from rose.contract.wire import decode, encode
from rose.kafka.admin import partitions_of, retrying
from rose.kafka.consumer import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
    answered_rebalance,
    consume_batch,
    make_consumer,
    read_partitions,
    rewind,
)
from rose.kafka.producer import Producer, dead_letter, make_producer, partition_for, produce
from rose.kafka.transactional import FatalTransactionError, GroupMembershipLost, Transactor, bounded
from rose.obs import metrics
from rose.obs.logs import get_logger
from rose.obs.tracing import (
    SpanPlan,
    can_plan_spans,
    ensure_provider,
    tracer,
    unsampled_headers,
)
from rose.policy.core import Applied, Arrival, Batch, SchedulingCore
from rose.policy.lease_policy import Decision, GpuView
from rose.policy.pool_records import PoolIntent
from rose.scheduler.decision_log import decision_attrs, log_decision, log_nth
from rose.scheduler.pool_intents import IntentReader, intent_partitions, produce_samples
from rose.scheduler.pool_service import PoolStage

SCHEDULER_GROUP = "rose-scheduler"  # the consumer group id of every scheduler instance, after the topic prefix

EVENTS_IN = metrics.counter("rose_scheduler_events_total", "Telemetry messages consumed")
COMMANDS_OUT = metrics.counter("rose_scheduler_commands_total", "Commands committed, by kind")
DLQ = metrics.counter("rose_scheduler_dlq_total", "Messages sent to the dead-letter topic")
IGNORED = metrics.counter("rose_scheduler_ignored_total", "Duplicate or out-of-order telemetry ignored")
# fault injection, for the fault suite only: freeze inside the N-th transaction (`_freeze_fault`)
FREEZE_FAULT_ENV = "ROSE_TEST_FREEZE_IN_TRANSACTION"
ABORTS = metrics.counter("rose_scheduler_aborted_transactions_total", "Transactions aborted and retried")
LATENCY = metrics.histogram(
    "rose_scheduler_decision_latency_seconds", "Telemetry produced (record timestamp) to command committed"
)
LEASES = metrics.gauge("rose_scheduler_leases", "GPUs holding a lease in the view")
VIEWS = metrics.gauge("rose_scheduler_gpus", "GPUs in the view (assigned partitions)")
LAG = metrics.gauge("rose_scheduler_lag_messages", "Consumer lag over assigned telemetry partitions")


class FatalSchedulerError(FatalTransactionError):
    """The producer was fenced or hit a fatal error, or a coordinator call wedged: this
    instance's clients must be replaced."""


@dataclass
class SchedulerStats:
    events: int = 0
    commands: int = 0
    dlq: int = 0
    transactions: int = 0
    aborts: int = 0
    latencies_s: list[float] = field(default_factory=list)
    # with record_latencies, per command: its decision latency split at the batch's consume and
    # the end of its processing: (until consumed, processing, transaction commit), seconds
    latency_parts_s: list[tuple[float, float, float]] = field(default_factory=list)
    traced_commands: int = 0  # commands emitted with their spans and log line, and the time that took
    traced_s: float = 0.0


@dataclass(frozen=True)
class _Batch:
    """A consumed batch, decided: per message its telemetry or why it goes to the dlq, and the
    core's held step over the telemetry (decisions in message order, the views it changed)."""

    msgs: list[Message]
    parsed: list[Telemetry | InvalidEvent]
    applied: Applied
    intents: list[Message] = field(default_factory=list)  # pool-intents records applied before the telemetry


@dataclass
class _Tally:
    """What one transaction attempt produced, counted into the metrics and stats only once it
    has committed: an aborted attempt is redone, and counting it would count its records twice."""

    commands: Counter[str] = field(default_factory=Counter)  # by kind
    dlq: int = 0
    ignored: int = 0
    traced_commands: int = 0
    logged: list[Command] = field(default_factory=list)  # untraced commands logged once committed


class Scheduler:
    """One scheduler instance. `run()` until stop(); `step()` processes one batch."""

    def __init__(
        self,
        cfg: Config,
        instance: str = "0",
        group: str = SCHEDULER_GROUP,
        batch_max: int = 5000,
        record_latencies: bool = False,
        init_timeout_s: float = 30,
        batch_linger_s: float = 0.0,
    ):
        self.cfg = cfg
        self.k = cfg.kafka
        self.instance = instance
        self.batch_max = batch_max
        # extra wait for a fuller batch once a message is there (fewer transactions, each a few
        # broker round trips). 0 by default: under load the previous batch's processing time
        # already gathers the next one, and a wait would only delay revokes when it is quiet
        self.batch_linger_s = batch_linger_s
        self.state_topic = self.k.topic("scheduler-state")
        # the views and lease floor of the GPUs this instance owns; the pools that lend replicas
        self.core = SchedulingCore(cfg.policy, pools=cfg.policy.pools)
        self.gpu_partition: dict[str, int] = {}
        self.stats = SchedulerStats()
        self.record_latencies = record_latencies
        self.log = get_logger("rose.scheduler", instance=instance)
        ensure_provider()  # commands always carry trace context, exported or not
        self._tracer = tracer("rose.scheduler")
        self._renew_every = max(1, cfg.tracing.renew_sample_every)
        assert can_plan_spans(self._tracer)  # spans recorded after the commit (SpanPlan)
        self._running = True
        self._hold = False  # join_paused: partitions assigned meanwhile start paused
        self._hmac_key = cfg.security.command_hmac_key.encode() if cfg.security.command_hmac_key else None
        self.producer: Producer = make_producer(
            self.k,
            **{
                "transactional.id": f"{self.k.topic_prefix}scheduler-{instance}",
                "transaction.timeout.ms": 10000,
                "linger.ms": 1,
            },
        )
        self.consumer: Consumer = make_consumer(
            self.k,
            f"{self.k.topic_prefix}{group}",
            **{
                "partition.assignment.strategy": "cooperative-sticky",
                "fetch.wait.max.ms": 5,
                "session.timeout.ms": 10000,
                "heartbeat.interval.ms": 250,
                # static membership: a restarted instance gets its partitions back at once,
                # without waiting out the session timeout of its killed predecessor
                "group.instance.id": f"{self.k.topic_prefix}scheduler-{instance}",
            },
        )
        self.lease_consumer: Consumer = make_consumer(
            self.k, f"{self.k.topic_prefix}{group}-lease-state-{instance}", **{"fetch.wait.max.ms": 50}
        )
        self.group = f"{self.k.topic_prefix}{group}"
        self._command_partitions: int | None = None  # known after start(); names the partition on spans
        self._tally = _Tally()  # the open transaction attempt's records (`_Tally`)
        freeze = os.environ.get(FREEZE_FAULT_ENV)
        self._freeze_at: int | None = int(freeze) if freeze else None  # `_freeze_fault`
        self.tx = Transactor(self.producer, self.consumer, self.log, fatal=FatalSchedulerError)
        # with pools that lend replicas: their intents beside the telemetry, and the pool stage
        self.intents = IntentReader(self.k, group, instance, self.log) if cfg.policy.pools else None
        self.pools: PoolStage | None = None
        try:
            self.tx.init(init_timeout_s)
            if cfg.policy.pools:
                self.pools = PoolStage(cfg, instance, group, self.log, FatalSchedulerError, init_timeout_s)
        except FatalSchedulerError:  # e.g. the broker is still coming back: the caller retries
            for c in (self.consumer, self.lease_consumer, *([self.intents.consumer] if self.intents else [])):
                c.close()
            raise

    # ---- state rebuild -----------------------------------------------------------------
    def _on_assign(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        ps = [tp.partition for tp in parts]
        self.log.info("partitions.assigned", partitions=ps)
        with answered_rebalance(consumer, parts, assign=True) as answer:
            if ps:  # a cooperative rebalance hands members that only keep their partitions an empty list
                # the committed offsets first: a read_committed fetch waits while the last owner's
                # transaction holding offsets for these partitions is open (KIP-447), so the changelog
                # read after it holds that transaction's views whenever the offsets skip its telemetry
                answer.parts = retrying(lambda: consumer.committed(parts, timeout=10))
                retrying(lambda: self._rebuild(ps))
                if self.intents is not None:
                    self.intents.assign(consumer, ps)
        if self._hold and parts:
            consumer.pause(parts)  # before a fetch starts: nothing is consumed until join_paused ends

    def _on_revoke(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        ps = {tp.partition for tp in parts}
        self.log.info("partitions.revoked", partitions=sorted(ps))
        with answered_rebalance(consumer, parts, assign=False):
            gone = [g for g, p in self.gpu_partition.items() if p in ps]
            for gpu in gone:
                self.gpu_partition.pop(gpu, None)
            self.core.apply(Batch(forget=gone))
            if self.intents is not None:
                self.intents.unassign(sorted(ps))

    def _rebuild(self, partitions: list[int]) -> None:
        """Views for these telemetry partitions from the committed changelog, then the
        executors' lease states folded in (SchedulingCore.restore over this instance's views)."""
        views = []
        for m in read_partitions(self.k, [(self.state_topic, p) for p in partitions]):
            value, partition = m.value(), m.partition()
            if value is None:
                continue
            assert partition is not None  # read_partitions gives messages, not errors
            v = GpuView.from_dict(orjson.loads(value))
            views.append(v)
            self.gpu_partition[v.gpu] = partition
        lease_states = []
        lease_parts = [(self.k.lease_state_topic, p) for p in partitions_of(self.k, self.k.lease_state_topic)]
        for m in read_partitions(self.k, lease_parts):
            try:
                lease_states.append(decode(m.value(), LeaseState))
            except InvalidEvent:
                continue
        self.core.restore(views, lease_states)
        VIEWS.set(len(self.core.views))

    # ---- the loop ----------------------------------------------------------------------
    def _fold_lease_states(self) -> None:
        """Fold newly published lease states into the owned views (see module docstring)."""
        states = []
        for m in self.lease_consumer.consume(1000, timeout=0):
            if m.error() or m.value() is None:
                continue
            try:
                states.append(decode(m.value(), LeaseState))
            except InvalidEvent:
                continue
        if not states:
            return
        views = self.core.views
        for ls, (before, after) in zip(states, self.core.apply(Batch(lease_states=states)).folded, strict=True):
            if ls.gpu in views and after != before:  # an owned GPU's view changed
                self.log.info(
                    "lease.observed",
                    gpu=ls.gpu,
                    lease_id=ls.lease_id,
                    state=ls.state,
                    epoch=ls.epoch,
                    view_lease=after.lease_id,
                )

    def start(self) -> None:
        parts = retrying(lambda: partitions_of(self.k, self.k.lease_state_topic))
        self._command_partitions = len(retrying(lambda: partitions_of(self.k, self.k.commands_topic)))
        for topic in (self.k.commands_topic, self.state_topic):  # the first decisions need not wait for it
            retrying(functools.partial(self.producer.list_topics, topic, timeout=10))
        self.lease_consumer.assign([TopicPartition(self.k.lease_state_topic, p, OFFSET_BEGINNING) for p in parts])
        if self.pools is not None:  # its configuration checks come before this instance joins a group
            self.pools.start()
        self.consumer.subscribe(
            [self.k.telemetry_topic], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_revoke
        )

    def join_paused(self, until: Callable[[bool], bool], timeout_s: float = 240.0) -> float | None:
        """Join the group holding every partition it is given paused (from its assignment on,
        before any fetch), until `until(held)` is true (`held`: it holds partitions now). Then
        resume. For N instances that start together on a
        backlog: the first to join would otherwise decide it alone. Returns the wall time it
        first held partitions (None: never)."""
        joined = None
        deadline = time.monotonic() + timeout_s
        self._hold = True
        try:
            while time.monotonic() < deadline:
                early = self.consumer.consume(100, timeout=0.1)  # serves the group protocol
                rewind(self.consumer, early)  # none, unless fetched before a pause took hold
                held = bool(self.consumer.assignment())
                if held and joined is None:
                    joined = time.time()
                if until(held):
                    break
        finally:
            self._hold = False
            self.consumer.resume(self.consumer.assignment())
        return joined

    def stop(self, *_args: object) -> None:
        self._running = False

    def run(self, max_seconds: float | None = None) -> SchedulerStats:
        self.start()
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        last_lag = 0.0
        try:
            while self._running and (deadline is None or time.monotonic() < deadline):
                self.step()
                if time.monotonic() - last_lag > 5:
                    last_lag = time.monotonic()
                    self._update_lag()
        finally:
            self.close()
        return self.stats

    def step(self, timeout: float = 0.05) -> int:
        """One batch of telemetry (and of pool intents, with pools), then one of the pool stage."""
        self._fold_lease_states()
        msgs = consume_batch(self.consumer, self.batch_max, timeout, linger=self.batch_linger_s)
        if self.pools is not None:
            self.pools.step()
        intent_msgs, intents = self.intents.take() if self.intents is not None else ([], [])
        if not msgs and not intent_msgs:
            return 0
        good = []
        for m in msgs:
            err = m.error()
            if err is None:
                good.append(m)
            elif err.code() != KafkaError._PARTITION_EOF:
                if err.fatal() or err.code() == KafkaError._FATAL:  # a consumer that can do nothing more
                    raise FatalSchedulerError(str(err))
                self.log.warning("consume.error", error=str(err))
        if good or intent_msgs:
            try:
                self._transact(good, consumed_at=time.time(), intents=(intent_msgs, intents))
            except GroupMembershipLost as e:
                # the next poll rejoins the group; the batch comes again from the committed offsets
                self.log.warning("group.rejoin", error=str(e), events=len(good))
                if self.intents is not None:
                    self.intents.rewind(intent_msgs)
                return 0
        return len(good)

    def _freeze_fault(self) -> None:
        """Fault injection for the zombie fault test (FREEZE_FAULT_ENV=N, off by default): in
        the N-th transaction that produced a command, flush its records to the broker, log
        `fault.frozen_in_transaction` and stop this process (SIGSTOP), so that it is frozen for
        certain with its transaction open. A SIGCONT wakes it into the commit, as a zombie."""
        if self._freeze_at is None or not self._tally.commands:
            return
        self._freeze_at -= 1
        if self._freeze_at > 0:
            return
        self._freeze_at = None
        self.producer.flush(10)
        self.log.warning("fault.frozen_in_transaction", commands=sum(self._tally.commands.values()))
        os.kill(os.getpid(), signal.SIGSTOP)

    def _transact(
        self, msgs: list[Message], consumed_at: float, intents: tuple[list[Message], list[PoolIntent]] = ([], [])
    ) -> None:
        """Reconcile one batch: decide it (`_decide`: pure over an overlay of the views), have
        the transactor produce its commands, dlq records and changed views with its offsets in
        one transaction (rose.kafka.transactional; an aborted attempt is redone from the same
        decisions), keep its views once committed, then record the spans and log lines of its
        traced commands (`SpanPlan`)."""
        batch = self._decide(msgs, *intents)
        plans: list[tuple[SpanPlan, list[Command]]] = []
        processed_at = consumed_at

        def process() -> list[int]:
            nonlocal processed_at
            self._tally = _Tally()
            out = self._produce(batch, plans)
            processed_at = time.time()
            self._freeze_fault()
            return out

        def aborted() -> None:
            self.stats.aborts += 1
            ABORTS.inc()
            plans.clear()

        pending_latency = self.tx.run(msgs + batch.intents, process, aborted)
        self._count(self._tally)
        self.core.apply(Batch(committed=batch.applied.views))
        views = self.core.views
        LEASES.set(sum(1 for v in views.values() if v.lease_id is not None))
        VIEWS.set(len(views))
        now = time.time()
        for ts_ms in pending_latency:
            lat = max(0.0, now - ts_ms / 1000.0)
            LATENCY.observe(lat)
            if self.record_latencies:
                self.stats.latencies_s.append(lat)
                self.stats.latency_parts_s.append(
                    (max(0.0, consumed_at - ts_ms / 1000.0), processed_at - consumed_at, now - processed_at)
                )
        self.stats.transactions += 1
        t_record = time.perf_counter()
        for plan, traced in plans:
            plan.record(self._tracer, self.group, functools.partial(log_nth, self.log, traced))
        self.stats.traced_s += time.perf_counter() - t_record

    def _count(self, t: _Tally) -> None:
        """Count a committed transaction's records (`_Tally`)."""
        for kind, n in t.commands.items():
            self.stats.commands += n
            COMMANDS_OUT.inc(n, kind=kind)
        self.stats.dlq += t.dlq
        DLQ.inc(t.dlq)
        IGNORED.inc(t.ignored)
        self.stats.traced_commands += t.traced_commands
        for cmd in t.logged:
            log_decision(self.log, cmd)

    def _decide(self, msgs: list[Message], intent_msgs: list[Message], intents: list[PoolIntent]) -> _Batch:
        """Decode every message, and apply the intents and admit and decide the telemetry in one
        held core step (`Batch.hold`): nothing here is produced, and no view is kept yet."""
        self.stats.events += len(msgs)
        EVENTS_IN.inc(len(msgs))
        decoded: list[Arrival | InvalidEvent] = []
        for m in msgs:
            try:
                decoded.append(Arrival(decode(m.value(), Telemetry), m.timestamp()[1], m.key()))
            except InvalidEvent as e:
                decoded.append(e)
        arrivals = [a for a in decoded if type(a) is Arrival]
        applied = self.core.apply(Batch(intents=intents, telemetry=arrivals, hold=True))
        admitted = iter(applied.admitted)
        parsed = [e if isinstance(e, InvalidEvent) else next(admitted) for e in decoded]
        return _Batch(msgs, parsed, applied, intent_msgs)

    def _produce(self, batch: _Batch, plans: list[tuple[SpanPlan, list[Command]]]) -> list[int]:
        """Produce a decided batch into the open transaction: per message its dlq record or its
        commands (planning the spans of traced ones into `plans`), then the views it changed.
        Returns record timestamps of commands."""
        dirty: dict[str, int] = {}
        latency_ts: list[int] = []
        gpu_partition = self.gpu_partition
        time_ns = time.time_ns
        traced_of = self._traced
        decisions = iter(batch.applied.decisions)
        tally = self._tally
        for gpu, p in intent_partitions(batch.intents, batch.applied.views).items():  # views an intent changed
            dirty[gpu] = gpu_partition.setdefault(gpu, p)
        for cmd in batch.applied.intent_commands:
            self._produce_command(cmd, encode(cmd), [])
            tally.logged.append(cmd)
        if batch.applied.samples:
            produce_samples(self.producer, self.k.pool_samples_topic, batch.applied.samples)
        for m, ev in zip(batch.msgs, batch.parsed, strict=True):
            t0 = time_ns()
            if isinstance(ev, InvalidEvent):
                dead_letter(self.producer, self.k.dlq_topic, m, ev.reason, ev.field, consumer="scheduler")
                tally.dlq += 1
                continue
            d = next(decisions)
            partition = m.partition()
            assert partition is not None  # step() passes messages, not errors
            gpu_partition[ev.gpu] = dirty[ev.gpu] = partition
            for other in d.others:  # a gang's members: their views go where their telemetry goes
                dirty[other.gpu] = gpu_partition.get(other.gpu, partition)
            if d.explain.action == "ignored":
                # kept, not dropped: the dlq shows which producer repeats or reorders events
                tally.ignored += 1
                dead_letter(self.producer, self.k.dlq_topic, m, d.explain.reason, "event_id", consumer="scheduler")
                tally.dlq += 1
            if not d.commands:
                continue
            flags = [traced_of(c) for c in d.commands]
            traced = [c for c, f in zip(d.commands, flags, strict=True) if f]
            if not traced:
                for cmd in d.commands:
                    self._emit(cmd, d, m, None)
            else:  # ids now, spans after the commit
                t_traced = time.perf_counter()
                plan = SpanPlan(m, t0)
                for cmd, f in zip(d.commands, flags, strict=True):
                    self._emit(cmd, d, m, plan if f else None)
                plan.end_ns = time_ns()
                plans.append((plan, traced))
                self.stats.traced_s += time.perf_counter() - t_traced
            tally.traced_commands += len(traced)
            ts_ms = m.timestamp()[1]
            latency_ts.extend(ts_ms for _ in d.commands)
        views = batch.applied.views
        for gpu, p in dirty.items():
            produce(self.producer, self.state_topic, orjson.dumps(views[gpu].to_dict()), gpu, partition=p)
        return latency_ts

    def _traced(self, cmd: Command) -> bool:
        """Whether a command gets its spans and log line: every grant, throttle and revoke,
        one renew in `tracing.renew_sample_every`, the same ones on every run (by command id)."""
        return cmd.kind != "renew" or int(cmd.command_id[:8], 16) % self._renew_every == 0

    def _emit(self, cmd: Command, d: Decision, cause: Message, plan: SpanPlan | None) -> None:
        """Produce one command. A traced one (`_traced`, decided once by the caller: given its
        event's `plan`) carries the context of a `send` span planned under a `lease.decide` span
        that holds the decision's why, both recorded after the commit. A sampled-out renew
        carries a not-sampled `traceparent` in the event's trace instead."""
        value = encode(cmd)
        if plan is None:
            self._produce_command(cmd, value, unsampled_headers(cause.headers()))
            return
        topic, n = self.k.commands_topic, self._command_partitions
        partition = partition_for(cmd.gpu, n) if n else None
        self._produce_command(cmd, value, plan.child("lease.decide", decision_attrs(cmd, d), topic, cmd.gpu, partition))

    def _produce_command(self, cmd: Command, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        if self._hmac_key:
            headers += sign_headers(self._hmac_key, value)
        produce(self.producer, self.k.commands_topic, value, cmd.gpu, headers)
        self._tally.commands[cmd.kind] += 1

    def _update_lag(self) -> None:
        try:
            assigned = self.consumer.assignment()
            if not assigned:
                LAG.set(0)
                return
            lag = 0
            for tp in self.consumer.position(assigned):
                _, hi = self.consumer.get_watermark_offsets(tp, timeout=1, cached=True)
                if tp.offset >= 0 and hi >= 0:
                    lag += max(0, hi - tp.offset)
            LAG.set(lag)
        except KafkaException:
            pass

    def close(self) -> None:
        extra = [c.consumer for c in (self.intents, self.pools) if c is not None]
        for c in (self.consumer, self.lease_consumer, *extra):
            try:
                bounded("consumer.close", c.close, 5, FatalSchedulerError)
            except (KafkaException, RuntimeError):
                pass
        for p in (self.producer, *([self.pools.producer] if self.pools else [])):
            p.flush(5)
