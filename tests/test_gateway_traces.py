"""One trace from a gateway request to the engine that ran it, joined to the lease decision that
granted the engine's GPU: the gateway (in this process, its spans in the in-memory exporter)
opens `POST /v1/...` (SERVER) and `send {stream}` (PRODUCER), whose context the task carries;
two real rollout workers on the reference engine export their `process {stream}` spans (CONSUMER)
over OTLP/HTTP to a receiver this test runs, and each worker's config carries the traceparent of
a lease decision (`lease.decide` → `send {commands}`) recorded here. A turn continued after a
revoke has a second worker span in the same trace."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan

from rose.config import Config, TracingConfig, load_config
from rose.contract.wire import encode
from rose.executor import lease_machine as lm
from rose.executor.service import Executor
from rose.obs.tracing import memory_exporter, send_span, setup_tracing, span_context_of, traceparent, tracer
from rose.rollout.launcher import LeaseRecord, WorkerConfig
from rose.rollout.pause_flag import PauseFlag
from tests.examples import command_example
from tests.test_gateway import (
    JOB,
    MODEL,
    PROMPT,
    free_port,
    launch_workers,
    pause_flags,
    prefixed_gateway_cfg,
    revoke_midway,
    serve,
    sse,
    stop_workers,
    streamed_ids,
)
from tests.test_rollout_tasks import wait_for

COMMANDS = "rose.commands"


@dataclasses.dataclass
class S:
    """A finished span, from either exporter."""

    name: str
    kind: str
    trace_id: int
    span_id: int
    parent: int | None
    attrs: dict
    links: list[tuple[int, int, dict]]
    service: str


def _value(v):
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


class Receiver:
    """An OTLP/HTTP (protobuf) trace receiver on a free port: what the workers export."""

    def __init__(self) -> None:
        self.spans: list[S] = []
        got = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                req = ExportTraceServiceRequest()
                req.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
                for rs in req.resource_spans:
                    service = _attrs(rs.resource.attributes).get("service.name", "")
                    for ss in rs.scope_spans:
                        for sp in ss.spans:
                            got.append(
                                S(
                                    sp.name,
                                    PbSpan.SpanKind.Name(sp.kind).removeprefix("SPAN_KIND_"),
                                    int.from_bytes(sp.trace_id, "big"),
                                    int.from_bytes(sp.span_id, "big"),
                                    int.from_bytes(sp.parent_span_id, "big") if sp.parent_span_id else None,
                                    _attrs(sp.attributes),
                                    [
                                        (
                                            int.from_bytes(lk.trace_id, "big"),
                                            int.from_bytes(lk.span_id, "big"),
                                            _attrs(lk.attributes),
                                        )
                                        for lk in sp.links
                                    ],
                                    service,
                                )
                            )
                body = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _memory_spans() -> list[S]:
    exp = memory_exporter()
    assert exp is not None
    return [
        S(
            sp.name,
            sp.kind.name,
            sp.context.trace_id,
            sp.context.span_id,
            sp.parent.span_id if sp.parent else None,
            dict(sp.attributes or {}),
            [(lk.context.trace_id, lk.context.span_id, dict(lk.attributes or {})) for lk in sp.links],
            "rose-gateway",
        )
        for sp in exp.get_finished_spans()
    ]


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def leases() -> dict[str, tuple[str, str]]:
    """A lease decision per worker, as the scheduler records it: `lease.decide`, then `send` of
    its grant command, whose context the command carries: (lease id, that traceparent)."""
    setup_tracing(TracingConfig(exporter="memory"))
    tr = tracer("rose.scheduler")
    out = {}
    for w in ("w0", "w1"):
        with tr.start_as_current_span("lease.decide", attributes={"rose.gpu": f"sim/{w}", "rose.kind": "grant"}):
            with send_span(tr, COMMANDS, key=f"sim/{w}"):
                out[w] = (f"sim/{w}#3", traceparent())
    return out


@pytest.fixture(scope="module")
def tcfg(stack, base_cfg) -> Iterator[Config]:
    yield from prefixed_gateway_cfg(stack, base_cfg)


@pytest.fixture(scope="module")
def stream(tcfg) -> str:
    """The job's shared task stream (no session, no min_weight_version: every turn goes there)."""
    return tcfg.redis.key("tasks", JOB)


@pytest.fixture(scope="module")
def flags() -> Iterator[dict[str, PauseFlag]]:
    yield from pause_flags("rose-gwt")


@pytest.fixture(scope="module")
def gw(tcfg, flags, leases, receiver):
    env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "50"}  # export a finished span within 50 ms
    tracing = TracingConfig(exporter="otlp", otlp_endpoint=receiver.endpoint)
    procs = launch_workers(
        tcfg,
        flags,
        lambda w: {"tracing": tracing, "lease_id": leases[w][0], "lease_traceparent": leases[w][1]},
        env=env,
    )
    s = serve(tcfg)
    try:
        import httpx

        wait_for(
            lambda: sorted(httpx.get(s.url + "/health").json()["workers_running"]) == sorted(procs),
            90,
            "both workers running",
        )
        yield s
    finally:
        s.stop()
        stop_workers(procs)


def _trace(receiver: Receiver, trace_id: int, workers: int) -> tuple[dict[str, S], list[S]]:
    """The gateway's spans of the trace by name, and its worker spans (waiting for `workers`)."""

    def exported() -> list[S] | None:
        ws = [s for s in list(receiver.spans) if s.trace_id == trace_id and s.service == "rose-worker"]
        return ws if len(ws) >= workers else None

    got = wait_for(exported, 15, f"{workers} worker span(s) exported")
    return {s.name: s for s in _memory_spans() if s.trace_id == trace_id}, got


def _server_span(task_id: str) -> S:
    """The request's SERVER span: it ends once the last byte is sent, just after the client has it."""

    def ended() -> S | None:
        return next((s for s in _memory_spans() if s.attrs.get("rose.task_id") == task_id and s.kind == "SERVER"), None)

    return wait_for(ended, 10, "the request's span")


def _check_chain(gws: dict[str, S], path: str, stream: str, worker: S, leases, client: int | None = None) -> S:
    """server → send → process, and the worker span linked to its task's send and to its lease."""
    server = gws[f"POST {path}"]
    send = gws[f"send {stream}"]
    assert server.kind == "SERVER" and server.parent == client
    assert send.kind == "PRODUCER" and send.parent == server.span_id
    assert (
        send.attrs["messaging.destination.name"] == stream
        and send.attrs["rose.task_id"] == server.attrs["rose.task_id"]
    )
    assert worker.name == f"process {stream}" and worker.kind == "CONSUMER" and worker.parent == send.span_id
    assert worker.attrs["rose.task_id"] == server.attrs["rose.task_id"]
    assert worker.attrs["messaging.destination.name"] == stream and worker.attrs["messaging.system"] == "redis"
    w = worker.attrs["rose.worker_id"]
    lease_id, lease_tp = leases[w]
    lease = span_context_of(lease_tp)
    assert worker.attrs["rose.gpu"] == f"sim/{w}" and worker.attrs["rose.engine"] == "reference"
    assert worker.attrs["rose.lease_id"] == lease_id
    assert worker.attrs["rose.lease.trace_id"] == format(lease.trace_id, "032x")
    links = {(t, s): a for t, s, a in worker.links}
    assert (send.trace_id, send.span_id) in links
    assert links[(lease.trace_id, lease.span_id)]["rose.link"] == "lease.grant"
    # the linked context is the grant command's `send`, a child of `lease.decide`
    decided = {s.span_id: s for s in _memory_spans() if s.trace_id == lease.trace_id}
    grant = decided[lease.span_id]
    assert grant.name == f"send {COMMANDS}" and grant.parent is not None
    assert decided[grant.parent].name == "lease.decide"
    return server


def test_a_request_is_one_trace_from_the_gateway_to_the_engine_joined_to_its_lease(gw, receiver, leases, stream):
    tr = tracer("client")
    with tr.start_as_current_span("client") as root:
        client = root.get_span_context()
        r = gw.client().completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, seed=7, extra_headers={"traceparent": traceparent()}
        )
    ch = r.choices[0]
    gws, [worker] = _trace(receiver, client.trace_id, 1)
    server = _check_chain(gws, "/v1/completions", stream, worker, leases, client.span_id)
    a = server.attrs
    assert a["gen_ai.request.model"] == MODEL and a["gen_ai.request.max_tokens"] == 12 and a["rose.stream"] is False
    assert a["gen_ai.response.id"] == r.id and a["http.response.status_code"] == 200
    assert a["gen_ai.usage.output_tokens"] == 12 and a["rose.worker"] == ch.worker == worker.attrs["rose.worker_id"]
    assert worker.attrs["gen_ai.usage.output_tokens"] == 12 and worker.attrs["rose.outcome"] == "completed"
    assert worker.attrs["rose.policy_versions"] == [0] and worker.attrs["rose.policy_version.last"] == 0


def test_a_streamed_chat_turn_is_one_trace_too(gw, receiver, leases, stream):
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "stream": True}
    events = sse(gw.url, "/v1/chat/completions", body)
    task_id = events[0][1]["id"].removeprefix("chatcmpl-")
    server = _server_span(task_id)
    gws, [worker] = _trace(receiver, server.trace_id, 1)
    _check_chain(gws, "/v1/chat/completions", stream, worker, leases)
    assert server.attrs["rose.stream"] is True and server.attrs["gen_ai.operation.name"] == "chat"
    assert server.attrs["gen_ai.usage.output_tokens"] == 16 == worker.attrs["gen_ai.usage.output_tokens"]
    assert len(streamed_ids(events)[0]) == 16


class _Msg:
    """A consumed command, as confluent-kafka hands it over."""

    def __init__(self, value: bytes, key: str, headers: list):
        self._v, self._k, self._h = value, key.encode(), headers

    def error(self):
        return None

    def key(self) -> bytes:
        return self._k

    def value(self) -> bytes:
        return self._v

    def headers(self) -> list:
        return self._h

    def timestamp(self) -> tuple[int, int]:
        return (0, 0)

    def topic(self) -> str:
        return COMMANDS

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return 0


def test_a_grant_s_trace_context_reaches_the_worker_it_starts(monkeypatch):
    """The executor hands the worker it starts for a grant the traceparent that grant command
    carried (a restart of the same lease too) and the lease id; a warm worker still fits the
    lease, and its lease record carries the context; the config round-trips."""
    started: list[WorkerConfig] = []

    def start_worker(a, name, wc):
        started.append(wc)
        return SimpleNamespace(gpu=a.gpu, proc=SimpleNamespace(pid=os.getpid(), returncode=None), flag=None)

    monkeypatch.setattr("rose.executor.service.start_worker", start_worker)
    cfg = load_config(env={})
    ex = Executor(cfg, ["g/0"], guard=False)
    ex.mem_watch = SimpleNamespace(watch=lambda *a: None)  # type: ignore[assignment]
    ex.producer = SimpleNamespace(produce=lambda *a, **k: None, poll=lambda *a: 0)  # type: ignore[assignment]
    tp = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    now = time.time()
    cmd = command_example(gpu="g/0", lease_id="g/0#5", epoch=5, mem_bytes=1 << 30, ts=now, expires_at=now + 30)
    ex._message(_Msg(encode(cmd), "g/0", [("traceparent", tp.encode())]))  # type: ignore[arg-type]
    [wc] = started
    assert wc.lease_id == "g/0#5" and wc.lease_traceparent == tp and wc.tracing == cfg.tracing
    start = lm.Start("g/0", "g/0#6", 6, 1 << 30, 0.5, False)
    assert ex._with_lease(wc, start).lease_traceparent == ""  # another lease: not this grant's
    warm = dataclasses.replace(wc, gpu="", worker_id="", warm=True, lease_id="", lease_traceparent="")
    assert warm.can_run_as(wc)
    rec = LeaseRecord(1, "g/0", "w", "g/0#5", 5, 1 << 30, 0.5, lease_traceparent=tp)
    assert rec.apply(warm).lease_traceparent == tp and rec.apply(warm).lease_id == "g/0#5"
    assert WorkerConfig.from_json(wc.to_json()) == wc


# -- last: it stops one of the module's workers ----------------------------------------------


def test_a_turn_continued_after_a_revoke_has_a_span_per_worker_in_its_trace(gw, tcfg, flags, receiver, leases, stream):
    """Fails if the continuation a revoked worker hands on does not carry the request's trace
    context (the next worker's span starts a trace of its own)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 120, "seed": 5, "stream": True}
    rv = revoke_midway(gw.url, tcfg, flags, body)
    held, other = rv.held, rv.other
    task_id = rv.events[0][1]["id"].removeprefix("cmpl-")
    server = _server_span(task_id)
    gws, spans = _trace(receiver, server.trace_id, 2)
    by = {s.attrs["rose.worker_id"]: s for s in spans}
    assert set(by) == {held, other}
    for s in spans:
        _check_chain(gws, "/v1/completions", stream, s, leases)  # both children of the one `send`
    first, second = by[held], by[other]
    made = first.attrs["gen_ai.usage.output_tokens"]
    assert first.attrs["rose.outcome"] == "requeued" and made >= rv.received, (rv.received, first.attrs)
    assert second.attrs["rose.outcome"] == "completed" and second.attrs["rose.moves"] == 1
    assert second.attrs["rose.tokens_resumed"] == made and second.attrs["gen_ai.usage.output_tokens"] == 120 - made
    assert server.attrs["rose.moves"] == 1 and server.attrs["gen_ai.usage.output_tokens"] == 120
