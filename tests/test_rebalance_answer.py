"""A cooperative consumer's rebalance callback is answered (incremental assign or unassign) even
when its body raises: confluent-kafka's own answer would ask librdkafka for the rebalance
protocol while holding the GIL, which can wait forever during a close (librdkafka #4041) and
stop the whole process. On the real Kafka: the raising callback's partitions are assigned, its
error reaches `consume()`, and the consumer still closes promptly."""

from __future__ import annotations

import threading
import time

import pytest

from rose.kafka.consumer import KafkaException, answered_rebalance, make_consumer


class Boom(RuntimeError):
    pass


@pytest.mark.stack
def test_a_raising_callback_still_answers_the_rebalance_and_the_consumer_closes(cfg):
    c = make_consumer(
        cfg.kafka, f"{cfg.kafka.topic_prefix}answer", **{"partition.assignment.strategy": "cooperative-sticky"}
    )

    def on_assign(consumer, parts):
        with answered_rebalance(consumer, parts, assign=True):
            raise Boom("the callback failed")

    def on_revoke(consumer, parts):
        with answered_rebalance(consumer, parts, assign=False):
            raise Boom("the callback failed on revoke")

    c.subscribe([cfg.kafka.telemetry_topic], on_assign=on_assign, on_revoke=on_revoke)
    raised = None
    deadline = time.monotonic() + 60
    while raised is None and time.monotonic() < deadline:
        try:
            c.consume(10, timeout=0.5)
        except (Boom, KafkaException) as e:
            raised = e
    assert isinstance(raised, Boom), f"the callback's error did not reach consume(): {raised!r}"
    assert {tp.partition for tp in c.assignment()} == set(range(cfg.kafka.partitions))
    closer = threading.Thread(target=lambda: _close_swallowing(c), daemon=True)
    t0 = time.monotonic()
    closer.start()
    closer.join(30)
    assert not closer.is_alive(), "close() did not return within 30 s"
    assert time.monotonic() - t0 < 30


def _close_swallowing(c) -> None:
    try:
        c.close()  # the revoke callback raises inside close: its error is the close's
    except (Boom, KafkaException):
        pass


class Recording:
    """Records the answers a callback gives (the consumer boundary only)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list]] = []

    def incremental_assign(self, parts: list) -> None:
        self.calls.append(("assign", parts))

    def incremental_unassign(self, parts: list) -> None:
        self.calls.append(("unassign", parts))


@pytest.mark.parametrize("assign", [True, False])
def test_the_answer_is_given_once_whether_the_body_returns_or_raises(assign):
    kind = "assign" if assign else "unassign"
    ok = Recording()
    with answered_rebalance(ok, ["p0"], assign=assign) as answer:
        answer.parts = ["p0@42"]  # what the body found (committed offsets) is what gets answered
    failed = Recording()
    with pytest.raises(Boom), answered_rebalance(failed, ["p1"], assign=assign):
        raise Boom("rebuild failed")
    assert ok.calls == [(kind, ["p0@42"])]
    assert failed.calls == [(kind, ["p1"])]
