"""The gateway's ASGI app (FastAPI): the OpenAI endpoints and SGLang's `/generate` (with the
weight endpoints of a trainer that only publishes, `rose.gateway.sglang`) over the dispatcher,
bearer-token auth, admission, errors in OpenAI's shape, and `serve` (uvicorn) for `rose gateway`.

Status codes: 400 a request the gateway refuses (the message and `param` name the field), 401
a missing or wrong bearer token, 404 an unknown model, 409 no running worker at the request's
`min_weight_version` (`/generate`: its pin), 429 overload or no running worker (with `Retry-After`), 503 Redis
unreachable while publishing weights, 504 a turn not finished by the request's deadline.

`POST /v1/weights` publishes a safetensors checkpoint the gateway can read as the model's next
weight version, through the path `RoseClient.publish_weights` takes (`rose.weights.inputs`,
then `WeightPublisher.publish_raw`), one publish at a time.

Each turn request is a `POST {path}` span (`rose.gateway.observability`; kind SERVER; a child
of the request's own W3C `traceparent` header when it has one) with the request's model,
max_tokens, stream, session and task id and the answer's tokens and worker; the task carries
the context of its `send` span, a child of it (rose.gateway.dispatch), to the workers.
docs/gateway.md."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import secrets
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import redis
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import Span

from rose.config import Config
from rose.gateway import api, sglang
from rose.gateway.admission import Admission, Overloaded
from rose.gateway.dispatch import Dispatcher, PendingTurn, TurnFailed
from rose.gateway.observability import (
    CANCELLED,
    INFLIGHT,
    TOKENS,
    TURN_S,
    WAITING,
    Counted,
    Traced,
    set_answer_attributes,
    set_request_attributes,
)
from rose.gateway.text import text_codec
from rose.obs import metrics
from rose.weights.stream import VersionConflict, WeightPublisher, weights_client

SESSION_HEADER = "x-rose-session"
DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there
KEEPALIVE_S = 5.0  # an SSE comment this often while a streamed turn runs (a gone client fails it)
CHUNK_BLOCK_MS = 100  # a streamed turn's XREAD wait on its token stream (its end marker cuts it short)
END_WAIT_S = 1.0  # how long a read pending when the result comes may take to return, before it is cancelled
VERSION_POLL_S = 0.1  # how often a request with min_weight_version looks for a worker at it


class GatewayError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, **kw: Any):
        super().__init__(message)
        self.status, self.param = status, param
        self.kind: str = kw.get("kind", "invalid_request_error")
        self.code: str | None = kw.get("code")
        self.headers: dict[str, str] = kw.get("headers", {})

    def response(self) -> JSONResponse:
        return JSONResponse(api.error(str(self), self.param, self.kind, self.code), self.status, headers=self.headers)


def _field(loc: Any) -> str:
    parts = [str(x) for x in loc if x != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


class Gateway:
    """The app's state: config, dispatcher, admission."""

    def __init__(self, cfg: Config, dispatcher: Dispatcher | None = None):
        self.cfg, self.g = cfg, cfg.gateway
        self.model = cfg.executor.model
        self.dispatcher = dispatcher or Dispatcher(cfg)
        self.admission = Admission(self.g.max_inflight, self.g.max_queue)
        self.text = text_codec(self.g.tokenizer)  # /generate's text in and out; None: token ids only
        self._publish_lock = threading.Lock()  # one publish at a time: the publisher holds the receivers' view
        self._publisher: WeightPublisher | None = None
        self._weights_redis: Any = None

    def authorize(self, request: Request) -> None:
        keys = self.g.keys
        if not keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(token.strip(), k) for k in keys):
            raise GatewayError(
                401, "missing or wrong bearer token", kind="authentication_error", code="invalid_api_key"
            )

    def _gauges(self) -> None:
        INFLIGHT.set(self.admission.inflight)
        WAITING.set(self.admission.waiting)

    async def admit(self, req: api.TurnRequest, deadline: float, pin: api.Pin | None = None) -> None:
        """Checks `req`, waits for a worker that meets `pin` (absent: the request's own) and for
        an in-flight place; GatewayError when refused."""
        try:
            req.check_supported()
        except api.Unsupported as e:
            raise GatewayError(400, str(e), e.field) from None
        if req.model != self.model:
            raise GatewayError(
                404,
                f"model: {req.model!r} is not served here (serving {self.model!r})",
                "model",
                code="model_not_found",
            )
        idle = self.dispatcher.no_worker_running_s()
        if idle > self.g.pause_patience_s:
            raise GatewayError(
                429,
                f"no rollout worker of job {self.dispatcher.job!r} has run for {idle:.0f}s",
                kind="overloaded",
                headers={"Retry-After": str(max(1, round(self.g.pause_patience_s)))},
            )
        pin = pin or req.pin()
        if pin is not None:
            await self.await_version(pin)
        try:
            await self.admission.acquire(max(0.0, deadline - time.monotonic()))
        except Overloaded as e:
            raise GatewayError(
                429, f"overloaded: {e}", kind="overloaded", headers={"Retry-After": str(e.retry_after_s)}
            ) from None
        finally:
            self._gauges()

    async def await_version(self, pin: api.Pin) -> None:
        """Until a running worker reports a policy version that meets `pin`; 409 naming the
        pin's field when none does within `gateway.pause_patience_s`."""
        until = time.monotonic() + self.g.pause_patience_s
        while not self.dispatcher.workers_at(pin.version, pin.exact):
            if time.monotonic() >= until:
                raise self.pin_refused(pin, f"within {self.g.pause_patience_s:g}s (gateway.pause_patience_s)")
            await asyncio.sleep(VERSION_POLL_S)

    def pin_refused(self, pin: api.Pin, when: str) -> GatewayError:
        at = f"version {pin.version}" if pin.exact else f"version {pin.version} or newer"
        return GatewayError(
            409,
            f"{pin.field}: no running worker of job {self.dispatcher.job!r} served policy {at} {when}; "
            "GET /v1/weights shows each worker's version",
            pin.field,
            code="weight_version_unavailable",
        )

    def publish(self, req: api.WeightsRequest) -> dict:
        """`POST /v1/weights`, on a worker thread: the checkpoint's tensors (`rose.weights.inputs`,
        as `RoseClient.publish_weights` reads them) published as the model's next version, or
        `req.version`. GatewayError: 400 naming `checkpoint` or `version`, 503 Redis away."""
        from rose.weights.inputs import tensors

        try:
            specs, arrays = tensors(Path(req.checkpoint), req.dtype)
        except ValueError as e:
            raise GatewayError(400, f"checkpoint: {str(e).removeprefix('weights: ')}", "checkpoint") from None
        with self._publish_lock:
            try:
                stats = self._weights_publisher().publish_raw(specs, arrays, version=req.version)
            except VersionConflict as e:
                raise GatewayError(400, f"{e.field}: {e}", e.field) from None
            except ValueError as e:
                raise GatewayError(400, f"checkpoint: {e}", "checkpoint") from None
            except redis.RedisError as e:
                raise GatewayError(503, f"weights not published: Redis: {e}", kind="service_unavailable") from None
        return {
            "version": stats.version,
            "model": self.model,
            "keyframe": stats.keyframe,
            "bytes_sent": stats.bytes_sent,
        }

    def _weights_publisher(self) -> WeightPublisher:
        if self._publisher is None:
            self._weights_redis = weights_client(self.cfg.redis, self.dispatcher.r)
            self._publisher = WeightPublisher(
                self._weights_redis, self.cfg.redis, self.model, hmac_key=self.cfg.security.weights_hmac_key
            )
        return self._publisher

    def close_publisher(self) -> None:
        if self._weights_redis is not None and self._weights_redis is not self.dispatcher.r:
            self._weights_redis.close()
        self._weights_redis = self._publisher = None

    def release(self, turn: PendingTurn | None) -> None:
        self.admission.release()
        if turn is not None and turn.future.done() and not turn.future.cancelled():
            self.admission.observe(time.monotonic() - turn.submitted)
        self._gauges()

    async def start_turn(
        self, request: Request, req: api.TurnRequest, prompt: list[int], pin: api.Pin | None = None
    ) -> tuple[PendingTurn, float]:
        """Admits `req` (its own pin, or `pin`) and queues its turn."""
        pin = pin or req.pin()
        deadline = time.monotonic() + self.g.request_timeout_s
        await self.admit(req, deadline, pin)
        session = request.headers.get(SESSION_HEADER) or req.user
        if session:
            trace.get_current_span().set_attribute("rose.session", session)
        seed = req.seed if req.seed is not None else secrets.randbelow(api.MAX_SEED)
        try:
            turn = await self.dispatcher.submit(
                prompt,
                req.tokens(),
                seed,
                session,
                stream=req.stream,
                min_version=pin.version if pin else 0,
                exact=bool(pin and pin.exact),
            )
            return turn, deadline
        except BaseException:
            self.release(None)
            raise

    async def wait(self, turn: PendingTurn, deadline: float, request: Request | None) -> api.TurnResult:
        """The turn's result; withdraws the task when the client goes or the deadline passes."""
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise GatewayError(
                        504,
                        f"the turn did not finish within {self.g.request_timeout_s:g}s "
                        "(gateway.request_timeout_s); it was withdrawn",
                        kind="timeout",
                    )
                done, _ = await asyncio.wait({turn.future}, timeout=min(DISCONNECT_POLL_S, left))
                if done:
                    result: api.TurnResult = turn.future.result()
                    TURN_S.observe(time.monotonic() - turn.submitted)
                    TOKENS.inc(len(result.token_ids))
                    return result
                if request is not None and await request.is_disconnected():
                    raise GatewayError(499, "the client closed the request; the turn was withdrawn", kind="cancelled")
        except TurnFailed as e:
            raise GatewayError(400, str(e), e.field) from None
        except BaseException:
            if not turn.future.done():
                CANCELLED.inc()
                self.dispatcher.withdraw(turn)
            raise
        finally:
            self.release(turn)


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _stream(
    gw: Gateway, turn: PendingTurn, deadline: float, shape: api.StreamShape, span: Span
) -> AsyncIterator[bytes]:
    """The SSE body: each token as its worker publishes it (the turn's token stream, de-duplicated
    by token index, so the ids stay contiguous across a revoke), then what the stream has not
    brought, from the result, and the last chunk. A client that leaves cancels the generator
    (Starlette watches for it), or makes the next keep-alive comment fail; either way the wait is
    cancelled and the turn withdrawn."""

    async def gen() -> AsyncIterator[bytes]:
        waiting = asyncio.ensure_future(gw.wait(turn, deadline, None))
        feed = _Feed(gw, turn.tokens_key)
        try:
            for c in shape.head():
                yield _sse(c)
            while not waiting.done():
                got = await feed.next(waiting)
                for c in shape.pieces(*got) if got else []:
                    yield _sse(c)
                if feed.quiet_s() >= KEEPALIVE_S:
                    feed.quiet = time.monotonic()
                    yield b": keep-alive\n\n"
            r = waiting.result()
        except GatewayError as e:
            span.set_attribute("error.type", str(e.status))
            yield _sse(shape.error(str(e), e.param, e.kind, e.code))
            yield b"data: [DONE]\n\n"
            return
        finally:
            waiting.cancel()  # a no-op once it is done
        set_answer_attributes(span, r)
        for c in shape.pieces(feed.sent, r.token_ids[feed.sent :], r.versions[feed.sent :], r.logprobs[feed.sent :]):
            yield _sse(c)
        yield _sse(shape.tail(r))
        yield b"data: [DONE]\n\n"
        if turn.tokens_key:
            await gw.dispatcher.drop_chunks(turn.tokens_key)

    return gen()


class _Feed:
    """A streamed turn's tokens from its token stream: the next ones after `sent` (chunks that
    repeat tokens already sent are cut, those past a gap wait for the result to fill it).

    A read is not cancelled when the result comes first: the dispatcher appends the stream's end
    marker before it resolves the result, which ends the pending read within milliseconds, and
    the feed waits for that (cancelling would drop the read's Redis connection, one reconnect a
    turn). Once the marker is read the feed stops reading and waits for the result alone."""

    def __init__(self, gw: Gateway, key: str):
        self.gw, self.key = gw, key
        self.sent = 0
        self.cursor = "0-0"
        self.quiet = time.monotonic()

    def quiet_s(self) -> float:
        return time.monotonic() - self.quiet

    async def next(self, waiting: asyncio.Future) -> tuple[int, list[int], list[int], list[float] | None] | None:
        if not self.key:
            await asyncio.wait({waiting}, timeout=KEEPALIVE_S)
            return None
        read = asyncio.ensure_future(self.gw.dispatcher.chunks(self.key, self.cursor, CHUNK_BLOCK_MS))
        try:
            await asyncio.wait({read, waiting}, return_when=asyncio.FIRST_COMPLETED)
            if not read.done():  # the result came first: the end marker written before it ends the read
                await asyncio.wait({read}, timeout=END_WAIT_S)
        finally:
            if not read.done():
                read.cancel()  # Redis did not answer in time, or the client left (its connection is dropped)
        if read.cancelled() or not read.done():
            self.key = ""  # the result brings the rest
            return None
        try:
            chunks, self.cursor, ended = read.result()
        except redis.RedisError:
            self.key = ""  # the result still answers
            return None
        if ended:
            self.key = ""  # the turn is answered: its result brings what the stream did not
        start, ids, vs, lps = self.sent, [], [], []
        for ch in chunks:
            if ch.index <= self.sent < ch.index + len(ch.tokens):
                k = self.sent - ch.index
                ids += ch.tokens[k:]
                vs += ch.versions[k:]
                lps += ch.logprobs[k:] if len(ch.logprobs) == len(ch.tokens) else []
                self.sent += len(ch.tokens) - k
        if not ids:
            return None
        self.quiet = time.monotonic()
        return start, ids, vs, lps if len(lps) == len(ids) else None


async def _turn(gw: Gateway, request: Request, req: api.TurnRequest, prompt: list[int], chat: bool) -> Response:
    span = trace.get_current_span()
    set_request_attributes(span, req, prompt, chat)
    turn, deadline = await gw.start_turn(request, req, prompt)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{turn.task_id}"
    span.set_attributes({"rose.task_id": turn.task_id, "gen_ai.response.id": rid})
    if req.stream:
        shape = api.StreamShape(rid, gw.model, prompt, chat, req.wants_logprobs())
        return StreamingResponse(_stream(gw, turn, deadline, shape, span), media_type="text/event-stream")
    r = await gw.wait(turn, deadline, request)
    set_answer_attributes(span, r)
    lp = req.wants_logprobs()
    body = api.chat_completion(rid, gw.model, r, lp) if chat else api.completion(rid, gw.model, r, lp)
    return Response(orjson.dumps(body), media_type="application/json")


def _renamed(e: GatewayError, names: dict[str, str]) -> GatewayError:
    """`e` naming the field of an SGLang endpoint's body (`names`: ours to theirs)."""
    if e.param not in names:
        return e
    param = names[e.param]
    return GatewayError(e.status, param + str(e)[len(e.param) :], param, kind=e.kind, code=e.code, headers=e.headers)


async def _generate(gw: Gateway, request: Request, req: sglang.GenerateRequest) -> Response:
    """`POST /generate` (SGLang's shape) as one turn, through the same admission, queue, revoke
    hand-over and version pin as the OpenAI endpoints."""
    try:
        prompt = req.check_supported(gw.text)
    except api.Unsupported as e:
        raise GatewayError(400, str(e), e.field) from None
    sp, pin = req.sampling_params, req.pin()
    session = request.headers.get(sglang.ROUTING_KEY_HEADER)  # X-Rose-Session, when given, comes first
    turn_req = api.TurnRequest(
        model=gw.model, max_tokens=sp.max_new_tokens, seed=sp.the_seed(), stream=req.stream, user=session
    )
    span = trace.get_current_span()
    set_request_attributes(span, turn_req, prompt, chat=False)
    if pin is not None:
        span.set_attribute(f"rose.{pin.field}", pin.version)
    turn, deadline = await gw.start_turn(request, turn_req, prompt, pin)
    span.set_attribute("rose.task_id", turn.task_id)
    answer = sglang.Answer(req.rid or turn.task_id, req, len(prompt), gw.text)
    if req.stream:
        shape = sglang.GenerateStream(answer, prompt)
        return StreamingResponse(_stream(gw, turn, deadline, shape, span), media_type="text/event-stream")
    try:
        r = await gw.wait(turn, deadline, request)
    except GatewayError as e:
        raise _renamed(e, {"prompt": "input_ids"}) from None
    set_answer_attributes(span, r)
    answer.end(r)
    if pin is not None and answer.aborted():
        raise gw.pin_refused(pin, "for the whole turn (its worker changed version mid-turn)")
    return Response(orjson.dumps(answer.body(final=True)), media_type="application/json")


def create_app(cfg: Config, dispatcher: Dispatcher | None = None) -> FastAPI:
    gw = Gateway(cfg, dispatcher)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(gw.dispatcher.start)
        try:
            yield
        finally:
            await asyncio.to_thread(gw.dispatcher.close)
            await gw.dispatcher.ar.aclose()
            gw.close_publisher()

    app = FastAPI(title="ROSE gateway", lifespan=lifespan)
    app.add_middleware(Counted)
    app.add_middleware(Traced)
    app.state.gateway = gw
    _errors(app)
    auth = [Depends(gw.authorize)]

    @app.post("/v1/completions", dependencies=auth)
    async def completions(req: api.CompletionRequest, request: Request) -> Response:
        return await _turn(gw, request, req, req.prompt, chat=False)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(req: api.ChatRequest, request: Request) -> Response:
        return await _turn(gw, request, req, req.prompt(), chat=True)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        return {"object": "list", "data": [{"id": gw.model, "object": "model", "created": 0, "owned_by": "rose"}]}

    @app.get("/v1/weights", dependencies=auth)
    async def weights() -> dict:
        ws, latest = await asyncio.to_thread(gw.dispatcher.weights)
        return {
            "object": "list",
            "model": gw.model,
            "job": gw.dispatcher.job,
            "latest_published": latest,
            "data": [dataclasses.asdict(w) for w in ws],
        }

    @app.post("/v1/weights", dependencies=auth)
    async def publish(req: api.WeightsRequest) -> dict:
        return await asyncio.to_thread(gw.publish, req)

    @app.post("/generate", dependencies=auth)
    async def generate(req: sglang.GenerateRequest, request: Request) -> Response:
        return await _generate(gw, request, req)

    @app.get("/get_weight_version", dependencies=auth)
    async def get_weight_version() -> dict:
        ws, latest = await asyncio.to_thread(gw.dispatcher.weights)
        return sglang.fleet_version(ws, latest)

    @app.post("/update_weights_from_disk", dependencies=auth)
    async def update_weights_from_disk(req: sglang.DiskWeightsRequest) -> dict:
        try:
            done = await asyncio.to_thread(gw.publish, req.publish())
        except GatewayError as e:
            raise _renamed(e, {"checkpoint": "model_path", "version": "weight_version"}) from None
        return {"success": True, "message": f"published as version {done['version']}", **done}

    @app.get("/health")
    async def health() -> JSONResponse:
        d = gw.dispatcher
        ok = d.redis_ok
        body = {"status": "ok" if ok else "redis unavailable", "job": d.job, "workers_running": d.workers_running()}
        return JSONResponse(body, 200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def _errors(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def gateway_error(_request: Request, e: GatewayError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def bad_request(_request: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            ctx: Any = first.get("ctx") or {}
            name, msg = "body", f"not valid JSON ({ctx.get('error', 'malformed')})"
        else:
            name = _field(first.get("loc", ()))
            msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        return JSONResponse(api.error(f"{name}: {msg}", name), 400)


def serve(cfg: Config, host: str | None = None, port: int | None = None, log_level: str = "warning") -> None:
    """Run the gateway with uvicorn until SIGINT/SIGTERM, exporting its spans as `cfg.tracing` says."""
    import uvicorn

    from rose.obs.tracing import setup_tracing

    setup_tracing(cfg.tracing, service="rose-gateway")

    uvicorn.run(
        create_app(cfg),
        host=host or cfg.gateway.host,
        port=cfg.gateway.port if port is None else port,
        log_level=log_level.lower(),
        timeout_graceful_shutdown=5,
    )
