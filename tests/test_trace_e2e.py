"""One trace across the whole lease path, over the real broker: the agent's telemetry span →
the scheduler's `lease.decide` → the executor's `lease.apply` on command receipt."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from opentelemetry import trace

from rose.executor.service import Executor
from rose.scheduler.service import Scheduler
from rose.contract.codec import encode
from rose.kafka.clients import make_producer, produce
from rose.sim.telemetry_workload import workload
from rose.obs.tracing import inject_headers, memory_exporter, setup_tracing

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
        with trace.get_tracer("rose.agent").start_as_current_span("telemetry.publish") as span:
            trace_id = span.get_span_context().trace_id
            for ev in events:
                produce(p, cfg.kafka.telemetry_topic, encode(ev), ev.gpu, inject_headers())
        p.flush(10)
        s.start()
        deadline = time.monotonic() + 60
        applied = []
        while time.monotonic() < deadline and not applied:
            s.step(0.1)
            applied = [sp for sp in exp.get_finished_spans()
                       if sp.name == "lease.apply" and sp.context.trace_id == trace_id]
            time.sleep(0.05)
    finally:
        stop.set()
        t.join(10)
        ex.shutdown()
        s.close()
    spans = [sp for sp in exp.get_finished_spans() if sp.context.trace_id == trace_id]
    names = {sp.name for sp in spans}
    assert {"telemetry.publish", "lease.decide", "lease.apply"} <= names, names
    by_id = {sp.context.span_id: sp for sp in spans}
    apply_ = applied[0]
    decide = by_id[apply_.parent.span_id]
    assert decide.name == "lease.decide"
    assert by_id[decide.parent.span_id].name == "telemetry.publish"
