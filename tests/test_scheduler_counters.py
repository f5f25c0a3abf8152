"""The scheduler's counters count what committed: a transaction attempt that aborts after it
produced its commands and dlq records (and is redone) adds nothing to
`rose_scheduler_commands_total`, `rose_scheduler_dlq_total` or the stats. Planted bug it
catches: counting inside the transaction body, which counts the aborted attempt too."""

from __future__ import annotations

import time

import pytest

from rose.kafka.base import KafkaError, KafkaException
from rose.kafka.consumer import read_all
from rose.scheduler import service
from rose.sim.telemetry_workload import workload
from tests.kafka_checks import commands
from tests.test_scheduler import _produce

pytestmark = pytest.mark.stack


def _total(counter) -> float:
    return sum(counter._values.values())


def test_an_aborted_attempt_is_not_counted(cfg):
    events = workload(4, 120, prefix="ab")
    bad = [(b"{not json", b"ab/0")]
    _produce(cfg, events, bad)
    s = service.Scheduler(cfg, instance="ab")
    real_commit = s.tx.commit
    aborted_with: list[int] = []

    def commit_once_failing() -> None:
        """The first commit of an attempt that produced commands fails retriably: it aborts and
        the batch is redone from the same decisions."""
        if not aborted_with and s._tally.commands.total():
            aborted_with.append(s._tally.commands.total() + s._tally.dlq)
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "planted commit failure", retriable=True))
        real_commit()

    s.tx.commit = commit_once_failing  # type: ignore[method-assign]
    before = (_total(service.COMMANDS_OUT), _total(service.DLQ))
    try:
        s.start()
        deadline = time.monotonic() + 60
        while s.stats.events < len(events) + len(bad) and time.monotonic() < deadline:
            s.step(0.2)
    finally:
        s.close()
    assert aborted_with and aborted_with[0] > 0, "the planted abort must have hit an attempt with records"
    assert s.stats.aborts == 1
    committed = commands(cfg)
    dlq = read_all(cfg.kafka, [cfg.kafka.dlq_topic])
    assert len(committed) > 0 and len(dlq) == 1
    assert s.stats.commands == len(committed)
    assert s.stats.dlq == len(dlq)
    assert _total(service.COMMANDS_OUT) - before[0] == len(committed)
    assert _total(service.DLQ) - before[1] == len(dlq)
