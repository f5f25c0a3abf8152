"""rose.kafka.transactional without a broker: a batch commits once with its offsets; a retriable
failure aborts, restores and redoes it; a fenced or fatal producer, or a coordinator call that
never returns, raises the caller's fatal error."""

from __future__ import annotations

import threading

import pytest

from rose.kafka.base import KafkaError, KafkaException
from rose.kafka.transactional import FatalTransactionError, Transactor, positions


class Msg:
    def __init__(self, topic: str, partition: int, offset: int):
        self._t, self._p, self._o = topic, partition, offset

    def topic(self):
        return self._t

    def partition(self):
        return self._p

    def offset(self):
        return self._o


class Log:
    def __init__(self):
        self.lines = []

    def warning(self, event, **kw):
        self.lines.append((event, kw))


class Producer:
    """Records the calls; `fail` maps a call name to the errors its next calls raise."""

    def __init__(self, fail: dict[str, list[KafkaError]] | None = None, hang: str | None = None):
        self.calls: list[str] = []
        self.fail = fail or {}
        self.hang = hang
        self.offsets = None

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name == self.hang:
            threading.Event().wait(5)
        errs = self.fail.get(name)
        if errs:
            raise KafkaException(errs.pop(0))

    def init_transactions(self, timeout):
        self._call("init")

    def begin_transaction(self):
        self._call("begin")

    def send_offsets_to_transaction(self, offsets, meta, timeout):
        self.offsets = offsets
        self._call("send_offsets")

    def commit_transaction(self, timeout):
        self._call("commit")

    def abort_transaction(self, timeout):
        self._call("abort")

    def poll(self, timeout):
        pass


class Consumer:
    def consumer_group_metadata(self):
        return "meta"


class Fatal(FatalTransactionError):
    pass


def retriable(code=KafkaError._TIMED_OUT):
    return KafkaError(code, "retry me", retriable=True)


MSGS = [Msg("t", 0, 5), Msg("t", 1, 7), Msg("t", 0, 6)]


def test_positions_are_one_past_the_last_of_each_partition():
    assert sorted((tp.topic, tp.partition, tp.offset) for tp in positions(MSGS)) == [("t", 0, 7), ("t", 1, 8)]


def test_a_batch_commits_once_with_its_offsets():
    p, log = Producer(), Log()
    tx = Transactor(p, Consumer(), log, fatal=Fatal)
    assert tx.run(MSGS, lambda: "out", lambda: pytest.fail("nothing to restore")) == "out"
    assert p.calls == ["begin", "send_offsets", "commit"]
    assert sorted((tp.partition, tp.offset) for tp in p.offsets) == [(0, 7), (1, 8)]
    assert (tx.committed, tx.aborted) == (1, 0)


def test_a_retriable_commit_is_retried_before_the_batch_is_redone():
    p = Producer(fail={"commit": [retriable(), retriable()]})
    log = Log()
    tx = Transactor(p, Consumer(), log, fatal=Fatal)
    tx.run(MSGS, lambda: None, lambda: pytest.fail("the commit went through on its third try"))
    assert p.calls == ["begin", "send_offsets", "commit", "commit", "commit"]
    assert [e for e, _ in log.lines] == ["transaction.commit_retry"] * 2


def test_a_retriable_failure_aborts_restores_and_redoes_the_batch():
    p, log = Producer(fail={"send_offsets": [retriable()]}), Log()
    processed, restored = [], []
    tx = Transactor(p, Consumer(), log, fatal=Fatal, retry_pause_s=0)
    tx.run(MSGS, lambda: processed.append(1), lambda: restored.append(len(processed)))
    assert p.calls == ["begin", "send_offsets", "abort", "begin", "send_offsets", "commit"]
    assert processed == [1, 1] and restored == [1]  # restored between the two attempts
    assert (tx.committed, tx.aborted) == (1, 1) and log.lines[0][0] == "transaction.abort"
    # a commit that keeps failing surfaces after its attempts, and the batch is redone
    p = Producer(fail={"commit": [retriable()] * 3})
    tx = Transactor(p, Consumer(), Log(), fatal=Fatal, commit_attempts=3, retry_pause_s=0)
    tx.run(MSGS, lambda: None, lambda: None)
    assert p.calls == [
        "begin",
        "send_offsets",
        "commit",
        "commit",
        "commit",
        "abort",
        "begin",
        "send_offsets",
        "commit",
    ]


@pytest.mark.parametrize(
    "err", [KafkaError(KafkaError._FENCED, "fenced"), KafkaError(KafkaError._FATAL, "fatal", fatal=True)]
)
def test_a_fenced_or_fatal_producer_raises_the_callers_fatal_error(err):
    p = Producer(fail={"commit": [err]})
    tx = Transactor(p, Consumer(), Log(), fatal=Fatal)
    with pytest.raises(Fatal, match="fenced or fatal"):
        tx.run(MSGS, lambda: None, lambda: pytest.fail("no restore: the clients are replaced"))
    p = Producer(fail={"init": [retriable()]})
    with pytest.raises(Fatal, match="init_transactions"):
        Transactor(p, Consumer(), Log(), fatal=Fatal).init(1)


def test_a_wedged_coordinator_call_is_fatal_within_its_deadline():
    """librdkafka #5511: send_offsets_to_transaction can block forever."""
    p = Producer(hang="send_offsets")
    tx = Transactor(p, Consumer(), Log(), fatal=Fatal, deadline_s=0.3)
    with pytest.raises(Fatal, match="send_offsets_to_transaction did not return"):
        tx.run(MSGS, lambda: None, lambda: None)
