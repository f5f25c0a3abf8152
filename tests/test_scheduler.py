"""The scheduler service on the real Kafka broker: decisions equal the pure policy's,
exactly once (also across SIGKILLs), bad input to the dlq, trace context carried."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import orjson
import pytest

from rose.contract.wire import encode
from rose.kafka.consumer import header, read_all
from rose.kafka.producer import make_producer, produce, produce_event
from rose.sim.telemetry_workload import expected_commands, workload
from tests.examples import telemetry_example
from tests.kafka_checks import by_gpu, commands, duplicate_ids, run_scheduler_until, wait_for_commands
from tests.processes import SHUTDOWN_BOUND_S, terminate_all

pytestmark = pytest.mark.stack


def _produce(cfg, events, extra=()):
    p = make_producer(cfg.kafka)
    for ev in events:
        produce_event(p, cfg.kafka.telemetry_topic, ev)
    for value, key in extra:
        produce(p, cfg.kafka.telemetry_topic, value, key)
    assert p.flush(30) == 0


def test_commands_equal_the_pure_policy_and_bad_input_goes_to_dlq(cfg):
    events = workload(6, 120, prefix="eq")
    bad = [(b"{not json", b"eq/0"), (orjson.dumps({**telemetry_example(gpu="eq/1").to_dict(), "gpu_util": 7}), b"eq/1")]
    _produce(cfg, events, bad)
    run_scheduler_until(cfg, "eq", len(events) + len(bad))
    got = by_gpu(commands(cfg))
    want = expected_commands(events, cfg.policy)
    assert sum(map(len, want.values())) > 10, "workload must make the policy act"
    assert got == want
    dlq = read_all(cfg.kafka, [cfg.kafka.dlq_topic])
    reasons = sorted(header(m, "rose.dlq.reason").decode() for m in dlq)
    assert len(dlq) == 2
    assert any("invalid JSON" in r for r in reasons)
    assert any("outside [0.0, 1.0]" in r for r in reasons)
    assert {header(m, "rose.dlq.field") for m in dlq} == {b"$", b"gpu_util"}
    assert sorted(m.value() for m in dlq) == sorted(v for v, _ in bad)


def test_restart_rebuilds_the_view_and_continues_identically(cfg):
    events = workload(4, 160, prefix="rs")
    half = len(events) // 2
    _produce(cfg, events[:half])
    run_scheduler_until(cfg, "rs-a", half)
    _produce(cfg, events[half:])
    stats = run_scheduler_until(cfg, "rs-b", len(events) - half)  # another instance takes over
    assert stats.events == len(events) - half, "the new instance resumed from committed offsets"
    assert by_gpu(commands(cfg)) == expected_commands(events, cfg.policy)


def test_sigkill_under_load_loses_and_duplicates_nothing(cfg, tmp_path):
    """Fault: SIGKILL of the scheduler process at random points while telemetry keeps
    arriving. Expectation: commands read with read_committed equal the pure policy's,
    each exactly once. Counted: kills, commands committed at each kill, duplicates."""
    import threading

    events = workload(40, 200, prefix="kill", seed=11)
    feeder = threading.Thread(
        target=lambda: [_produce(cfg, events[i : i + 200]) or time.sleep(0.5) for i in range(0, len(events), 200)]
    )
    feeder.start()  # 40 batches over ~20 s: the scheduler dies while work arrives
    env = {
        **os.environ,
        "ROSE_KAFKA_BOOTSTRAP": cfg.kafka.bootstrap,
        "ROSE_KAFKA__TOPIC_PREFIX": cfg.kafka.topic_prefix,
        "ROSE_KAFKA__PARTITIONS": str(cfg.kafka.partitions),
    }
    cmd = [sys.executable, "-m", "rose", "scheduler", "--instance", "k", "--log-level", "WARNING"]
    rng = random.Random(3)
    at_kill = []
    for round_ in range(4):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"s{round_}.log", "wb"))
        time.sleep(rng.uniform(3.0, 5.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        at_kill.append(len(commands(cfg)))
    feeder.join()
    proc = subprocess.Popen(
        cmd + ["--duration", "120"], env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "final.log", "wb")
    )
    want = expected_commands(events, cfg.policy)
    n_want = sum(map(len, want.values()))
    got = wait_for_commands(cfg, n_want)
    exit_s = terminate_all({"scheduler": proc})
    dups = duplicate_ids(got)
    print(
        f"\n[sigkill] kills={len(at_kill)} committed-at-each-kill={at_kill} events={len(events)} "
        f"commands expected={n_want} got={len(got)} duplicates={len(dups)}"
    )
    assert at_kill[-1] < n_want, "the kills must land before the work is done"
    assert not dups
    assert by_gpu(got) == want
    assert exit_s["scheduler"] <= SHUTDOWN_BOUND_S, exit_s


def test_trace_context_flows_from_telemetry_to_command(cfg):
    import dataclasses

    from opentelemetry import trace

    from rose.obs.tracing import extract_context, inject_headers, memory_exporter, setup_tracing

    setup_tracing(dataclasses.replace(cfg.tracing, exporter="memory"))
    exp = memory_exporter()
    exp.clear()
    tr = trace.get_tracer("test.agent")
    events = workload(1, 5, prefix="tr")
    p = make_producer(cfg.kafka)
    with tr.start_as_current_span("telemetry.publish") as span:
        trace_id = span.get_span_context().trace_id
        for ev in events:
            produce(p, cfg.kafka.telemetry_topic, encode(ev), ev.gpu, inject_headers())
    p.flush(10)
    run_scheduler_until(cfg, "tr", len(events))
    msgs = read_all(cfg.kafka, [cfg.kafka.commands_topic])
    assert msgs, "the calm workload must grant"
    ctx = extract_context(msgs[0].headers())
    # the executor side: its span joins the same trace through the command's headers
    with tr.start_as_current_span("lease.apply", context=ctx) as apply_span:
        assert apply_span.get_span_context().trace_id == trace_id
    first_id = orjson.loads(msgs[0].value())["command_id"]
    spans = {s.name: s for s in exp.get_finished_spans()}
    decide = next(
        s for s in exp.get_finished_spans() if s.name == "lease.decide" and s.attributes["rose.command_id"] == first_id
    )
    assert decide.context.trace_id == trace_id
    assert decide.parent is not None
    assert decide.attributes["rose.kind"] == "grant"
    assert "rose.headroom.tpot_p99" in decide.attributes
    by_id = {s.context.span_id: s for s in exp.get_finished_spans()}
    assert by_id[decide.parent.span_id].name == f"process {cfg.kafka.telemetry_topic}"
    # the command carries the context of its `send` span, a child of lease.decide
    send = by_id[spans["lease.apply"].parent.span_id]
    assert send.name == f"send {cfg.kafka.commands_topic}" and send.parent.span_id == decide.context.span_id


def test_commands_carry_trace_context_without_an_exporter(cfg):
    """docs/contract.md §3.3: every message carries W3C trace context, whether traces are exported or not."""
    events = workload(2, 8, prefix="tc")
    p = make_producer(cfg.kafka)
    for ev in events:
        produce(p, cfg.kafka.telemetry_topic, encode(ev), ev.gpu)  # no traceparent from the agent
    p.flush(10)
    run_scheduler_until(cfg, "tc", len(events))
    msgs = read_all(cfg.kafka, [cfg.kafka.commands_topic])
    assert msgs
    for m in msgs:
        tp = header(m, "traceparent")
        assert tp is not None and len(tp.split(b"-")) == 4


def test_the_scheduler_stays_up_while_the_broker_cannot_be_reached(cfg):
    """A client that cannot start (no broker answers: init_transactions times out) is
    retried, not fatal: the scheduler outlives an outage of any length."""
    import dataclasses

    from rose.scheduler.supervisor import RESTARTS, run_scheduler
    from rose.stack import free_port

    dead = dataclasses.replace(
        cfg,
        kafka=dataclasses.replace(
            cfg.kafka, bootstrap=f"127.0.0.1:{free_port()}", librdkafka={**cfg.kafka.librdkafka, "log_level": "0"}
        ),
    )
    before = RESTARTS.value()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        stats = run_scheduler(dead, "unreachable", max_seconds=12)  # raised before: the process died
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert RESTARTS.value() - before >= 1, "the client never failed: was a broker reachable?"
    assert stats.events == 0
