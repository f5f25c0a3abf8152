"""OpenTelemetry set-up and W3C trace context in Kafka headers.

Every Kafka message ROSE produces carries `traceparent` (and `tracestate`) so a lease
decision, the telemetry that caused it and the executor that obeyed it share one trace.
Sending and processing a message are spans after OpenTelemetry's messaging conventions for
Kafka: `send {topic}` (PRODUCER) around handing a message to the client, its context in the
message's headers; `process {topic}` (CONSUMER) around using one, a child of and linked to
that context (`send_span`, `process_span`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from rose.config import ConfigError, TracingConfig

_propagator = TraceContextTextMapPropagator()


class _PresetIds(RandomIdGenerator):
    """Random ids (or a provider's own generator's, `fallback`), except the next span's (and
    trace's) when preset on this thread: lets a span be recorded after the message carrying its
    context was sent (`SpanPlan`)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.fallback: IdGenerator | None = None

    def preset(self, span_id: int, trace_id: int | None) -> None:
        self._local.span_id, self._local.trace_id = span_id, trace_id

    def generate_span_id(self) -> int:
        v = getattr(self._local, "span_id", None)
        self._local.span_id = None
        if v is not None:
            return v
        return self.fallback.generate_span_id() if self.fallback else super().generate_span_id()

    def generate_trace_id(self) -> int:
        v = getattr(self._local, "trace_id", None)
        self._local.trace_id = None
        if v is not None:
            return v
        return self.fallback.generate_trace_id() if self.fallback else super().generate_trace_id()


_ids = _PresetIds()
_memory_exporter: InMemorySpanExporter | None = None
_fresh = RandomIdGenerator()  # ids of spans planned before they are recorded, and of unsampled messages


def setup_tracing(tcfg: TracingConfig, service: str | None = None) -> TracerProvider:
    """Install (or extend) the SDK tracer provider with the configured exporter
    (none, console, otlp, memory). OpenTelemetry allows one global provider per process, so
    a provider already installed gets the exporter added rather than being replaced."""
    global _memory_exporter
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider(
            resource=Resource.create({"service.name": service or tcfg.service_name}), id_generator=_ids
        )
        trace.set_tracer_provider(provider)
    adopt(provider)
    if tcfg.exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif tcfg.exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=tcfg.otlp_endpoint)))
    elif tcfg.exporter == "memory":
        if _memory_exporter is None:
            _memory_exporter = InMemorySpanExporter()
            provider.add_span_processor(SimpleSpanProcessor(_memory_exporter))
    elif tcfg.exporter != "none":
        raise ConfigError(f"tracing.exporter: unknown exporter {tcfg.exporter!r} (none|console|otlp|memory)")
    return provider


def ensure_provider() -> None:
    """Install an SDK tracer provider (exporting nothing) unless one is set, so spans get
    real ids and every message still carries W3C trace context (docs/contract.md §3.3) when no
    exporter is configured or setup_tracing was never called."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        trace.set_tracer_provider(TracerProvider(resource=Resource.create({"service.name": "rose"}), id_generator=_ids))
    else:
        adopt(provider)


def adopt(provider: TracerProvider) -> None:
    """Let an application's own SDK provider take preset ids, so its tracers (got after this)
    record planned spans (`SpanPlan`) too: its ids stay its own generator's otherwise."""
    if provider.id_generator is not _ids:
        _ids.fallback, provider.id_generator = provider.id_generator, _ids


def memory_exporter() -> InMemorySpanExporter | None:
    """The in-memory exporter installed by setup_tracing(exporter='memory'), for tests."""
    return _memory_exporter


def tracer(name: str = "rose") -> trace.Tracer:
    return trace.get_tracer(name)


# a Kafka message's headers, or an HTTP request's as ASGI gives them (names in bytes, lower case)
_Carrier = Sequence[tuple[str | bytes, bytes | str | None]]


def _text(s: str | bytes) -> str:
    return s.decode("latin-1") if isinstance(s, bytes) else s


class _HeaderGetter(Getter[_Carrier]):
    def get(self, carrier: _Carrier, key: str) -> list[str] | None:
        for k, v in carrier or []:
            if _text(k) == key:
                return [v.decode("latin-1") if isinstance(v, bytes) else str(v)]
        return None

    def keys(self, carrier: _Carrier) -> list[str]:
        return [_text(k) for k, _ in carrier or []]


_getter = _HeaderGetter()


def extract_context(headers) -> otel_context.Context:
    """The trace context carried in a Kafka message's headers, or an ASGI request's (empty if none)."""
    return _propagator.extract(headers or [], getter=_getter)


def inject_headers(ctx: otel_context.Context | None = None) -> list[tuple[str, bytes]]:
    """traceparent/tracestate headers for the current (or given) span context."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=ctx)
    return [(k, v.encode()) for k, v in carrier.items()]


def unsampled_headers(carried) -> list[tuple[str, bytes]]:
    """A `traceparent` (W3C, flags 00: not sampled) for a message whose spans were sampled
    out: the trace id of the context in `carried` (a consumed message's headers), else a new
    one, and a fresh span id. Costs no span; a consumer downstream still joins the trace."""
    sc = trace.get_current_span(extract_context(carried)).get_span_context()
    trace_id = sc.trace_id if sc.is_valid else _fresh.generate_trace_id()
    return [("traceparent", f"00-{trace_id:032x}-{_fresh.generate_span_id():016x}-00".encode())]


def _messaging(operation: str, topic: str, key, partition: int | None) -> dict:
    attrs = {
        "messaging.system": "kafka",
        "messaging.operation.type": operation,
        "messaging.operation.name": operation,
        "messaging.destination.name": topic,
    }
    if partition is not None and partition >= 0:
        attrs["messaging.destination.partition.id"] = str(partition)
    if key is not None:
        attrs["messaging.kafka.message.key"] = key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)
    return attrs


def send_span(
    tr: trace.Tracer,
    topic: str,
    *,
    key: str | bytes | None = None,
    partition: int | None = None,
    batch: int | None = None,
):
    """`send {topic}` (kind PRODUCER), current while a message (or a batch of `batch`) is
    handed to the producer; `inject_headers()` inside it carries its context in the message."""
    attrs = _messaging("send", topic, key, partition)
    if batch is not None:
        attrs["messaging.batch.message_count"] = batch
    return tr.start_as_current_span(f"send {topic}", kind=SpanKind.PRODUCER, attributes=attrs)


def _process_attrs(msg, group: str) -> dict:
    attrs = _messaging("process", msg.topic(), msg.key(), msg.partition())
    attrs["messaging.kafka.offset"] = msg.offset()
    attrs["messaging.consumer.group.name"] = group
    return attrs


def process_span(tr: trace.Tracer, msg, group: str, *, start_time: int | None = None):
    """`process {topic}` (kind CONSUMER) around using one consumed message: a child of the
    producer's context carried in its headers, and linked to it (a root span when it carries
    none). `start_time` (ns since the epoch) when the processing began before the span."""
    parent = extract_context(msg.headers())
    sc = trace.get_current_span(parent).get_span_context()
    return tr.start_as_current_span(
        f"process {msg.topic()}",
        context=parent,
        kind=SpanKind.CONSUMER,
        links=[Link(sc)] if sc.is_valid else None,
        attributes=_process_attrs(msg, group),
        start_time=start_time,
    )


def can_plan_spans(tr: trace.Tracer) -> bool:
    """Whether `tr` takes preset ids (a provider installed by `setup_tracing`/`ensure_provider`),
    which `SpanPlan` needs to record spans under ids already sent."""
    return getattr(tr, "id_generator", None) is _ids


class SpanPlan:
    """The spans of using one consumed message that caused messages of its own: `process` over
    it, and per caused message a child span (its why) and that one's `send` span. Every id is
    chosen when the message is planned, so the caused messages carry their `send` context when
    produced; the spans are recorded later (`record`). For a transaction, whose messages become
    visible only at its commit, the spans then cost nothing on the way to it, and an aborted
    attempt records none."""

    __slots__ = ("msg", "start_ns", "end_ns", "trace_id", "parent_valid", "flags", "state", "process_id", "children")

    def __init__(self, msg, start_ns: int):
        sc = trace.get_current_span(extract_context(msg.headers())).get_span_context()
        self.msg, self.start_ns, self.end_ns = msg, start_ns, start_ns
        self.parent_valid = sc.is_valid
        self.trace_id = sc.trace_id if sc.is_valid else _fresh.generate_trace_id()
        # the default sampler follows a parent's decision and samples a new trace
        self.flags = "01" if not sc.is_valid or sc.trace_flags.sampled else "00"
        self.state = sc.trace_state.to_header() if sc.is_valid and sc.trace_state else ""
        self.process_id = _fresh.generate_span_id()
        self.children: list[tuple[int, int, str, dict, str, str, int | None, int]] = []

    def child(
        self, name: str, attributes: dict, topic: str, key: str, partition: int | None
    ) -> list[tuple[str, bytes]]:
        """Plan a child span and its `send {topic}`; the headers for the message it sends."""
        child_id, send_id = _fresh.generate_span_id(), _fresh.generate_span_id()
        self.children.append((child_id, send_id, name, attributes, topic, key, partition, time.time_ns()))
        headers = [("traceparent", f"00-{self.trace_id:032x}-{send_id:016x}-{self.flags}".encode())]
        if self.state:
            headers.append(("tracestate", self.state.encode()))
        return headers

    def record(self, tr: trace.Tracer, group: str, each: Callable[[int], None] | None = None) -> None:
        """Record the planned spans under their planned ids; `each(i)` runs with the i-th child
        span current (a log line then carries its ids)."""
        parent = extract_context(self.msg.headers())
        sc = trace.get_current_span(parent).get_span_context()
        _ids.preset(self.process_id, None if self.parent_valid else self.trace_id)
        process = tr.start_span(
            f"process {self.msg.topic()}",
            context=parent,
            kind=SpanKind.CONSUMER,
            links=[Link(sc)] if sc.is_valid else None,
            attributes=_process_attrs(self.msg, group),
            start_time=self.start_ns,
        )
        in_process = trace.set_span_in_context(process)
        for i, (child_id, send_id, name, attrs, topic, key, partition, at) in enumerate(self.children):
            _ids.preset(child_id, None)
            child = tr.start_span(name, context=in_process, attributes=attrs, start_time=at)
            _ids.preset(send_id, None)
            send = tr.start_span(
                f"send {topic}",
                context=trace.set_span_in_context(child),
                kind=SpanKind.PRODUCER,
                attributes=_messaging("send", topic, key, partition),
                start_time=at,
            )
            send.end(end_time=at)
            if each is not None:
                with trace.use_span(child, end_on_exit=False):
                    each(i)
            child.end(end_time=max(at, self.end_ns))
        process.end(end_time=self.end_ns)


def trace_ids() -> dict[str, str]:
    """trace_id/span_id of the current span as hex, for log lines."""
    sc = trace.get_current_span().get_span_context()
    if not sc.is_valid:
        return {}
    return {"trace_id": format(sc.trace_id, "032x"), "span_id": format(sc.span_id, "016x")}


# ---- W3C trace context as a string, and the task queue's spans ---------------------------------
def traceparent(ctx: otel_context.Context | None = None) -> str:
    """The W3C `traceparent` of the current (or given) span context; "" when there is none."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=ctx)
    return carrier.get("traceparent", "")


def context_of(tp: str) -> otel_context.Context:
    """The context a `traceparent` string carries (empty when it is "" or malformed)."""
    return _propagator.extract({"traceparent": tp} if tp else {})


def span_context_of(tp: str) -> trace.SpanContext:
    """The span context a `traceparent` string names (not `is_valid` when it is "" or malformed)."""
    return trace.get_current_span(context_of(tp)).get_span_context()


def carried_traceparent(headers) -> str:
    """The `traceparent` a Kafka message's headers carry, checked and rewritten ("" if none)."""
    return traceparent(extract_context(headers))


def _queue_attrs(operation: str, stream: str) -> dict:
    return {
        "messaging.system": "redis",
        "messaging.operation.type": operation,
        "messaging.operation.name": operation,
        "messaging.destination.name": stream,
    }


def queue_send_span(tr: trace.Tracer, stream: str, attributes: dict | None = None):
    """`send {stream}` (kind PRODUCER) around putting one task on a Redis stream of the task
    queue; `traceparent()` inside it is the context the task carries."""
    return tr.start_as_current_span(
        f"send {stream}", kind=SpanKind.PRODUCER, attributes={**_queue_attrs("send", stream), **(attributes or {})}
    )


def queue_process_span(
    tr: trace.Tracer, stream: str, group: str, carried: str, links: Sequence[Link] = (), attributes: dict | None = None
) -> trace.Span | None:
    """`process {stream}` (kind CONSUMER) for one task taken from a task-queue stream: started,
    not made current (the caller ends it), a child of and linked to the context the task carries
    (`carried`, a `traceparent`), plus `links`. None when the task carries no context."""
    parent = context_of(carried)
    sc = trace.get_current_span(parent).get_span_context()
    if not sc.is_valid:
        return None
    attrs = {**_queue_attrs("process", stream), "messaging.consumer.group.name": group, **(attributes or {})}
    return tr.start_span(
        f"process {stream}", context=parent, kind=SpanKind.CONSUMER, links=[Link(sc), *links], attributes=attrs
    )


def flush_tracing(timeout_ms: int = 5000) -> None:
    """Export the spans still buffered (before a process leaves with os._exit)."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.force_flush(timeout_ms)
