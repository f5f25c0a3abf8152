"""Fault: a corpus of hostile command messages produced to the real commands topic while an
executor holds a lease. Expectation: each lands in the dlq with a specific reason and its
original bytes, the executor stays up, and the lease changes only with the valid commands
around them (active → revoking → revoked). Counted: dlq records per case, lease states."""

from __future__ import annotations

import dataclasses
import threading
import time

import orjson
import pytest

from rose.config import GiB
from rose.contract.wire import encode
from rose.executor.service import Executor
from rose.kafka.consumer import header, read_all
from rose.kafka.producer import make_producer, produce
from tests.examples import command_example

pytestmark = pytest.mark.stack
GPU = "hc/0"


def corpus(valid: dict) -> list[tuple[str, bytes, str]]:
    def mut(**over):
        return orjson.dumps({**valid, **over})

    missing = dict(valid)
    del missing["epoch"]
    return [
        ("invalid json", b'{"schema": "rose.command.v1", "kind": ', "invalid JSON"),
        ("not an object", b'"grant"', "expected JSON object"),
        ("wrong type", mut(epoch="seven"), "expected integer"),
        ("missing field", orjson.dumps(missing), "missing required field"),
        (
            "NaN literal",
            orjson.dumps(valid).replace(
                b'"compute_share":' + orjson.dumps(valid["compute_share"]), b'"compute_share":NaN'
            ),
            "invalid JSON",
        ),
        ("negative memory", mut(mem_bytes=-1), "outside"),
        ("absurd memory", mut(mem_bytes=1 << 60), "outside"),
        ("share above one", mut(compute_share=2.0), "outside"),
        ("unknown kind", mut(kind="steal"), "expected one of"),
        ("unknown schema version", mut(schema="rose.command.v0"), "expected 'rose.command.v1'"),
        ("huge string", mut(reason="r" * 50_000), "longer than"),
        ("gpu differs from key", mut(gpu="hc/9"), "does not match the message key"),
        ("10 MB value", b'{"pad": "' + b"x" * (10 << 20) + b'"}', "exceeds"),
    ]


def test_hostile_commands_land_in_dlq_and_change_no_lease(cfg, tmp_path):
    cfg = dataclasses.replace(
        cfg,
        executor=dataclasses.replace(
            cfg.executor, worker="placeholder", latency_dir=str(tmp_path), revoke_deadline_s=1.0
        ),
    )
    ex = Executor(cfg, [GPU], guard=False).start()
    stop = threading.Event()
    t = threading.Thread(target=lambda: [ex.run_once(0.02) for _ in iter(stop.is_set, True)], daemon=True)
    t.start()
    now = time.time()
    grant = command_example(
        gpu=GPU, lease_id=f"{GPU}#1", epoch=1, ts=now, expires_at=now + 60, mem_bytes=1 * GiB, command_id="hc-grant"
    )
    revoke = dataclasses.replace(grant, kind="revoke", command_id="hc-revoke", mem_bytes=0, compute_share=0.0)
    cases = corpus(grant.to_dict())
    p = make_producer(cfg.kafka, **{"message.max.bytes": 17 << 20})
    try:
        produce(p, cfg.kafka.commands_topic, encode(grant), GPU)
        for name, value, _ in cases:
            produce(p, cfg.kafka.commands_topic, value, GPU, [("corpus", name.encode())])
        produce(p, cfg.kafka.commands_topic, encode(grant), GPU)  # a duplicate: harmless
        produce(p, cfg.kafka.commands_topic, encode(revoke), GPU)
        assert p.flush(30) == 0
        deadline = time.monotonic() + 60
        states = []
        while time.monotonic() < deadline:
            states = [
                orjson.loads(m.value())["state"]
                for m in read_all(cfg.kafka, [cfg.kafka.lease_state_topic])
                if m.key() == GPU.encode()
            ]
            if "revoked" in states:
                break
            time.sleep(0.5)
        alive = t.is_alive()
    finally:
        stop.set()
        t.join(10)
        ex.shutdown()
    dlq = {header(m, "corpus").decode(): m for m in read_all(cfg.kafka, [cfg.kafka.dlq_topic]) if header(m, "corpus")}
    print()
    for name, value, words in cases:
        assert name in dlq, f"{name} did not reach the dlq"
        reason = header(dlq[name], "rose.dlq.reason").decode()
        print(f"[hostile-command] {name:24s} -> {reason[:90]}")
        assert words in reason, (name, reason)
        assert dlq[name].value() == value
    print(f"[hostile-command] lease states: {states}")
    assert alive, "executor loop died"
    assert states == ["active", "revoking", "revoked"], states
