"""The scheduler's pool stage (docs/scheduler.md "Pool decisions and partitioning", step 2): a
second consumer group, `<group>-pools`, in the same process, consumes `<prefix>pool-samples`
(key = pool: the owner of a pool is whoever holds its partition), folds and decides each sample
with `rose.policy.pool_stage`, and writes the intents to `<prefix>pool-intents` (key = gpu, on
the GPU's telemetry partition) in one transaction with its pool-samples offsets, under its own
`transactional.id`.

Its state, each pool's window of samples and its intents not yet taken up, is a cache: on
assignment the owner seeks both topics to the time that bounds the window before the committed
offset (`offsets_for_times`) and folds them without deciding (`takeover`), then decides from the
committed offset on, as the owner before it would have.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rose.config import Config, ConfigError, PoolConfig
from rose.contract.events import InvalidEvent
from rose.kafka.admin import partitions_of, retrying
from rose.kafka.consumer import (
    Consumer,
    Message,
    TopicPartition,
    answered_rebalance,
    consume_batch,
    make_consumer,
    read_partitions,
)
from rose.kafka.producer import Producer, dead_letter, make_producer, partition_for, produce
from rose.kafka.transactional import GroupMembershipLost, Transactor
from rose.obs import metrics
from rose.policy.pool_records import PoolIntent, PoolSample
from rose.policy.pool_stage import PoolState, decide_sample, run_stage

SAMPLES_IN = metrics.counter("rose_scheduler_pool_samples_total", "Pool samples consumed by the pool stage")
INTENTS_OUT = metrics.counter("rose_scheduler_pool_intents_total", "Pool intents committed, by action")


class PoolStage:
    """One instance's pool stage. `start()`, then `step()` in the scheduler's loop; `close()`."""

    def __init__(self, cfg: Config, instance: str, group: str, log: Any, fatal: type[Exception], init_timeout_s: float):
        k = self.k = cfg.kafka
        self.pools: Mapping[str, PoolConfig] = cfg.policy.pools
        self.max_ts_skew_s = cfg.policy.max_ts_skew_s
        self.log = log
        self.states: dict[str, PoolState] = {}
        self.pool_partition: dict[str, int] = {}  # the pool-samples partition each known pool came from
        self._telemetry_partitions = 0  # known after start(): an intent goes to its GPU's telemetry partition
        self.producer: Producer = make_producer(
            k, **{"transactional.id": f"{k.topic_prefix}scheduler-pools-{instance}", "transaction.timeout.ms": 10000}
        )
        self.consumer: Consumer = make_consumer(
            k,
            f"{k.topic_prefix}{group}-pools",
            **{
                "partition.assignment.strategy": "cooperative-sticky",
                "fetch.wait.max.ms": 5,
                "session.timeout.ms": 10000,
                "heartbeat.interval.ms": 250,
                "group.instance.id": f"{k.topic_prefix}scheduler-pools-{instance}",
            },
        )
        self.tx = Transactor(self.producer, self.consumer, log, fatal=fatal)
        try:
            self.tx.init(init_timeout_s)
        except fatal:
            self.consumer.close()
            raise

    def start(self) -> None:
        """Check that intents can land on their GPU's telemetry partition, then join the group."""
        n = len(retrying(lambda: partitions_of(self.k, self.k.telemetry_topic)))
        m = len(retrying(lambda: partitions_of(self.k, self.k.pool_intents_topic)))
        if m != n:
            raise ConfigError(
                f"policy.pools: topic {self.k.pool_intents_topic} has {m} partitions and {self.k.telemetry_topic} "
                f"{n}; recreate pool-intents with the telemetry topic's partition count"
            )
        self._telemetry_partitions = n
        for name, c in self.pools.items():
            if not c.replica_capacity_rps:
                self.log.warning(
                    "pool.capacity_estimated",
                    setting=f"policy.pools.{name}.replica_capacity_rps",
                    fix="set it to the rps one replica serves within its SLO (a load test's figure): until a "
                    "serving replica shows the grant headroom, the capacity is estimated from none and nothing is lent",
                )
        self.consumer.subscribe(
            [self.k.pool_samples_topic], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_revoke
        )

    # ---- takeover ----------------------------------------------------------------------
    def _on_assign(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        with answered_rebalance(consumer, parts, assign=True) as answer:
            if parts:
                answer.parts = retrying(lambda: consumer.committed(parts, timeout=10))  # waits out an open transaction
                for tp in answer.parts:
                    retrying(lambda: self._take_over(tp.partition, tp.offset))
                self.log.info(
                    "pool_stage.assigned", partitions=[tp.partition for tp in answer.parts], pools=sorted(self.states)
                )

    def _on_revoke(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        ps = {tp.partition for tp in parts}
        with answered_rebalance(consumer, parts, assign=False):
            for pool in [p for p, q in self.pool_partition.items() if q in ps]:
                self.pool_partition.pop(pool)
                self.states.pop(pool, None)

    def _take_over(self, partition: int, committed: int) -> None:
        """The pools of this pool-samples partition as the last owner left them at its committed
        offset: the samples and intents since the window's start (seeked by record time), folded
        without deciding. A needed sample's event is within the window of the last committed one,
        and its record is no older than its event less `max_ts_skew_s` (admission's bound)."""
        if committed <= 0:
            return  # nothing committed: every sample is decided from the start
        topic = self.k.pool_samples_topic
        last = read_partitions(self.k, [(topic, partition)], bounds={(topic, partition): (committed - 1, committed)})
        if not last:
            return
        newest = PoolSample.from_bytes(last[-1].value() or b"")
        window = max((c.window_s for c in self.pools.values()), default=0.0)
        since_ms = int((newest.ts - window - self.max_ts_skew_s) * 1000)
        samples = self._samples(self._read_since(topic, [partition], since_ms, end=committed))
        intents: dict[str, list[PoolIntent]] = {}
        parts = partitions_of(self.k, self.k.pool_intents_topic)
        for m in self._read_since(self.k.pool_intents_topic, parts, since_ms, end=-1):
            i = PoolIntent.from_bytes(m.value() or b"")
            intents.setdefault(i.pool, []).append(i)
        by_pool: dict[str, list[PoolSample]] = {}
        for s in samples:
            by_pool.setdefault(s.pool, []).append(s)
        for pool, ss in by_pool.items():
            cfg = self.pools.get(pool)
            if cfg is not None:
                self.states[pool], _ = run_stage(ss, cfg, decide_from=len(ss), written=intents.get(pool, ()))
                self.pool_partition[pool] = partition

    def _read_since(self, topic: str, partitions: Sequence[int], since_ms: int, end: int) -> list[Message]:
        """The committed records of these partitions from the first at or after `since_ms` (record
        time) up to `end` (< 0: the end)."""
        found = self.consumer.offsets_for_times([TopicPartition(topic, p, max(0, since_ms)) for p in partitions], 10)
        bounds = {(topic, tp.partition): (tp.offset, end) for tp in found if tp.offset >= 0}
        return read_partitions(self.k, list(bounds), bounds=bounds)

    def _samples(self, msgs: Sequence[Message]) -> list[PoolSample]:
        out = []
        for m in msgs:
            try:
                out.append(PoolSample.from_bytes(m.value() or b""))
            except InvalidEvent:
                continue  # went to the dlq when it was decided
        return out

    # ---- the loop ----------------------------------------------------------------------
    def step(self, max_messages: int = 5000) -> int:
        """Decide the samples consumed since the last call, in one transaction; their count."""
        msgs = [m for m in consume_batch(self.consumer, max_messages, timeout=0) if m.error() is None]
        if not msgs:
            return 0
        states: dict[str, PoolState] = {}
        decided: list[tuple[Message, PoolSample | InvalidEvent, tuple[PoolIntent, ...]]] = []
        for m in msgs:
            try:
                s = PoolSample.from_bytes(m.value() or b"")
            except InvalidEvent as e:
                decided.append((m, e, ()))
                continue
            cfg = self.pools.get(s.pool)
            if cfg is None:  # a pool no longer configured here: its samples are passed over
                decided.append((m, s, ()))
                continue
            states[s.pool], intents = decide_sample(states.get(s.pool, self.states.get(s.pool, PoolState())), s, cfg)
            decided.append((m, s, intents))
        try:
            self.tx.run(msgs, lambda: self._produce(decided), lambda: None)
        except GroupMembershipLost as e:
            self.log.warning("pool_stage.rejoin", error=str(e), samples=len(msgs))
            return 0
        for m, rec, intents in decided:
            if isinstance(rec, PoolSample) and rec.pool in states:
                self.pool_partition[rec.pool] = m.partition() or 0
            for i in intents:
                INTENTS_OUT.inc(action=i.action)
                self.log.info(
                    "pool.intent", pool=i.pool, replica=i.replica, action=i.action, gpu=i.gpu, reason=i.reason
                )
        self.states.update(states)
        SAMPLES_IN.inc(len(msgs))
        return len(msgs)

    def _produce(self, decided: Sequence[tuple[Message, PoolSample | InvalidEvent, tuple[PoolIntent, ...]]]) -> None:
        for m, s, intents in decided:
            if isinstance(s, InvalidEvent):
                dead_letter(self.producer, self.k.dlq_topic, m, s.reason, s.field, consumer="scheduler-pools")
            for i in intents:
                p = partition_for(i.gpu, self._telemetry_partitions)
                produce(self.producer, self.k.pool_intents_topic, i.to_bytes(), i.gpu, partition=p)

    def close(self) -> None:
        try:
            self.consumer.close()
        finally:
            self.producer.flush(5)
