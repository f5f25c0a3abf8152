"""Producing: an idempotent, low-latency producer, back-pressure instead of an exception on a
full queue, the dead-letter topic, and the partition a key goes to."""

from __future__ import annotations

from typing import Any

from confluent_kafka import Message, Producer

from rose.config import KafkaConfig
from rose.contract.events import Event
from rose.contract.wire import encode
from rose.kafka.base import MAX_RECORD_BYTES, Headers, KafkaError, KafkaException, client_conf, message_headers

__all__ = [
    "Headers",
    "KafkaError",
    "KafkaException",
    "LOW_LATENCY",
    "Producer",
    "dead_letter",
    "make_producer",
    "murmur2",
    "partition_for",
    "produce",
    "produce_event",
]

# Latency-first producer defaults for control messages; every one can be overridden.
LOW_LATENCY = {"linger.ms": 2, "batch.num.messages": 10000}


def make_producer(kcfg: KafkaConfig, **overrides: Any) -> Producer:
    """An idempotent producer (acks=all, ordered per partition) with low-latency batching.
    Keys are partitioned with murmur2 (the Java client's default, not librdkafka's CRC32) so
    that a consumer can compute which partition holds a key: see `partition_for`."""
    conf = {
        "enable.idempotence": True,
        "partitioner": "murmur2_random",
        # what a consumer could not decode goes to the dlq whole, up to the topics' limit
        "message.max.bytes": MAX_RECORD_BYTES + (64 << 10),
        **LOW_LATENCY,
    }
    conf.update(client_conf(kcfg, **overrides))
    return Producer(conf)


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 hash (seed 0x9747b28c), as the Java client and librdkafka compute it."""
    m, h = 0x5BD1E995, (0x9747B28C ^ len(data)) & 0xFFFFFFFF
    n4 = len(data) & ~3
    for i in range(0, n4, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> 24
        h = ((h * m) & 0xFFFFFFFF) ^ ((k * m) & 0xFFFFFFFF)
    rest = len(data) - n4
    if rest == 3:
        h ^= data[n4 + 2] << 16
    if rest >= 2:
        h ^= data[n4 + 1] << 8
    if rest >= 1:
        h = ((h ^ data[n4]) * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    return h ^ (h >> 15)


def partition_for(key: str | bytes, partitions: int) -> int:
    """The partition `make_producer` sends `key` to (murmur2, positive, modulo the count)."""
    data = key.encode() if isinstance(key, str) else key
    return (murmur2(data) & 0x7FFFFFFF) % partitions


def produce(
    producer: Producer,
    topic: str,
    value: bytes | None,
    key: str | bytes | None,
    headers: Headers | None = None,
    partition: int | None = None,
) -> None:
    """Produce without blocking on a healthy broker; when librdkafka's queue is full,
    serve delivery reports and retry (back-pressure instead of an exception)."""
    kwargs: dict[str, Any] = {"headers": headers} if headers else {}
    if partition is not None:
        kwargs["partition"] = partition
    while True:
        try:
            producer.produce(topic, value=value, key=key, **kwargs)
            return
        except BufferError:
            producer.poll(0.05)


def produce_event(producer: Producer, topic: str, event: Event, headers: Headers | None = None) -> None:
    produce(producer, topic, encode(event), event.key, headers)


def dead_letter(
    producer: Producer, dlq_topic: str, msg: Message, reason: str, field: str = "$", consumer: str = "rose"
) -> None:
    """Send a message ROSE could not use to the dead-letter topic: the original key and
    value bytes unchanged, the reason and the source position in headers (the Kafka
    Connect convention), so nothing is lost and it can be re-driven later."""
    headers: Headers = [
        ("rose.dlq.reason", reason.encode()[:4096]),
        ("rose.dlq.field", field.encode()[:256]),
        ("rose.dlq.consumer", consumer.encode()),
        ("rose.dlq.topic", (msg.topic() or "").encode()),
        ("rose.dlq.partition", str(msg.partition()).encode()),
        ("rose.dlq.offset", str(msg.offset()).encode()),
    ]
    for k, v in message_headers(msg):
        if not k.startswith("rose.dlq."):
            headers.append((k, v if isinstance(v, bytes) else (v or b"")))
    produce(producer, dlq_topic, msg.value(), msg.key(), headers)
