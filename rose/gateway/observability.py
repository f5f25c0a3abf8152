"""The gateway's metrics and request spans: apart from the app because every endpoint is counted
and every turn request traced the same way, around the handlers (plain ASGI) or by one call."""

from __future__ import annotations

from typing import Any

from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from rose.gateway import api
from rose.obs import metrics
from rose.obs.tracing import extract_context, tracer

TURN_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

REQUESTS = metrics.counter("rose_gateway_requests_total", "Gateway requests by endpoint and status code.")
TOKENS = metrics.counter("rose_gateway_completion_tokens_total", "Tokens generated for gateway turns.")
CANCELLED = metrics.counter("rose_gateway_turns_withdrawn_total", "Turns withdrawn: client gone or deadline.")
INFLIGHT = metrics.gauge("rose_gateway_inflight_turns", "Gateway turns on the task queue.")
WAITING = metrics.gauge("rose_gateway_waiting_requests", "Requests waiting for an in-flight place.")
TURN_S = metrics.histogram("rose_gateway_turn_seconds", "Submit to result of a gateway turn.", TURN_BUCKETS_S)


def set_request_attributes(span: Span, req: api.TurnRequest, prompt: list[int], chat: bool) -> None:
    """The request's attributes on its SERVER span (OpenTelemetry's gen_ai conventions)."""
    span.set_attributes(
        {
            "gen_ai.operation.name": "chat" if chat else "text_completion",
            "gen_ai.request.model": req.model,
            "gen_ai.request.max_tokens": req.tokens(),
            "gen_ai.usage.input_tokens": len(prompt),
            "rose.stream": bool(req.stream),
        }
    )
    if req.seed is not None:
        span.set_attribute("gen_ai.request.seed", req.seed)
    if req.min_weight_version is not None:
        span.set_attribute("rose.min_weight_version", req.min_weight_version)


def set_answer_attributes(span: Span, r: api.TurnResult) -> None:
    span.set_attributes(
        {
            "gen_ai.usage.output_tokens": len(r.token_ids),
            "rose.worker": r.worker,
            "rose.moves": r.moves,
            "rose.policy_versions": sorted(set(r.versions)),
        }
    )


ENDPOINTS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/weights",
        "/generate",
        "/get_weight_version",
        "/update_weights_from_disk",
        "/health",
        "/metrics",
    }
)


class Counted:
    """Counts responses by endpoint and status code (plain ASGI: a request's `is_disconnected`
    keeps seeing the client, which Starlette's BaseHTTPMiddleware would hide)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in ENDPOINTS else "other"

        async def counted(message: Any) -> None:
            if message["type"] == "http.response.start":
                REQUESTS.inc(endpoint=path, code=str(message["status"]))
            await send(message)

        await self.app(scope, receive, counted)


TRACED = frozenset({"/v1/completions", "/v1/chat/completions", "/generate"})


class Traced:
    """A SERVER span `POST {path}` over each turn request, until its last byte is sent (a
    streamed answer included); a child of the request's `traceparent` header when it has one."""

    def __init__(self, app: Any):
        self.app = app
        self.tracer = tracer("rose.gateway")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in TRACED or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        attrs = {"http.request.method": "POST", "http.route": scope["path"], "url.path": scope["path"]}
        name = f"POST {scope['path']}"
        with self.tracer.start_as_current_span(
            name, context=extract_context(scope.get("headers")), kind=SpanKind.SERVER, attributes=attrs
        ) as span:

            async def traced(message: Any) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                    if message["status"] >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            await self.app(scope, receive, traced)
