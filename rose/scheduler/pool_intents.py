"""The GPU stage's side of the pool stage (docs/scheduler.md "Pool decisions and partitioning",
steps 1 and 3): the samples it writes to `<prefix>pool-samples`, and the intents it reads from
`<prefix>pool-intents` partition p beside telemetry partition p.

The intents are read by a plain assigned consumer, as `lease-state` is, but their position is the
group's: each batch's intent records go into its transaction with the telemetry offsets
(`send_offsets_to_transaction` commits them to the scheduler group), and whoever owns telemetry
partition p next starts pool-intents partition p from that committed offset, so an intent turns
into commands exactly once."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rose.config import KafkaConfig
from rose.contract.events import InvalidEvent
from rose.kafka.admin import retrying
from rose.kafka.consumer import OFFSET_BEGINNING, Consumer, Message, TopicPartition, make_consumer, rewind
from rose.kafka.producer import Producer, produce
from rose.policy.pool_records import PoolIntent, PoolSample


class IntentReader:
    """pool-intents partitions beside the owned telemetry partitions, from the group's offsets."""

    def __init__(self, kcfg: KafkaConfig, group: str, instance: str, log: Any):
        self.topic = kcfg.pool_intents_topic
        self.log = log
        self.consumer: Consumer = make_consumer(
            kcfg, f"{kcfg.topic_prefix}{group}-pool-intents-{instance}", **{"fetch.wait.max.ms": 50}
        )

    def assign(self, group_consumer: Consumer, partitions: Sequence[int]) -> None:
        """Start reading these partitions where the group committed them (its first: none yet)."""
        tps = [TopicPartition(self.topic, p) for p in partitions]
        committed = retrying(lambda: group_consumer.committed(tps, timeout=10))
        starts = [
            TopicPartition(self.topic, tp.partition, tp.offset if tp.offset >= 0 else OFFSET_BEGINNING)
            for tp in committed
        ]
        self.consumer.incremental_assign(starts)

    def unassign(self, partitions: Sequence[int]) -> None:
        self.consumer.incremental_unassign([TopicPartition(self.topic, p) for p in partitions])

    def take(self) -> tuple[list[Message], list[PoolIntent]]:
        """The intent records fetched since the last call, and the intents among them (a record
        that is not one is logged and skipped: its offset still commits)."""
        msgs = [m for m in self.consumer.consume(1000, timeout=0) if m.error() is None]
        intents = []
        for m in msgs:
            try:
                intents.append(PoolIntent.from_bytes(m.value() or b""))
            except InvalidEvent as e:
                self.log.warning("pool_intent.invalid", offset=m.offset(), partition=m.partition(), error=str(e))
        return msgs, intents

    def rewind(self, msgs: Sequence[Message]) -> None:
        """Read these again (their transaction did not commit)."""
        rewind(self.consumer, msgs)

    def close(self) -> None:
        self.consumer.close()


def intent_partitions(msgs: Sequence[Message], changed: Mapping[str, object]) -> dict[str, int]:
    """Each intent record's GPU (its key) whose view the batch `changed`, and the record's
    partition: where that view is written."""
    out = {}
    for m in msgs:
        key, partition = m.key(), m.partition()
        if isinstance(key, bytes) and partition is not None and key.decode("utf-8", "replace") in changed:
            out[key.decode("utf-8", "replace")] = partition
    return out


def produce_samples(producer: Producer, topic: str, samples: Sequence[PoolSample]) -> None:
    """Into the open transaction: one record per sample, key = pool (the pool stage's owner)."""
    for s in samples:
        produce(producer, topic, s.to_bytes(), s.pool)
