"""SpanPlan: spans recorded after their messages were sent, under the ids those messages carry."""

from __future__ import annotations

import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

from rose.config import TracingConfig
from rose.obs.tracing import SpanPlan, adopt, can_plan_spans, memory_exporter, setup_tracing, tracer


class _Msg:
    """A consumed message, as much of it as a `process` span reads."""

    def __init__(self, headers):
        self._headers = headers

    def headers(self):
        return self._headers

    def topic(self):
        return "p.telemetry"

    def key(self):
        return b"g/0"

    def partition(self):
        return 3

    def offset(self):
        return 42


def _ids(headers) -> tuple[str, str, str]:
    _, trace_id, span_id, flags = dict(headers)["traceparent"].decode().split("-")
    return trace_id, span_id, flags


def _spans():
    setup_tracing(TracingConfig(exporter="memory"))
    exp = memory_exporter()
    assert exp is not None
    exp.clear()
    return exp


def test_planned_spans_carry_the_ids_their_messages_were_sent_with():
    exp = _spans()
    tr = tracer("test.plan")
    assert can_plan_spans(tr)
    carried = [("traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"), ("tracestate", b"k=v")]
    plan = SpanPlan(_Msg(carried), time.time_ns())
    sent = [plan.child("lease.decide", {"rose.kind": k}, "p.commands", "g/0", 1) for k in ("grant", "throttle")]
    plan.end_ns = time.time_ns()
    assert exp.get_finished_spans() == (), "nothing is recorded before record()"
    seen = []
    plan.record(tr, "group", seen.append)
    assert seen == [0, 1]
    spans = {s.context.span_id: s for s in exp.get_finished_spans()}
    process = next(s for s in spans.values() if s.name == "process p.telemetry")
    assert format(process.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert format(process.parent.span_id, "016x") == "b7ad6b7169203331"
    assert process.attributes["messaging.kafka.offset"] == 42
    for headers, kind in zip(sent, ("grant", "throttle"), strict=True):
        trace_id, span_id, flags = _ids(headers)
        assert trace_id == "0af7651916cd43dd8448eb211c80319c" and flags == "01"
        assert dict(headers)["tracestate"] == b"k=v"
        send = spans[int(span_id, 16)]  # the span the message names is recorded, with that id
        decide = spans[send.parent.span_id]
        assert send.name == "send p.commands" and decide.name == "lease.decide"
        assert decide.attributes["rose.kind"] == kind and decide.parent.span_id == process.context.span_id


def test_a_message_without_context_starts_the_trace_its_planned_messages_name():
    exp = _spans()
    plan = SpanPlan(_Msg([]), time.time_ns())
    trace_id, span_id, flags = _ids(plan.child("lease.decide", {}, "p.commands", "g/0", None))
    plan.record(tracer("test.plan"), "group")
    spans = exp.get_finished_spans()
    assert {format(s.context.trace_id, "032x") for s in spans} == {trace_id} and flags == "01"
    assert int(span_id, 16) in {s.context.span_id for s in spans}
    assert next(s for s in spans if s.name == "process p.telemetry").parent is None


class _CountingIds(RandomIdGenerator):
    """An application's own id generator: ids it hands out are counted."""

    def __init__(self) -> None:
        self.spans = 0

    def generate_span_id(self) -> int:
        self.spans += 1
        return 0x1000 + self.spans


def test_an_applications_own_provider_is_adopted_keeping_its_ids_for_unplanned_spans():
    from rose.obs import tracing

    own = _CountingIds()
    provider = TracerProvider(id_generator=own)
    exp = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    before = tracing._ids.fallback
    try:
        assert not can_plan_spans(provider.get_tracer("before"))
        adopt(provider)
        tr = provider.get_tracer("after")
        assert can_plan_spans(tr)
        tr.start_span("unplanned").end()
        assert exp.get_finished_spans()[0].context.span_id == 0x1001, "its own generator's id"
        plan = SpanPlan(_Msg([]), time.time_ns())
        headers = plan.child("lease.decide", {}, "p.commands", "g/0", 1)
        plan.record(tr, "group")
        trace_id, span_id, _ = _ids(headers)
        send = next(s for s in exp.get_finished_spans() if s.name == "send p.commands")
        assert (format(send.context.trace_id, "032x"), format(send.context.span_id, "016x")) == (trace_id, span_id)
    finally:
        tracing._ids.fallback = before
