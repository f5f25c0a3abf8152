"""The admin client and cluster look-ups: waiting for the broker, partitions of a topic, and
retrying start-up steps while the cluster settles."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from confluent_kafka.admin import (
    AdminClient,
    ConfigResource,
    NewTopic,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialUpsertion,
)

from rose.config import KafkaConfig
from rose.kafka.base import KafkaError, KafkaException, client_conf, report_unreachable

__all__ = [
    "AdminClient",
    "ConfigResource",
    "KafkaError",
    "KafkaException",
    "NewTopic",
    "ScramCredentialInfo",
    "ScramMechanism",
    "UserScramCredentialUpsertion",
    "make_admin",
    "partitions_of",
    "retrying",
    "wait_for_broker",
]

T = TypeVar("T")


def make_admin(kcfg: KafkaConfig, **overrides: Any) -> AdminClient:
    return AdminClient(client_conf(kcfg, **overrides))


def retrying(fn: Callable[[], T], timeout_s: float = 30.0) -> T:
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


def wait_for_broker(kcfg: KafkaConfig, timeout_s: float | None = 30.0, stop: threading.Event | None = None) -> bool:
    """Block until the cluster answers a metadata request: True then. While it does not, one
    `kafka.unreachable` line names the bootstrap and what to do (again at most every 30 s), and
    the request is repeated: for `timeout_s` (then TimeoutError with the last error), or without
    end when `timeout_s` is None; False as soon as `stop` is set."""
    admin = make_admin(kcfg)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    last: Exception | None = None
    while stop is None or not stop.is_set():
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"Kafka at {kcfg.bootstrap} did not answer within {timeout_s}s ({last})")
        try:
            md = admin.list_topics(timeout=2)
            if md.brokers:
                return True
        except KafkaException as e:
            last = e
            report_unreachable(kcfg.bootstrap, e.args[0].str() if isinstance(e.args[0], KafkaError) else e)
        admin.poll(0)  # serve the client's log lines and error callbacks
        if stop is not None:
            stop.wait(0.2)
        else:
            time.sleep(0.2)
    return False


def partitions_of(kcfg: KafkaConfig, topic: str, timeout_s: float = 10.0) -> list[int]:
    md = make_admin(kcfg).list_topics(topic, timeout=timeout_s)
    t = md.topics.get(topic)
    if t is None or t.error is not None:
        raise KafkaException(t.error if t is not None else KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))
    return sorted(t.partitions)
