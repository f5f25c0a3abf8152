"""The real local stack: Kafka answers, topics are idempotent, compaction is set,
a produced event is consumed back, Redis answers."""


import pytest

from confluent_kafka.admin import ConfigResource

from rose.contract.codec import decode
from rose.contract.events import Telemetry
from rose.kafka.clients import make_admin, make_producer, produce_event
from tests.kafka_checks import consume_one
from rose.kafka.topics import create_topics
from tests.examples import telemetry_example

pytestmark = pytest.mark.stack


def test_topics_create_is_idempotent_and_lease_state_is_compacted(cfg):
    again = create_topics(cfg.kafka)
    assert set(again.values()) == {"exists"}
    admin = make_admin(cfg.kafka)
    res = ConfigResource(ConfigResource.Type.TOPIC, cfg.kafka.lease_state_topic)
    conf = list(admin.describe_configs([res]).values())[0].result(timeout=10)
    assert conf["cleanup.policy"].value == "compact"
    md = admin.list_topics(timeout=10)
    assert len(md.topics[cfg.kafka.telemetry_topic].partitions) == cfg.kafka.partitions


def test_event_round_trip_through_real_kafka(cfg):
    ev = telemetry_example(gpu="node-1/3")
    p = make_producer(cfg.kafka)
    produce_event(p, cfg.kafka.telemetry_topic, ev)
    assert p.flush(10) == 0
    got = consume_one(cfg.kafka, cfg.kafka.telemetry_topic, "rt-test")
    assert got is not None, "event not consumed within 20 s"
    assert got.key() == b"node-1/3"
    assert decode(got.value(), Telemetry) == ev


def test_redis_answers(redis_client, cfg):
    key = cfg.redis.key("probe")
    redis_client.set(key, b"1")
    assert redis_client.get(key) == b"1"


def test_stack_status_reports_both_up(stack):
    assert stack.status() == {"kafka": True, "redis": True}


def test_consume_batch_returns_what_is_there_without_waiting_out_its_timeout(cfg):
    """librdkafka's consume(n, timeout) holds a short batch until the timeout; consume_batch
    (used by the scheduler and the executor) hands over what is there at once — else a lone
    revoke would wait out the consumer's whole poll timeout."""
    import time

    from confluent_kafka import OFFSET_BEGINNING, TopicPartition

    from rose.kafka.clients import consume_batch, make_consumer, produce

    p = make_producer(cfg.kafka)
    for i in range(10):
        produce(p, cfg.kafka.commands_topic, b"v%d" % i, b"g", partition=0)
    assert p.flush(10) == 0
    c = make_consumer(cfg.kafka, f"{cfg.kafka.topic_prefix}batch-test")
    c.assign([TopicPartition(cfg.kafka.commands_topic, 0, OFFSET_BEGINNING)])
    try:
        got, t0 = [], time.monotonic()
        while len(got) < 10 and time.monotonic() - t0 < 20:
            got += [m for m in consume_batch(c, 5000, timeout=30.0) if m.error() is None]
        assert [m.value() for m in got] == [b"v%d" % i for i in range(10)]
        assert time.monotonic() - t0 < 20, "consume_batch waited out its 30 s timeout for a full batch"
        t0 = time.monotonic()
        assert consume_batch(c, 5000, timeout=0.5) == []  # nothing more: the timeout, then empty
        assert time.monotonic() - t0 >= 0.4
    finally:
        c.close()
