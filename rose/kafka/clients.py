"""Thin adapters over confluent-kafka: config pass-through, retries on a full queue,
flush on exit, and the dead-letter topic. Policy lives elsewhere; these add nothing else.

librdkafka properties from the config (`[kafka.librdkafka]`) pass through untouched, so
`security.protocol`, `sasl.*` and `ssl.*` reach every client ROSE builds.
"""

from __future__ import annotations

import time
from typing import Iterable, Sequence

import orjson
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from rose.contract.codec import encode
from rose.config import KafkaConfig
from rose.contract.events import Event

Headers = list[tuple[str, bytes]]

MAX_RECORD_BYTES = 16 << 20  # max.message.bytes of ROSE's topics (rose.topics) and the local broker

# Latency-first producer defaults for control messages; every one can be overridden.
LOW_LATENCY = {"linger.ms": 2, "batch.num.messages": 10000}


def client_conf(kcfg: KafkaConfig, **overrides) -> dict:
    """bootstrap + the user's librdkafka pass-through + the caller's overrides."""
    conf = {"bootstrap.servers": kcfg.bootstrap, **kcfg.librdkafka}
    conf.update({k if k in _PY_CALLBACKS else k.replace("_", "."): v for k, v in overrides.items()})
    return conf


# confluent-kafka's Python-side settings, whose names keep their underscores
_PY_CALLBACKS = frozenset({"on_delivery", "error_cb", "stats_cb", "throttle_cb", "oauth_cb", "logger"})


def make_producer(kcfg: KafkaConfig, **overrides) -> Producer:
    """An idempotent producer (acks=all, ordered per partition) with low-latency batching.
    Keys are partitioned with murmur2 (the Java client's default, not librdkafka's CRC32) so
    that a consumer can compute which partition holds a key: see `partition_for`."""
    conf = {"enable.idempotence": True, "partitioner": "murmur2_random",
            # what a consumer could not decode goes to the dlq whole, up to the topics' limit
            "message.max.bytes": MAX_RECORD_BYTES + (64 << 10), **LOW_LATENCY}
    conf.update(client_conf(kcfg, **overrides))
    return Producer(conf)


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 hash (seed 0x9747b28c), as the Java client and librdkafka compute it."""
    m, h = 0x5BD1E995, (0x9747B28C ^ len(data)) & 0xFFFFFFFF
    n4 = len(data) & ~3
    for i in range(0, n4, 4):
        k = int.from_bytes(data[i:i + 4], "little")
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


def make_consumer(kcfg: KafkaConfig, group_id: str, **overrides) -> Consumer:
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


def make_admin(kcfg: KafkaConfig, **overrides) -> AdminClient:
    return AdminClient(client_conf(kcfg, **overrides))


def produce(producer: Producer, topic: str, value: bytes | None, key: str | bytes | None,
            headers: Headers | None = None, partition: int | None = None) -> None:
    """Produce without blocking on a healthy broker; when librdkafka's queue is full,
    serve delivery reports and retry (back-pressure instead of an exception)."""
    kwargs = {"headers": headers} if headers else {}
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


def dead_letter(producer: Producer, dlq_topic: str, msg: Message, reason: str, field: str = "$",
                consumer: str = "rose") -> None:
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
    for k, v in msg.headers() or []:
        if not k.startswith("rose.dlq."):
            headers.append((k, v if isinstance(v, bytes) else (v or b"")))
    produce(producer, dlq_topic, msg.value(), msg.key(), headers)


def header(msg_or_headers, name: str) -> bytes | None:
    """First value of a header, from a Message or a header list."""
    hs = msg_or_headers.headers() if hasattr(msg_or_headers, "headers") else msg_or_headers
    for k, v in hs or []:
        if k == name:
            return v
    return None


def retrying(fn, timeout_s: float = 30.0):
    """Run a start-up step, retrying while the cluster is still settling (a new topic without a
    leader yet, a broker restarting); the last error is raised after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return fn()
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.25)


def wait_for_broker(kcfg: KafkaConfig, timeout_s: float = 30.0) -> None:
    """Block until the cluster answers a metadata request, or raise with the last error."""
    admin = make_admin(kcfg)
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            md = admin.list_topics(timeout=2)
            if md.brokers:
                return
        except KafkaException as e:
            last = e
        time.sleep(0.2)
    raise TimeoutError(f"Kafka at {kcfg.bootstrap} did not answer within {timeout_s}s ({last})")


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


def read_partitions(kcfg: KafkaConfig, partitions: Sequence[tuple[str, int]], timeout_s: float = 30.0,
                    isolation: str = "read_committed", **overrides) -> list[Message]:
    """Every message now in the given (topic, partition)s, from their start up to their end
    offsets at call time, in partition order. For rebuilding state, record, audits and tests."""
    consumer = make_consumer(kcfg, group_id=f"rose-reader-{time.monotonic_ns()}",
                             **{"isolation.level": isolation, **overrides})
    try:
        remaining: dict[tuple[str, int], int] = {}
        assign = []
        for t, p in partitions:
            lo, hi = retrying(lambda: consumer.get_watermark_offsets(TopicPartition(t, p), timeout=10), 30)
            if hi > lo:
                remaining[(t, p)] = hi
                assign.append(TopicPartition(t, p, lo))
        if not assign:
            return []
        consumer.assign(assign)
        out: list[Message] = []
        deadline = time.monotonic() + timeout_s
        while remaining and time.monotonic() < deadline:
            for m in consume_batch(consumer, 1000, timeout=0.2):
                if m.error():
                    if m.error().code() == KafkaError._PARTITION_EOF:
                        continue
                    raise KafkaException(m.error())
                out.append(m)
                tp = (m.topic(), m.partition())
                if tp in remaining and m.offset() + 1 >= remaining[tp]:
                    del remaining[tp]
            # transaction markers and aborted records occupy offsets: done once the position is at the end
            if remaining:
                for tp in consumer.position([TopicPartition(t, p) for (t, p) in remaining]):
                    if tp.offset >= remaining.get((tp.topic, tp.partition), 1 << 62):
                        del remaining[(tp.topic, tp.partition)]
        if remaining:
            raise TimeoutError(f"could not read {sorted(remaining)} to their end in {timeout_s}s")
        return out
    finally:
        consumer.close()


def partitions_of(kcfg: KafkaConfig, topic: str, timeout_s: float = 10.0) -> list[int]:
    md = make_admin(kcfg).list_topics(topic, timeout=timeout_s)
    t = md.topics.get(topic)
    if t is None or t.error is not None:
        raise KafkaException(t.error if t is not None else KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))
    return sorted(t.partitions)


def read_all(kcfg: KafkaConfig, topics: Sequence[str], timeout_s: float = 30.0,
             isolation: str = "read_committed", **overrides) -> list[Message]:
    """Every message currently in `topics` (up to their end offsets at call time)."""
    parts = [(t, p) for t in topics for p in partitions_of(kcfg, t)]
    return read_partitions(kcfg, parts, timeout_s, isolation, **overrides)


def message_record(m: Message) -> dict:
    """A Kafka message as one NDJSON-able dict (the `rose record` line format)."""
    ts_type, ts_ms = m.timestamp()
    value = m.value()
    try:
        decoded = orjson.loads(value) if value is not None else None
    except orjson.JSONDecodeError:
        decoded = None
    rec = {
        "topic": m.topic(),
        "partition": m.partition(),
        "offset": m.offset(),
        "timestamp_ms": ts_ms,
        "key": m.key().decode("utf-8", "replace") if m.key() is not None else None,
        "headers": {k: (v or b"").decode("utf-8", "replace") for k, v in (m.headers() or [])},
    }
    if decoded is not None or value is None:
        rec["value"] = decoded
    else:
        rec["value_raw"] = value.decode("utf-8", "replace")
    return rec


def iter_headers(headers: Iterable[tuple[str, bytes]] | None) -> dict[str, str]:
    return {k: (v or b"").decode("utf-8", "replace") for k, v in (headers or [])}
