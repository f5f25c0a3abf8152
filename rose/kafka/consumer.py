"""Consuming: a read_committed consumer with manual commits, batches that do not wait out a
quiet topic, reading partitions to their end (rebuilds, record, audits), and a message as a
record or a header."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, Message, TopicPartition

from rose.config import KafkaConfig
from rose.kafka.admin import partitions_of, retrying
from rose.kafka.base import Headers, KafkaError, KafkaException, client_conf, message_headers

__all__ = [
    "Consumer",
    "Headers",
    "KafkaError",
    "KafkaException",
    "Message",
    "OFFSET_BEGINNING",
    "OFFSET_END",
    "TopicPartition",
    "answered_rebalance",
    "consume_batch",
    "header",
    "make_consumer",
    "message_record",
    "read_all",
    "read_partitions",
]


def make_consumer(kcfg: KafkaConfig, group_id: str, **overrides: Any) -> Consumer:
    """A consumer with manual commits and read_committed isolation (sees only committed
    transactional output)."""
    conf = {
        "group.id": group_id,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
        "enable.partition.eof": False,
    }
    conf.update(client_conf(kcfg, **overrides))
    return Consumer(conf)


def header(msg_or_headers: Message | Sequence[tuple[str, bytes | None]], name: str) -> bytes | None:
    """First value of a header, from a Message or a header list."""
    hs = msg_or_headers if isinstance(msg_or_headers, Sequence) else message_headers(msg_or_headers)
    for k, v in hs:
        if k == name:
            return v
    return None


def consume_batch(consumer: Consumer, max_messages: int, timeout: float, linger: float = 0.0) -> list[Message]:
    """Up to `max_messages`: waits at most `timeout` for the first, then at most `linger` for
    more. librdkafka's consume(n, timeout) waits out the whole timeout unless n messages are
    there, which on a quiet topic adds the timeout to every message's latency (a revoke among
    them); `linger` bounds that wait to what batching is worth (the scheduler's transactions)."""
    msgs = consumer.consume(max_messages, timeout=0)
    if not msgs:
        if timeout <= 0:
            return msgs
        msgs = consumer.consume(1, timeout=timeout)
        if not msgs:
            return msgs
    if len(msgs) < max_messages:
        msgs += consumer.consume(max_messages - len(msgs), timeout=linger)
    return msgs


@dataclass
class RebalanceAnswer:
    parts: list[TopicPartition]  # what the answer assigns or unassigns: the callback may replace it


@contextlib.contextmanager
def answered_rebalance(consumer: Consumer, parts: list[TopicPartition], assign: bool) -> Iterator[RebalanceAnswer]:
    """A cooperative rebalance callback's body, answered with `incremental_assign` (or
    `incremental_unassign`) whether it returns or raises. When a callback answers nothing,
    confluent-kafka answers for it, first asking librdkafka for the rebalance protocol while it
    holds the GIL; during a consumer's close that request can wait forever (librdkafka #4041),
    and the whole process stops with it. The callback's exception still reaches `consume()`."""
    answer = RebalanceAnswer(parts)
    try:
        yield answer
    finally:
        (consumer.incremental_assign if assign else consumer.incremental_unassign)(answer.parts)


def rewind(consumer: Consumer, msgs: Sequence[Message]) -> None:
    """Seek the consumer back to the first offset of `msgs` in each of their partitions, so that
    none of them is skipped: a batch whose transaction aborted before a rejoin (which may hand back
    the same partitions without resetting their positions), or messages fetched before a pause."""
    first: dict[tuple[str, int], int] = {}
    for m in msgs:
        topic, part, off = m.topic(), m.partition(), m.offset()
        if topic is None or part is None or off is None or m.error() is not None:
            continue  # not a message of a partition (an error event)
        key = (topic, part)
        if key not in first or off < first[key]:
            first[key] = off
    for (topic, part), off in first.items():
        try:
            consumer.seek(TopicPartition(topic, part, off))
        except KafkaException:
            pass  # no longer assigned: its next owner starts from the committed offset


def read_partitions(
    kcfg: KafkaConfig,
    partitions: Sequence[tuple[str, int]],
    timeout_s: float = 30.0,
    isolation: str = "read_committed",
    bounds: Mapping[tuple[str, int], tuple[int, int]] | None = None,
    **overrides: Any,
) -> list[Message]:
    """Every message now in the given (topic, partition)s, from their start up to their end
    offsets at call time, in partition order; `bounds` narrows a partition to the offsets
    [from, to) within those (to < 0: its end). A record fetched past its partition's end (one
    fetch brings whatever follows) is left out: a takeover that folded it would decide it twice.
    For rebuilding state, record, audits and tests."""
    consumer = make_consumer(
        kcfg, group_id=f"rose-reader-{time.monotonic_ns()}", **{"isolation.level": isolation, **overrides}
    )
    try:
        remaining: dict[tuple[str, int], int] = {}
        ends: dict[tuple[str, int], int] = {}
        assign = []
        for t, p in partitions:
            lo, hi = retrying(lambda: consumer.get_watermark_offsets(TopicPartition(t, p), timeout=10), 30)
            if bounds is not None and (t, p) in bounds:
                start, end = bounds[(t, p)]
                lo, hi = max(lo, start), hi if end < 0 else min(hi, end)
            if hi > lo:
                remaining[(t, p)] = ends[(t, p)] = hi
                assign.append(TopicPartition(t, p, lo))
        if not assign:
            return []
        consumer.assign(assign)
        out: list[Message] = []
        deadline = time.monotonic() + timeout_s
        while remaining and time.monotonic() < deadline:
            for m in consume_batch(consumer, 1000, timeout=0.2):
                if err := m.error():
                    if err.code() == KafkaError._PARTITION_EOF:
                        continue
                    raise KafkaException(err)
                topic, partition, offset = m.topic(), m.partition(), m.offset()
                assert topic is not None and partition is not None and offset is not None  # not an error
                if offset >= ends[(topic, partition)]:
                    continue
                out.append(m)
                if (topic, partition) in remaining and offset + 1 >= remaining[(topic, partition)]:
                    del remaining[(topic, partition)]
            # transaction markers and aborted records occupy offsets: done once the position is at the end
            if remaining:
                for pos in consumer.position([TopicPartition(t, p) for (t, p) in remaining]):
                    if pos.offset >= remaining.get((pos.topic, pos.partition), 1 << 62):
                        del remaining[(pos.topic, pos.partition)]
        if remaining:
            raise TimeoutError(f"could not read {sorted(remaining)} to their end in {timeout_s}s")
        return out
    finally:
        consumer.close()


def read_all(
    kcfg: KafkaConfig,
    topics: Sequence[str],
    timeout_s: float = 30.0,
    isolation: str = "read_committed",
    **overrides: Any,
) -> list[Message]:
    """Every message currently in `topics` (up to their end offsets at call time)."""
    parts = [(t, p) for t in topics for p in partitions_of(kcfg, t)]
    return read_partitions(kcfg, parts, timeout_s, isolation, **overrides)


def message_record(m: Message) -> dict[str, Any]:
    """A Kafka message as one NDJSON-able dict (the `rose record` line format)."""
    ts_type, ts_ms = m.timestamp()
    key, value = m.key(), m.value()
    try:
        decoded = orjson.loads(value) if value is not None else None
    except orjson.JSONDecodeError:
        decoded = None
    rec = {
        "topic": m.topic(),
        "partition": m.partition(),
        "offset": m.offset(),
        "timestamp_ms": ts_ms,
        "key": key.decode("utf-8", "replace") if key is not None else None,
        "headers": {k: (v or b"").decode("utf-8", "replace") for k, v in message_headers(m)},
    }
    if decoded is not None or value is None:
        rec["value"] = decoded
    else:
        rec["value_raw"] = value.decode("utf-8", "replace")
    return rec
