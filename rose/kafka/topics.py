"""The contract's topics, created idempotently (already-exists is success)."""

from __future__ import annotations

from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import NewTopic

from rose.config import KafkaConfig
from rose.kafka.admin import make_admin
from rose.kafka.base import LOG_EVERY_S, MAX_RECORD_BYTES, _Every

# Compaction keeps the newest lease state per GPU forever: the scheduler's rebuild source.
COMPACTED = {"cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.1", "segment.ms": "600000"}
LARGE = {"max.message.bytes": str(MAX_RECORD_BYTES)}


def topic_specs(kcfg: KafkaConfig) -> dict[str, dict[str, str]]:
    """Topic name -> topic config, for every topic ROSE uses; with `kafka.min_insync_replicas`
    set, each topic's min.insync.replicas (otherwise the broker's default applies)."""
    isr = {"min.insync.replicas": str(kcfg.min_insync_replicas)} if kcfg.min_insync_replicas > 0 else {}
    return {
        kcfg.telemetry_topic: {"retention.ms": str(24 * 3600 * 1000), **LARGE, **isr},
        kcfg.commands_topic: {"retention.ms": str(7 * 24 * 3600 * 1000), **LARGE, **isr},
        kcfg.lease_state_topic: {**COMPACTED, **LARGE, **isr},
        kcfg.topic("scheduler-state"): {**COMPACTED, **LARGE, **isr},
        kcfg.dlq_topic: {"retention.ms": str(14 * 24 * 3600 * 1000), **LARGE, **isr},
        # the scheduler's pool stage (docs/scheduler.md "Pool decisions and partitioning"): a
        # takeover reads back a pool's window, so retention exceeds window_s plus the longest takeover
        kcfg.pool_samples_topic: {"retention.ms": str(24 * 3600 * 1000), **LARGE, **isr},
        kcfg.pool_intents_topic: {"retention.ms": str(24 * 3600 * 1000), **LARGE, **isr},
    }


CREATE_HINT = "create them with `rose topics create` (same kafka.bootstrap and kafka.topic_prefix)"

_missing_every = _Every(LOG_EVERY_S)


def missing_topics(kcfg: KafkaConfig, timeout_s: float = 5.0) -> list[str]:
    """The topics of `topic_specs` the cluster does not have (one metadata request of all
    topics, which auto-creates none); KafkaException when the cluster does not answer."""
    md = make_admin(kcfg).list_topics(timeout=timeout_s)
    absent = []
    for name in topic_specs(kcfg):
        t = md.topics.get(name)
        if t is None or (t.error is not None and t.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
            absent.append(name)
    return absent


def report_missing_topics(kcfg: KafkaConfig, missing: list[str], log: Any, service: str) -> bool:
    """One error line naming the missing topics and the command that creates them, at most
    once per `LOG_EVERY_S` for the same topics; True when a line was written."""
    held = _missing_every.allow((kcfg.bootstrap, tuple(missing)))
    if held is None:
        return False
    log.error(
        f"{service}.topics_missing",
        topics=missing,
        bootstrap=kcfg.bootstrap,
        fix=CREATE_HINT,
        waiting=True,
        left_out=held,
    )
    return True


def create_topics(kcfg: KafkaConfig, timeout_s: float = 30.0) -> dict[str, str]:
    """Create every topic with `kafka.partitions` partitions of `kafka.replication` replicas (and
    `kafka.min_insync_replicas`); returns name -> 'created' | 'exists'. Raises on other errors."""
    admin = make_admin(kcfg)
    new = [
        NewTopic(name, num_partitions=kcfg.partitions, replication_factor=kcfg.replication, config=conf)
        for name, conf in topic_specs(kcfg).items()
    ]
    result = {}
    for name, fut in admin.create_topics(new, request_timeout=timeout_s).items():
        try:
            fut.result(timeout=timeout_s)
            result[name] = "created"
        except KafkaException as e:
            if e.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
                result[name] = "exists"
            else:
                raise
    wait_for_leaders(kcfg, list(result), timeout_s)
    return result


def wait_for_leaders(kcfg: KafkaConfig, names: list[str], timeout_s: float = 30.0) -> None:
    """Block until every partition of `names` has a leader: a topic is usable only then."""
    import time

    admin = make_admin(kcfg)
    deadline = time.monotonic() + timeout_s
    while True:
        md = admin.list_topics(timeout=timeout_s)
        pending = [
            n
            for n in names
            if n not in md.topics
            or md.topics[n].error is not None
            or any(p.leader < 0 or p.error is not None for p in md.topics[n].partitions.values())
        ]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"topics without a partition leader after {timeout_s}s: {pending}")
        time.sleep(0.1)


def delete_topics(kcfg: KafkaConfig, names: list[str], timeout_s: float = 30.0) -> None:
    admin = make_admin(kcfg)
    for fut in admin.delete_topics(names, request_timeout=timeout_s).values():
        try:
            fut.result(timeout=timeout_s)
        except KafkaException:
            pass
