"""Small checks on the real broker that several tests share."""

from __future__ import annotations

import time
from collections import Counter

import orjson

from rose.kafka.admin import partitions_of
from rose.kafka.consumer import Consumer, TopicPartition, make_consumer, read_all


def commands(cfg) -> list[dict]:
    """Every committed command, in partition order."""
    return [orjson.loads(m.value()) for m in read_all(cfg.kafka, [cfg.kafka.commands_topic])]


def by_gpu(cmds: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for c in cmds:
        out.setdefault(c["gpu"], []).append(c)
    return out


def duplicate_ids(cmds: list[dict]) -> list[str]:
    """The command ids that `cmds` holds more than once, each once, in first-seen order."""
    return [i for i, n in Counter(c["command_id"] for c in cmds).items() if n > 1]


def wait_for_commands(cfg, n_want: int, timeout_s: float = 120.0, settle_s: float = 2.0) -> list[dict]:
    """Committed commands once at least `n_want` are there, read again after `settle_s` so
    that anything extra (a duplicate) shows up too; whatever is there at the deadline."""
    deadline = time.monotonic() + timeout_s
    got: list[dict] = []
    while time.monotonic() < deadline:
        got = commands(cfg)
        if len(got) >= n_want:
            time.sleep(settle_s)
            return commands(cfg)
        time.sleep(1)
    return got


def consume_one(kcfg, topic: str, group: str, timeout_s: float = 20.0):
    """The first message of `topic` read by a fresh consumer group (None at the deadline)."""
    c = make_consumer(kcfg, group)
    c.subscribe([topic])
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is not None and not m.error():
                return m
        return None
    finally:
        c.close()


def run_scheduler_until(cfg, instance: str, n_events: int, timeout_s: float = 60):
    """An in-process scheduler instance until it has consumed `n_events`; its stats."""
    from rose.scheduler.service import Scheduler

    s = Scheduler(cfg, instance=instance)
    try:
        s.start()
        deadline = time.monotonic() + timeout_s
        while s.stats.events < n_events and time.monotonic() < deadline:
            s.step(0.2)
    finally:
        s.close()
    return s.stats


class OpenTransactions:
    """The records of `topics` not yet committed or aborted: per partition whose last stable
    offset (what read_committed reports) is below its high watermark (read_uncommitted), the
    offsets [LSO, HWM). The LSO is the first record of the partition's oldest open transaction."""

    def __init__(self, kcfg, topics: tuple[str, ...], group: str):
        self.consumers: dict[str, Consumer] = {
            iso: make_consumer(kcfg, f"{group}-{iso}", **{"isolation.level": iso})
            for iso in ("read_committed", "read_uncommitted")
        }
        self.partitions = [TopicPartition(t, p) for t in topics for p in partitions_of(kcfg, t)]

    def __call__(self) -> dict[tuple[str, int], tuple[int, int]]:
        out = {}
        for tp in self.partitions:
            _, lso = self.consumers["read_committed"].get_watermark_offsets(tp, timeout=5, cached=False)
            _, hwm = self.consumers["read_uncommitted"].get_watermark_offsets(tp, timeout=5, cached=False)
            if lso < hwm:
                out[(tp.topic, tp.partition)] = (lso, hwm)
        return out

    def close(self) -> None:
        for c in self.consumers.values():
            c.close()
        self.consumers = {}
