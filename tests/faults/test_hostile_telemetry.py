"""Fault: a corpus of hostile telemetry produced to the real telemetry topic while the
scheduler runs. Expectation: each lands in the dlq with a specific reason, the scheduler
stays up, no partition stalls, and the valid events interleaved with them are decided
exactly as if the hostile ones had never been sent (no lease changed by them)."""

from __future__ import annotations

import time

import orjson
import pytest

from rose.contract.wire import encode
from rose.kafka.consumer import header, read_all
from rose.kafka.producer import make_producer, produce
from rose.scheduler.service import Scheduler
from rose.sim.telemetry_workload import expected_commands, workload

pytestmark = pytest.mark.stack


def hostile_corpus(valid: dict) -> list[tuple[str, bytes, str]]:
    """(name, value bytes, expected words in the dlq reason)."""

    def mut(**over):
        return orjson.dumps({**valid, **over})

    missing = dict(valid)
    del missing["latency_ms"]
    now = valid["ts"]
    return [
        ("invalid json", b'{"schema": "rose.telemetry.v1", ', "invalid JSON"),
        ("not an object", b"[1, 2, 3]", "expected JSON object"),
        ("binary garbage", bytes(range(256)), "invalid JSON"),
        ("wrong type", mut(gpu_util="high"), "expected number"),
        ("wrong nested type", mut(latency_ms={"ttft_p99": "x", "tpot_p99": 1}), "expected number"),
        ("missing field", orjson.dumps(missing), "missing required field"),
        (
            "NaN literal",
            orjson.dumps(valid).replace(b'"rps":' + orjson.dumps(valid["rps"]), b'"rps":NaN'),
            "invalid JSON",
        ),
        (
            "Infinity literal",
            orjson.dumps(valid).replace(b'"rps":' + orjson.dumps(valid["rps"]), b'"rps":Infinity'),
            "invalid JSON",
        ),
        ("negative memory", mut(mem_used_bytes=-5), "outside"),
        ("absurd memory", mut(mem_total_bytes=1 << 62, mem_used_bytes=1 << 61), "outside"),
        ("used above total", mut(mem_used_bytes=valid["mem_total_bytes"] + 1), "exceeds mem_total_bytes"),
        ("huge string", mut(node="n" * 100_000), "longer than"),
        ("unknown schema version", mut(schema="rose.telemetry.v2"), "expected 'rose.telemetry.v1'"),
        ("ts far in the future", mut(ts=now + 10 * 365 * 86400), "from the record time"),
        ("ts far in the past", mut(ts=now - 10 * 365 * 86400), "from the record time"),
        ("zero SLO", mut(slo_ms={"ttft_p99": 0, "tpot_p99": 50}), "outside"),
        ("10 MB value", b'{"pad": "' + b"x" * (10 << 20) + b'"}', "exceeds"),
    ]


def test_hostile_telemetry_lands_in_dlq_and_changes_no_lease(cfg):
    gpus = 4
    events = workload(gpus, 60, prefix="h", seed=2)
    valid = events[0].to_dict()
    corpus = hostile_corpus(valid)
    p = make_producer(cfg.kafka, **{"message.max.bytes": 17 << 20})
    n_hostile = 0
    for i, ev in enumerate(events):
        produce(p, cfg.kafka.telemetry_topic, encode(ev), ev.gpu)
        if i % 12 == 5 and n_hostile < len(corpus):
            name, value, _ = corpus[n_hostile]
            produce(p, cfg.kafka.telemetry_topic, value, f"h/{n_hostile % gpus}", [("corpus", name.encode())])
            n_hostile += 1
    for name, value, _ in corpus[n_hostile:]:
        produce(p, cfg.kafka.telemetry_topic, value, "h/0", [("corpus", name.encode())])
    # a duplicate of a valid event: ignored by the policy, kept in the dlq with its reason
    produce(p, cfg.kafka.telemetry_topic, encode(events[-1]), events[-1].gpu, [("corpus", b"duplicate event id")])
    assert p.flush(60) == 0

    s = Scheduler(cfg, instance="hostile")
    total = len(events) + len(corpus) + 1
    try:
        s.start()
        deadline = time.monotonic() + 90
        while s.stats.events < total and time.monotonic() < deadline:
            s.step(0.2)
        assert s.stats.events == total, "every message consumed: no partition stalled"
    finally:
        s.close()

    dlq = {header(m, "corpus").decode(): m for m in read_all(cfg.kafka, [cfg.kafka.dlq_topic])}
    print()
    for name, value, words in corpus:
        assert name in dlq, f"{name} did not reach the dlq"
        m = dlq[name]
        reason = header(m, "rose.dlq.reason").decode()
        print(f"[hostile] {name:24s} -> {header(m, 'rose.dlq.field').decode():18s} {reason[:90]}")
        assert words in reason, (name, reason)
        assert m.value() == value, f"{name}: original bytes not kept"
        assert header(m, "rose.dlq.topic").decode() == cfg.kafka.telemetry_topic
    assert "duplicate" in header(dlq["duplicate event id"], "rose.dlq.reason").decode()
    got: dict[str, list] = {}
    for m in read_all(cfg.kafka, [cfg.kafka.commands_topic]):
        c = orjson.loads(m.value())
        got.setdefault(c["gpu"], []).append(c)
    want = expected_commands(events, cfg.policy)
    assert sum(map(len, want.values())) > 0
    assert got == want, "hostile input changed a lease decision"
