"""Fault: two schedulers race for the same partitions. Instance A is frozen (SIGSTOP) with one
of its transactions open, past its group session, while B takes its partitions over, then
thawed: A is a zombie holding a stale view and an open batch. Expectation: A's stale
transaction cannot commit (the broker aborts it at the transaction timeout and fences A's
producer; the consumer group generation fences its offsets through send_offsets_to_transaction),
A says so in its log once thawed, its records stay invisible to read_committed consumers, and
those see every command exactly once and equal to the pure policy's."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import psutil
import pytest

from rose.contract.wire import encode
from rose.kafka.consumer import TopicPartition, make_consumer
from rose.kafka.producer import make_producer, produce
from rose.scheduler.service import FREEZE_FAULT_ENV
from rose.sim.telemetry_workload import expected_commands, workload
from tests.faults.system import log_records, wait_for
from tests.kafka_checks import OpenTransactions, by_gpu, duplicate_ids, wait_for_commands
from tests.processes import SHUTDOWN_BOUND_S, start_scheduler, terminate_all

pytestmark = pytest.mark.stack


def test_zombie_scheduler_is_fenced(cfg, tmp_path):
    events = workload(24, 240, prefix="z", seed=5)
    env = {
        **os.environ,
        "ROSE_KAFKA_BOOTSTRAP": cfg.kafka.bootstrap,
        "ROSE_KAFKA__TOPIC_PREFIX": cfg.kafka.topic_prefix,
    }

    def feed():
        p = make_producer(cfg.kafka)
        for i in range(0, len(events), 240):
            for ev in events[i : i + 240]:
                produce(p, cfg.kafka.telemetry_topic, encode(ev), ev.gpu)
            p.flush(10)
            time.sleep(0.4)

    logs = {n: tmp_path / f"{n}.log" for n in ("a", "b")}
    # A stops itself (SIGSTOP) inside its third transaction that produced a command, once its
    # records are on the broker: frozen with its transaction open, for certain
    a = start_scheduler({**env, FREEZE_FAULT_ENV: "3"}, "a", logs["a"])
    b = start_scheduler(env, "b", logs["b"])
    k = cfg.kafka
    open_tx = OpenTransactions(k, (k.commands_topic, k.topic("scheduler-state")), f"{k.topic_prefix}zombie-lso")
    feeder = threading.Thread(target=feed)
    try:
        wait_for(lambda: all(owned(log) for log in logs.values()), 90, "both schedulers in the group")
        feeder.start()
        caught = frozen_in_transaction(a, logs["a"], open_tx)  # A froze itself with its batch open
        frozen_at = datetime.now(UTC)
        held_by_a = owned(logs["a"], until=frozen_at)
        # B gets A's partitions once A's group session times out
        wait_for(lambda: held_by_a <= owned(logs["b"]), 60, "B did not take over the partitions of the frozen A")
        thawed_at = datetime.now(UTC)
        a.send_signal(signal.SIGCONT)  # A wakes up as a zombie, its batch still open
        fenced = wait_for(lambda: fence(logs["a"], after=thawed_at), 90, "the thawed A never learned it was fenced")
        feeder.join()
        want = expected_commands(events, cfg.policy)
        n_want = sum(map(len, want.values()))
        got = wait_for_commands(cfg, n_want, timeout_s=90, settle_s=3)
        visible = {tp: lso for tp, lso in caught.items() if first_committed(cfg, tp, lso) == lso}
    finally:
        if feeder.ident is not None:
            feeder.join()
        open_tx.close()
        for p in (a, b):
            p.send_signal(signal.SIGCONT)
        exit_s = terminate_all({"a": a, "b": b})
    dups = duplicate_ids(got)
    print(
        f"\n[zombie] commands expected={n_want} got={len(got)} duplicates={len(dups)}; A frozen with its transaction "
        f"open at {caught}, holding {sorted(held_by_a)}; after the thaw: {fenced['event']} ({fenced.get('error')}); "
        f"exit after SIGTERM {exit_s}"
    )
    assert held_by_a, "A owned no partition when it was frozen: the test would not exercise a zombie"
    assert not visible, f"the zombie's transaction committed: its first records are read_committed at {visible}"
    assert not dups
    assert by_gpu(got) == want
    assert all(t <= SHUTDOWN_BOUND_S for t in exit_s.values()), (
        f"not gone within {SHUTDOWN_BOUND_S}s of SIGTERM: {exit_s}"
    )


# what a scheduler logs when Kafka refuses its stale transaction: its offsets refused because
# its group generation is stale (KIP-447; the batch is dropped and the group rejoined), or its
# producer fenced (the broker aborted the transaction at its timeout and bumped the epoch)
FENCED_EVENTS = ("group.rejoin", "scheduler.client_replaced")
FENCED_ERRORS = ("UNKNOWN_MEMBER_ID", "ILLEGAL_GENERATION", "FENCED")


def frozen_in_transaction(proc, log: Path, open_tx: OpenTransactions) -> dict[tuple[str, int], int]:
    """Wait until `proc` has stopped itself inside a transaction (FREEZE_FAULT_ENV), then the
    first offset of its open transaction per partition: the ranges still open at the same LSO
    2 s later (the other scheduler commits its own within milliseconds; the frozen one's stays
    open until the broker aborts it at the transaction timeout, 10 s after it began)."""
    ps = psutil.Process(proc.pid)
    wait_for(lambda: any(r.get("event") == "fault.frozen_in_transaction" for r in log_records(log)), 90, "A's freeze")
    wait_for(lambda: ps.status() == psutil.STATUS_STOPPED, 10, "the scheduler did not stop", every=0.01)
    first = {tp: lso for tp, (lso, _) in open_tx().items()}
    time.sleep(2.0)  # (a probe of how long a transaction stays open, not a wait for an event)
    held = {tp: lso for tp, (lso, _) in open_tx().items() if first.get(tp) == lso}
    assert held, f"A froze inside a transaction, yet no range stayed open: {first}"
    return held


def first_committed(cfg, tp: tuple[str, int], offset: int) -> int | None:
    """The offset of the first record a read_committed consumer gets from `offset` on (None if
    it gets none within 10 s): `offset` itself when the record there was committed."""
    c = make_consumer(
        cfg.kafka, f"{cfg.kafka.topic_prefix}zombie-read-{tp[1]}", **{"isolation.level": "read_committed"}
    )
    try:
        c.assign([TopicPartition(tp[0], tp[1], offset)])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is not None and not m.error():
                return m.offset()
        return None
    finally:
        c.close()


def fence(log: Path, after: datetime) -> dict | None:
    """The first line after `after` in which the scheduler says its transaction was refused
    (a transaction aborted for another reason, such as a timeout, is retried and does not count)."""
    for r in log_records(log):
        if r["_at"] <= after:
            continue
        refused = r.get("event") == "transaction.abort" and any(e in str(r.get("error")) for e in FENCED_ERRORS)
        if refused or r.get("event") in FENCED_EVENTS:
            return r
    return None


def owned(log: Path, until: datetime | None = None) -> set[int]:
    """The partitions a scheduler owned at `until` (now if None), from its
    partitions.assigned/revoked log lines."""
    held: set[int] = set()
    for rec in log_records(log):
        if until is not None and rec["_at"] > until:
            break
        if rec.get("event") == "partitions.assigned":
            held |= set(rec["partitions"])
        elif rec.get("event") == "partitions.revoked":
            held -= set(rec["partitions"])
    return held
