"""The Kafka partitions an executor reads as its own, those that hold its GPUs' keys
(`rose.kafka.producer.partition_for`): the commands topic's, which it assigns itself rather
than joining a consumer group, each from its committed offset (`command_assignment`), and the
compacted lease-state topic's, from which each GPU's last lease record is rebuilt at start
(`rebuilt_records`). Why assignment rather than a group: docs/executor.md.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Collection

from rose.config import KafkaConfig
from rose.contract.events import InvalidEvent, LeaseState
from rose.contract.wire import decode
from rose.executor import lease_machine as lm
from rose.kafka.admin import partitions_of
from rose.kafka.consumer import OFFSET_END, Consumer, TopicPartition, read_partitions
from rose.kafka.producer import partition_for


def command_group(gpus: list[str]) -> str:
    """Offsets are committed under a group id that is stable for a node's set of GPUs."""
    return "rose-executor-" + hashlib.sha1(",".join(sorted(gpus)).encode()).hexdigest()[:16]


def rebuilt_records(k: KafkaConfig, gpus: Collection[str]) -> tuple[int, dict[str, lm.Record]]:
    """The lease-state topic's partition count, and each of `gpus`' last lease record in it at
    the highest epoch any of its states carried (GPUs without a state are left out)."""
    topic = k.lease_state_topic
    n = len(partitions_of(k, topic))
    mine = sorted({partition_for(g, n) for g in gpus})
    last: dict[str, LeaseState] = {}
    highest: dict[str, int] = {}
    for m in read_partitions(k, [(topic, p) for p in mine]):
        raw_key = m.key()
        key = raw_key.decode("utf-8", "replace") if raw_key else None
        if key is None or key not in gpus:
            continue
        try:
            ls = decode(m.value(), expect=LeaseState)
        except InvalidEvent:
            continue  # not ours to judge here; the topic's producers are executors
        last[key] = ls
        highest[key] = max(highest.get(key, -1), ls.epoch)
    return n, {
        gpu: lm.Record(ls.lease_id, max(ls.epoch, highest[gpu]), ls.state, ls.command_id) for gpu, ls in last.items()
    }


def command_assignment(k: KafkaConfig, consumer: Consumer, gpus: list[str], lookback_s: float) -> list[TopicPartition]:
    """The commands topic's partitions that hold `gpus`' keys, each from its committed offset;
    one never committed from the first command of the last `lookback_s`, else from its end."""
    topic = k.commands_topic
    n = len(partitions_of(k, topic))
    parts = sorted({partition_for(g, n) for g in gpus})
    committed = consumer.committed([TopicPartition(topic, p) for p in parts], timeout=10)
    since_ms = int((time.time() - lookback_s) * 1000)
    need_time = [TopicPartition(topic, tp.partition, since_ms) for tp in committed if tp.offset < 0]
    by_time = {
        tp.partition: tp.offset for tp in (consumer.offsets_for_times(need_time, timeout=10) if need_time else [])
    }
    assign = []
    for tp in committed:
        off = tp.offset if tp.offset >= 0 else by_time.get(tp.partition, OFFSET_END)
        assign.append(TopicPartition(topic, tp.partition, off if off >= 0 else OFFSET_END))
    return assign
