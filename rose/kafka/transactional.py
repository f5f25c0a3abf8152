"""Consume-transform-produce inside Kafka transactions, exactly once.

`Transactor.run(msgs, process, restore)` opens a transaction, lets `process()` produce into
it, adds the consumed offsets of `msgs` with the consumer group's metadata
(`send_offsets_to_transaction`, KIP-447: a stale group member cannot commit) and commits. A
retriable failure aborts the transaction, calls `restore()` so the caller can undo what
`process()` changed in memory, and redoes the batch; a fenced or fatal producer raises.
The caller keeps the semantics (what to decode, decide and produce); this keeps the transport.

Every call to the transaction coordinator that can hang runs under a hard deadline
(`bounded`): librdkafka can block in send_offsets_to_transaction forever when its cached
coordinator was decommissioned (a broker that left and came back; librdkafka issue #5511),
whatever timeout it was given. A wedged client is to be replaced rather than waited on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from confluent_kafka import Consumer, Message, Producer, TopicPartition

from rose.kafka.base import KafkaError, KafkaException
from rose.kafka.consumer import rewind

__all__ = ["FatalTransactionError", "Transactor", "bounded", "positions"]

T = TypeVar("T")


class FatalTransactionError(RuntimeError):
    """The transactional producer was fenced, hit a fatal error, or a coordinator call did not
    return in time: its clients must be replaced."""


def bounded(what: str, fn: Callable[[], T], timeout_s: float, fatal: type[Exception] = FatalTransactionError) -> T:
    """Run `fn` on a daemon thread and wait at most `timeout_s` for it; raise `fatal` when it
    has not returned by then (the thread is left behind), else return or raise what it did."""
    out: dict[str, Any] = {}

    def call() -> None:
        try:
            out["v"] = fn()
        except BaseException as e:  # handed to the caller's thread
            out["e"] = e

    t = threading.Thread(target=call, daemon=True, name=f"rose-{what}")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise fatal(f"{what} did not return within {timeout_s:.0f}s")
    if "e" in out:
        raise out["e"]
    value: T = out["v"]  # the thread ended without raising: fn returned
    return value


class GroupMembershipLost(RuntimeError):
    """The consumer's group membership was stale when its offsets went into the transaction
    (UNKNOWN_MEMBER_ID after a coordinator moved or restarted, ILLEGAL_GENERATION, a rebalance in
    progress). The transaction was aborted and the caller's state restored; the consumer must
    poll to rejoin, and the batch is not redone as it was: after the rejoin the partitions are
    consumed again from their committed offsets, by whichever instance owns them then."""


# errors of send_offsets_to_transaction that only a rejoin of the consumer group clears
_GROUP_ERRORS = frozenset(
    (
        KafkaError.UNKNOWN_MEMBER_ID,
        KafkaError.ILLEGAL_GENERATION,
        KafkaError.REBALANCE_IN_PROGRESS,
    )
)


def positions(msgs: Sequence[Message]) -> list[TopicPartition]:
    """The offsets to commit once `msgs` are done: one past the last of each partition."""
    last: dict[tuple[str, int], int] = {}
    for m in msgs:
        topic, partition, offset = m.topic(), m.partition(), m.offset()
        assert topic is not None and partition is not None and offset is not None  # not an error
        last[(topic, partition)] = offset
    return [TopicPartition(t, p, o + 1) for (t, p), o in last.items()]


class Transactor:
    """The transactions of one transactional producer whose input is `consumer`'s messages.

    `fatal` is the exception raised when the clients must be replaced (a subclass of
    FatalTransactionError the caller recognises); `call_timeout_s` is librdkafka's timeout
    for each coordinator call, `deadline_s` the hard deadline around it."""

    def __init__(
        self,
        producer: Producer,
        consumer: Consumer,
        log: Any,
        *,
        fatal: type[Exception] = FatalTransactionError,
        call_timeout_s: float = 10.0,
        deadline_s: float = 20.0,
        commit_attempts: int = 6,
        retry_pause_s: float = 0.2,
    ):
        self.producer, self.consumer, self.log = producer, consumer, log
        self.fatal = fatal
        self.call_timeout_s = call_timeout_s
        self.deadline_s = deadline_s
        self.commit_attempts = commit_attempts
        self.retry_pause_s = retry_pause_s
        self.committed = 0
        self.aborted = 0

    def init(self, timeout_s: float) -> None:
        """init_transactions (fences this transactional.id's previous incarnation)."""
        try:
            self.producer.init_transactions(timeout_s)
        except KafkaException as e:  # e.g. the broker is still coming back: the caller retries
            raise self.fatal(f"init_transactions: {e.args[0]}") from None

    def run(self, msgs: Sequence[Message], process: Callable[[], T], restore: Callable[[], None]) -> T:
        """Produce `process()`'s output and commit the offsets of `msgs` in one transaction;
        returns what `process()` returned in the transaction that committed."""
        while True:
            try:
                self.producer.begin_transaction()
                out = process()
                offsets = positions(msgs)
                meta = self.consumer.consumer_group_metadata()
                self.bounded(
                    "send_offsets_to_transaction",
                    lambda: self.producer.send_offsets_to_transaction(offsets, meta, self.call_timeout_s),
                )
                self.commit()
                self.committed += 1
                self.producer.poll(0)  # serve the client's log lines and error callbacks
                return out
            except KafkaException as e:
                err = e.args[0]
                # a fenced producer, or a static consumer fenced by its own rejoin (librdkafka
                # makes that consumer's error fatal): the clients must be replaced
                if err.fatal() or err.code() in (KafkaError._FENCED, KafkaError.FENCED_INSTANCE_ID):
                    raise self.fatal(f"producer fenced or fatal: {err}") from None
                self.aborted += 1
                self.log.warning("transaction.abort", error=str(err), retriable=err.retriable())
                try:
                    self.producer.abort_transaction(self.call_timeout_s)
                except KafkaException as e2:
                    if e2.args[0].fatal():
                        raise self.fatal(str(e2.args[0])) from None
                # level-triggered recovery: the caller restores its state, the batch is redone
                restore()
                if err.code() in _GROUP_ERRORS:
                    rewind(self.consumer, msgs)
                    raise GroupMembershipLost(str(err)) from None
                time.sleep(self.retry_pause_s)

    def commit(self) -> None:
        """Commit; a retriable error (e.g. a timeout while the broker restarts) is retried a
        few times, then surfaces so that `run` aborts and redoes the batch."""
        for attempt in range(self.commit_attempts):
            try:
                self.bounded("commit_transaction", lambda: self.producer.commit_transaction(self.call_timeout_s))
                return
            except KafkaException as e:
                if not e.args[0].retriable() or attempt == self.commit_attempts - 1:
                    raise
                self.log.warning("transaction.commit_retry", error=str(e.args[0]), attempt=attempt + 1)

    def bounded(self, what: str, fn: Callable[[], T], timeout_s: float | None = None) -> T:
        """`fn` under the hard deadline (`deadline_s` unless given); `fatal` when it passes."""
        return bounded(what, fn, self.deadline_s if timeout_s is None else timeout_s, self.fatal)
