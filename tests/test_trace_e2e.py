"""One trace across the whole lease path, over the real broker: the agent's telemetry span →
its `send` → the scheduler's `process` → `lease.decide` → `send` of the command → the
executor's `process` → `lease.apply` on command receipt → `send` of the lease state. Sending
and processing follow OpenTelemetry's messaging conventions for Kafka."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from rose.contract.wire import encode
from rose.executor.partitions import command_group
from rose.executor.service import Executor
from rose.kafka.producer import make_producer, partition_for, produce
from rose.obs.tracing import inject_headers, memory_exporter, send_span, setup_tracing
from rose.scheduler.service import Scheduler
from rose.sim.telemetry_workload import workload

pytestmark = pytest.mark.stack


def test_one_trace_from_telemetry_to_executor(cfg, tmp_path):
    cfg = dataclasses.replace(cfg, executor=dataclasses.replace(cfg.executor, latency_dir=str(tmp_path)))
    setup_tracing(dataclasses.replace(cfg.tracing, exporter="memory"))
    exp = memory_exporter()
    exp.clear()
    ex = Executor(cfg, ["e2e/0"], guard=False).start()
    stop = threading.Event()
    t = threading.Thread(target=lambda: [ex.run_once(0.02) for _ in iter(stop.is_set, True)], daemon=True)
    t.start()
    s = Scheduler(cfg, instance="e2e")
    try:
        events = [ev for ev in workload(1, 6, prefix="e2e")]
        p = make_producer(cfg.kafka)
        agent = trace.get_tracer("rose.agent")
        with agent.start_as_current_span("telemetry.publish") as span:
            trace_id = span.get_span_context().trace_id
            for ev in events:
                with send_span(agent, cfg.kafka.telemetry_topic, key=ev.gpu):
                    produce(p, cfg.kafka.telemetry_topic, encode(ev), ev.gpu, inject_headers())
        p.flush(10)
        s.start()
        deadline = time.monotonic() + 60
        applied = []
        while time.monotonic() < deadline and not applied:
            s.step(0.1)
            applied = [
                sp for sp in exp.get_finished_spans() if sp.name == "lease.apply" and sp.context.trace_id == trace_id
            ]
            time.sleep(0.05)
    finally:
        stop.set()
        t.join(10)
        ex.shutdown()
        s.close()
    k = cfg.kafka
    spans = [sp for sp in exp.get_finished_spans() if sp.context.trace_id == trace_id]
    names = {sp.name for sp in spans}
    assert {
        "telemetry.publish",
        f"send {k.telemetry_topic}",
        f"process {k.telemetry_topic}",
        "lease.decide",
        f"send {k.commands_topic}",
        f"process {k.commands_topic}",
        "lease.apply",
        f"send {k.lease_state_topic}",
    } <= names, names
    by_id = {sp.context.span_id: sp for sp in spans}

    def parent(sp):
        assert sp.parent is not None, sp.name
        return by_id[sp.parent.span_id]

    def consumer_of(sp, producer):
        """`process` (CONSUMER): a child of the producer's `send` span, and linked to it."""
        assert sp.kind == SpanKind.CONSUMER and parent(sp) is producer, (sp.name, parent(sp).name)
        assert [lk.context.span_id for lk in sp.links] == [producer.context.span_id], sp.links
        a = sp.attributes
        assert a["messaging.system"] == "kafka" and a["messaging.operation.type"] == "process"
        assert a["messaging.destination.name"] == producer.attributes["messaging.destination.name"]
        assert a["messaging.kafka.message.key"] == producer.attributes["messaging.kafka.message.key"]
        assert int(a["messaging.destination.partition.id"]) in range(k.partitions)
        assert isinstance(a["messaging.kafka.offset"], int) and a["messaging.kafka.offset"] >= 0

    def producer_of(sp, topic, key):
        assert sp.name == f"send {topic}" and sp.kind == SpanKind.PRODUCER, sp.name
        a = sp.attributes
        assert a["messaging.system"] == "kafka" and a["messaging.operation.type"] == "send"
        assert a["messaging.destination.name"] == topic and a["messaging.kafka.message.key"] == key

    # the executor: process(commands) → lease.apply → send(lease-state)
    apply_ = applied[0]
    gpu = apply_.attributes["rose.gpu"]
    assert gpu == "e2e/0" and apply_.attributes["rose.kind"] == "grant"
    process_cmd = parent(apply_)
    assert process_cmd.name == f"process {k.commands_topic}"
    assert process_cmd.attributes["messaging.consumer.group.name"] == command_group(["e2e/0"])
    assert process_cmd.attributes["messaging.destination.partition.id"] == str(partition_for(gpu, k.partitions))
    [send_state] = [
        sp
        for sp in spans
        if sp.parent is not None
        and sp.parent.span_id == apply_.context.span_id
        and sp.name == f"send {k.lease_state_topic}"
    ]
    producer_of(send_state, k.lease_state_topic, gpu)
    assert send_state.attributes["messaging.destination.partition.id"] == str(partition_for(gpu, k.partitions))
    # the scheduler: process(telemetry) → lease.decide → send(commands)
    send_cmd = parent(process_cmd)
    producer_of(send_cmd, k.commands_topic, gpu)
    assert send_cmd.attributes["messaging.destination.partition.id"] == str(partition_for(gpu, k.partitions))
    consumer_of(process_cmd, send_cmd)
    decide = parent(send_cmd)
    assert decide.name == "lease.decide"
    assert decide.attributes["rose.gpu"] == gpu and decide.attributes["rose.kind"] == "grant"
    assert decide.attributes["rose.command_id"] == apply_.attributes["rose.command_id"]
    process_tel = parent(decide)
    assert process_tel.name == f"process {k.telemetry_topic}"
    assert process_tel.attributes["messaging.consumer.group.name"] == f"{k.topic_prefix}rose-scheduler"
    # the agent: telemetry.publish → send(telemetry)
    send_tel = parent(process_tel)
    producer_of(send_tel, k.telemetry_topic, gpu)
    consumer_of(process_tel, send_tel)
    assert parent(send_tel).name == "telemetry.publish"
