"""`rose gateway` through the official `openai` client: a real gateway (uvicorn in a thread),
the real Redis and two real rollout workers on the reference engine (started once for the
module). Completions and chat, streamed and not, return token ids with the policy version of
every token; auth, validation and overload answer 401, 400 naming the field and 429, never a
5xx; a session keeps its turns on one worker. Token ids stay below 256: the reference policy's
vocabulary is bytes."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import orjson
import pytest
import redis
import uvicorn

from rose.config import Config, ConfigError, GatewayConfig, load_config
from rose.gateway.admission import Admission, Overloaded
from rose.gateway.api import version_spans
from rose.gateway.app import create_app
from rose.gateway.dispatch import END_TTL_S, Dispatcher, _Waiter
from rose.rollout.episode import Episode, InvalidTask, Task
from rose.rollout.launcher import WorkerConfig, launch
from rose.rollout.pause_flag import STOP, PauseFlag
from rose.rollout.tasks import TaskQueue
from rose.rollout.token_stream import TokenStreamer
from tests.test_rollout_tasks import wait_for

JOB = "gw"
MODEL = "policy"
KEY = "test-key"
SMALL = {"d_model": 64, "n_heads": 4, "d_ff": 128, "n_layers": 2, "max_seq": 512}
PROMPT = list(b"What is 2 + 2?")


@dataclasses.dataclass
class Served:
    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def client(self, key: str = KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(cfg: Config) -> Served:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(cfg), host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True, name=f"gateway-{port}")
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert t.is_alive() and time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.02)
    return Served(f"http://127.0.0.1:{port}", server, t)


def gateway_cfg(base: Config, prefix: str, **gateway) -> Config:
    return dataclasses.replace(
        base,
        redis=dataclasses.replace(base.redis, url=base.redis.url, key_prefix=prefix),
        executor=dataclasses.replace(base.executor, job=JOB, model=MODEL),
        gateway=GatewayConfig(**{"api_keys": KEY, "request_timeout_s": 60.0, **gateway}),
    )


@pytest.fixture(scope="module")
def module_cfg(stack, base_cfg) -> Iterator[Config]:
    yield from prefixed_gateway_cfg(stack, base_cfg)


def prefixed_gateway_cfg(stack, base_cfg) -> Iterator[Config]:
    """A gateway config on the stack's Redis under a key prefix of its own, whose keys go after."""
    prefix = f"t{uuid.uuid4().hex[:10]}:"
    c = gateway_cfg(
        dataclasses.replace(base_cfg, redis=dataclasses.replace(base_cfg.redis, url=stack.redis_url)), prefix
    )
    yield c
    r = redis.Redis.from_url(c.redis.url)
    keys = list(r.scan_iter(match=f"{prefix}*", count=1000))
    if keys:
        r.delete(*keys)
    r.close()


@pytest.fixture(scope="module")
def flags() -> Iterator[dict[str, PauseFlag]]:
    """Each worker's pause flag, as its executor would hold it (the revoke test stops one)."""
    yield from pause_flags("rose-gw")


def pause_flags(tag: str) -> Iterator[dict[str, PauseFlag]]:
    out = {w: PauseFlag(f"{tag}-{uuid.uuid4().hex[:8]}", create=True) for w in ("w0", "w1")}
    yield out
    for f in out.values():
        f.close()
        f.unlink()


def launch_workers(cfg: Config, flags: dict[str, PauseFlag], per_worker=lambda w: {}, env=None) -> dict:
    """One worker per pause flag, as an executor would start it (the reference engine unless
    `per_worker` says otherwise)."""
    return {
        w: launch(
            WorkerConfig(
                **{
                    "gpu": f"sim/{w}",
                    "worker_id": w,
                    "redis": cfg.redis,
                    "job": JOB,
                    "model": MODEL,
                    "model_spec": SMALL,
                    "max_batch": 8,
                    "pause_flag": f.name,
                    **per_worker(w),
                }
            ),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for w, f in flags.items()
    }


def stop_workers(procs: dict) -> None:
    for p in procs.values():
        p.terminate()
    for p in procs.values():
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


@pytest.fixture(scope="module")
def workers(module_cfg, flags) -> Iterator[list[str]]:
    procs = launch_workers(module_cfg, flags)
    yield sorted(procs)
    stop_workers(procs)


@pytest.fixture(scope="module")
def gw(module_cfg, workers) -> Iterator[Served]:
    s = serve(module_cfg)
    health = wait_for(lambda: _running(s, workers), 90, "both workers running")
    assert health["job"] == JOB
    yield s
    s.stop()


def _running(s: Served, workers: list[str]) -> dict | None:
    h = httpx.get(s.url + "/health").json()
    return h if sorted(h["workers_running"]) == workers else None


def covers(spans: list[dict], n: int) -> list[int]:
    """The per-token versions the spans describe; they must tile 0..n without a gap."""
    out: list[int] = []
    for sp in spans:
        assert sp["start"] == len(out) and sp["end"] > sp["start"], spans
        out += [sp["version"]] * (sp["end"] - sp["start"])
    assert len(out) == n
    return out


# -- turns ----------------------------------------------------------------------------------


def test_completion_returns_token_ids_versions_and_worker(gw, workers):
    c = gw.client()
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, seed=7, extra_body={"return_token_ids": True})
    ch = r.choices[0]
    assert ch.finish_reason == "length" and ch.text == ""
    assert len(ch.token_ids) == 12 and all(0 <= t < 256 for t in ch.token_ids)
    assert ch.prompt_token_ids == PROMPT
    assert covers(ch.weight_versions, 12) == [0] * 12  # the seeded policy, version 0
    assert ch.worker in workers
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(PROMPT)
    again = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, seed=7)
    assert again.choices[0].token_ids == ch.token_ids  # the seed alone decides the tokens


def test_streamed_completion_matches_the_whole_answer(gw):
    c = gw.client()
    whole = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, seed=3).choices[0]
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, seed=3, stream=True))
    ids = [t for ch in chunks for t in ch.choices[0].token_ids]
    per_token = [sp["version"] for ch in chunks[:-1] for sp in ch.choices[0].weight_versions]
    last = chunks[-1].choices[0]
    assert ids == whole.token_ids and len(per_token) == len(ids) == 10
    assert last.finish_reason == "length" and covers(last.weight_versions, 10) == per_token
    assert last.worker == whole.worker or last.worker


def test_chat_with_token_id_messages_streamed_and_not(gw):
    c = gw.client()
    msgs = [{"role": "system", "content": list(b"Be brief.")}, {"role": "user", "content": PROMPT}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, seed=11)  # type: ignore[arg-type]
    ch = r.choices[0]
    assert ch.message.role == "assistant" and len(ch.token_ids) == 8
    assert r.prompt_token_ids == list(b"Be brief.") + PROMPT
    assert covers(ch.weight_versions, 8) == [0] * 8
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, seed=11, stream=True))  # type: ignore[arg-type]
    ids = [t for x in chunks for t in (getattr(x.choices[0], "token_ids", None) or [])]
    assert ids == ch.token_ids and chunks[-1].choices[0].finish_reason == "length"


def session_workers(gw: Served, sessions: Iterable[str], turns: int) -> dict[str, set[str]]:
    """The workers that answered each session's `turns` turns (its id in `X-Rose-Session`)."""
    c = gw.client()
    return {
        s: {
            c.completions.create(
                model=MODEL, prompt=PROMPT + [i], max_tokens=4, seed=i, extra_headers={"X-Rose-Session": s}
            )
            .choices[0]
            .worker
            for i in range(turns)
        }
        for s in sessions
    }


def test_a_session_keeps_its_turns_on_one_worker(gw, workers):
    seen = session_workers(gw, ("s-1", "s-2"), 5)
    assert all(len(w) == 1 and w <= set(workers) for w in seen.values()), seen
    c = gw.client()
    by_user = {
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, user="u-1").choices[0].worker for _ in range(4)
    }
    assert len(by_user) == 1


def test_models_health_and_metrics(gw):
    assert [m.id for m in gw.client().models.list()] == [MODEL]
    assert httpx.get(gw.url + "/health").status_code == 200
    text = httpx.get(gw.url + "/metrics").text
    assert "rose_gateway_requests_total" in text and "rose_gateway_turn_seconds_count" in text


def sse(url: str, path: str, body: dict, headers: dict | None = None) -> list[tuple[float, dict]]:
    """A streamed request's events, each with the seconds since the request began."""
    t0 = time.monotonic()
    out = []
    with httpx.Client(timeout=60) as h:
        with h.stream(
            "POST", url + path, json=body, headers={"Authorization": f"Bearer {KEY}", **(headers or {})}
        ) as sr:
            assert sr.status_code == 200
            for line in sr.iter_lines():
                if line.startswith("data: {"):
                    out.append((time.monotonic() - t0, orjson.loads(line[6:])))
    return out


def streamed_ids(events: list[tuple[float, dict]]) -> tuple[list[int], list[int]]:
    """(token ids, their indexes) of the token chunks, in arrival order."""
    ids, idx = [], []
    for _t, e in events:
        ch = e["choices"][0]
        if ch["finish_reason"] is None and ch.get("token_ids"):
            ids += ch["token_ids"]
            idx += [i for sp in ch["weight_versions"] for i in range(sp["start"], sp["end"])]
    return ids, idx


@dataclasses.dataclass
class Revoked:
    """A streamed completion whose worker was revoked midway (`revoke_midway`)."""

    events: list[tuple[float, dict]]
    held: str  # the worker that ran the turn until its revoke
    other: str  # the worker that finished it
    received: int  # token chunks the client held when the holder was paused
    before: dict[str, dict[str, str]]  # each worker's heartbeat, both idle, before the turn
    after: dict[str, dict[str, str]]  # and after it (the holder stopped, the other idle again)

    def made(self, worker: str, counter: str) -> int:
        """How much heartbeat `counter` of `worker` grew during this turn."""
        return int(self.after[worker].get(counter, 0)) - int(self.before[worker].get(counter, 0))


def revoke_midway(
    url: str,
    cfg: Config,
    flags: dict[str, PauseFlag],
    body: dict,
    received: int = 10,
    path: str = "/v1/completions",
    shape: tuple[Callable[[list], list[int]], Callable[[dict], str]] | None = None,
) -> Revoked:
    """Stream the completion `body` (to `path`; `shape`: how to read the token ids the events
    hold and the task id from the first, OpenAI's by default) and revoke its worker midway. The
    client decides "midway":
    once it holds `received` tokens, the worker that published them (the turn's token stream
    names it) is paused (share 0: it launches no more decode step, so it cannot finish the turn)
    and, once its heartbeat says it is paused still holding the turn, stopped; the other worker,
    at full share, finishes the turn. Both workers are idle before the turn and after it, so the
    difference of their heartbeat counters is this turn's."""
    got_ids, task_of = shape or (lambda ev: streamed_ids(ev)[0], lambda e: e["id"].removeprefix("cmpl-"))
    r = redis.Redis.from_url(cfg.redis.url)

    def hb(w: str) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in r.hgetall(cfg.redis.key("workers", w)).items()}

    def in_state(w: str, state: str, since: float) -> dict[str, str] | None:
        """`w`'s heartbeat once one published after `since` says `state`."""
        h = hb(w)
        return h if h.get("state") == state and float(h.get("ts", 0)) > since else None

    def idle(ws: Iterable[str], since: float) -> dict[str, dict[str, str]] | None:
        """Each worker's heartbeat, once all published one after `since` with no turn active."""
        hbs = {w: hb(w) for w in ws}
        return hbs if all(float(h.get("ts", 0)) > since and h.get("active") == "0" for h in hbs.values()) else None

    events: list[tuple[float, dict]] = []
    since = time.time()
    before = wait_for(lambda: idle(flags, since), 60, "both workers idle")
    for f in flags.values():
        f.set_share(0.25)  # a turn of seconds: the pause lands long before the holder could finish it
    t0 = time.monotonic()
    try:
        with (
            httpx.Client(timeout=60) as h,
            h.stream("POST", url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}) as sr,
        ):
            assert sr.status_code == 200
            lines = sr.iter_lines()

            def read(enough: Callable[[], bool]) -> None:
                for line in lines:
                    if line.startswith("data: {"):
                        events.append((time.monotonic() - t0, orjson.loads(line[6:])))
                        assert "error" not in events[-1][1], events[-1][1]  # not an error (a timeout, ...)
                        if enough():
                            return

            read(lambda: len(got_ids(events)) >= received)
            got = len(got_ids(events))
            assert got >= received, f"the turn ended after {got} tokens"
            tokens = cfg.redis.key("tasks", JOB, "tokens", task_of(events[0][1]))
            [held] = {f[b"worker"].decode() for _i, f in r.xrange(tokens) if b"worker" in f}
            [other] = [w for w in flags if w != held]
            paused_at = time.time()
            flags[held].set_share(0.0)
            paused = wait_for(lambda: in_state(held, "paused", paused_at), 10, "the holder paused")
            assert paused["active"] == "1", f"the turn ended before its worker was paused: {paused}"
            flags[other].set_share(1.0)
            flags[held].set(STOP)
            read(lambda: False)
        ended = time.time()
        stopped = wait_for(lambda: in_state(held, "stopped", paused_at), 30, "the holder stopped")
        after = {held: stopped, **wait_for(lambda: idle([other], ended), 30, "the other worker idle")}
    finally:
        r.close()
    return Revoked(events, held, other, got, before, after)


def test_a_streamed_turn_sends_tokens_as_they_are_made(gw, flags):
    for f in flags.values():
        f.set_share(0.25)  # a longer turn, so its first tokens come well before its end
    try:
        events = sse(gw.url, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "stream": True})
    finally:
        for f in flags.values():
            f.set_share(1.0)
    ids, idx = streamed_ids(events)
    assert idx == list(range(200)) and len(ids) == 200
    first = next(t for t, e in events if e["choices"][0].get("token_ids"))
    last = events[-1][0]
    assert events[-1][1]["choices"][0]["finish_reason"] == "length"
    assert first < last / 2, (first, last)  # the first token came with the first decode steps
    assert len({round(t, 2) for t, e in events if e["choices"][0].get("token_ids")}) > 3  # in several batches


def stream_end_after_last_token_s(url: str, body: dict) -> float:
    """Seconds from the arrival of a streamed turn's last token chunk to the end of its response."""
    last = None
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as sr:
            assert sr.status_code == 200
            for line in sr.iter_lines():
                ch = orjson.loads(line[6:])["choices"][0] if line.startswith("data: {") else {}
                if ch.get("token_ids") and ch["finish_reason"] is None:
                    last = time.monotonic()
        end = time.monotonic()
    assert last is not None
    return end - last


def test_a_streamed_turn_ends_as_soon_as_its_last_token_is_sent(gw):
    """The response ends when the turn's result comes, not at the next poll of its token stream
    (CHUNK_BLOCK_MS, 100 ms): the median of 20 turns' last-token-to-end times stays well under it."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "stream": True}
    gaps = [stream_end_after_last_token_s(gw.url, {**body, "seed": i}) for i in range(20)]
    assert statistics.median(gaps) < 0.05, sorted(round(g * 1000, 1) for g in gaps)


def test_weights_agree_with_the_workers_heartbeats(gw, module_cfg, workers):
    r = redis.Redis.from_url(module_cfg.redis.url)
    try:
        body = httpx.get(gw.url + "/v1/weights", headers={"Authorization": f"Bearer {KEY}"}).json()
        hb = {w: int(float(r.hget(module_cfg.redis.key("workers", w), "version") or -1)) for w in workers}
    finally:
        r.close()
    assert body["model"] == MODEL and body["job"] == JOB and body["latest_published"] is None  # none published
    assert {d["worker"]: d["version"] for d in body["data"]} == hb == {w: 0 for w in workers}
    assert all(d["state"] == "running" and d["heartbeat_age_s"] < 3 for d in body["data"])
    assert httpx.get(gw.url + "/v1/weights").status_code == 401


def test_weights_read_the_heartbeats_at_the_request(module_cfg):
    """`GET /v1/weights` answers from the heartbeats as they are when asked, not from the
    dispatcher's last refresh: a version a worker has just reported is in the answer."""
    d = Dispatcher(module_cfg, job=f"wv-{uuid.uuid4().hex[:8]}")  # its reader not started: no refresh of its own
    w = f"wv-{uuid.uuid4().hex[:8]}"
    hb = module_cfg.redis.key("workers", w)
    try:
        d.queue.register_worker(w)
        d.r.hset(hb, mapping={"state": "running", "ts": time.time(), "version": 3})
        ws, _latest = d.weights()
        assert [(x.worker, x.state, x.version) for x in ws] == [(w, "running", 3)]
    finally:
        d.r.delete(hb, d.queue.workers_key, d.queue.directed(w))
        d.close()


def test_min_weight_version_is_served_at_or_above_it_or_refused_naming_it(module_cfg, gw):
    c = gw.client()
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, extra_body={"min_weight_version": 0})
    assert all(sp["version"] >= 0 for sp in r.choices[0].weight_versions) and len(r.choices[0].token_ids) == 6
    # a worker below a task's min_version takes it but does not start the turn
    rc = redis.Redis.from_url(module_cfg.redis.url)
    q = TaskQueue(rc, module_cfg.redis, JOB)
    task = Task(task_id=f"minv-{uuid.uuid4().hex}", prompt=PROMPT, max_turns=1, tokens_per_turn=4, min_version=1)
    entry = q.submit(task)
    try:
        held = wait_for(lambda: rc.xpending_range(q.stream, "rollout", "-", "+", 10), 5, "a worker holding the task")
        holder = module_cfg.redis.key("workers", held[0]["consumer"].decode())
        beats: set[bytes] = set()

        def holding_beats() -> bool:  # heartbeats, each one pass of its loop, with the task held
            ts, active = rc.hmget(holder, "ts", "active")
            if ts is not None and int(active or 0) >= 1:
                beats.add(ts)
            return len(beats) >= 3

        wait_for(holding_beats, 10, "three heartbeats of the worker holding the task")
        assert all(f[b"task_id"].decode() != task.task_id for _i, f in rc.xrange(q.results_stream))
    finally:
        q.cancel(q.stream, entry)
        rc.close()
    quick = serve(
        dataclasses.replace(module_cfg, gateway=dataclasses.replace(module_cfg.gateway, pause_patience_s=0.5))
    )
    try:
        for path, body in [
            ("/v1/completions", {"prompt": PROMPT}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
        ]:
            t0 = time.monotonic()
            got = httpx.post(
                quick.url + path,
                json={"model": MODEL, "max_tokens": 4, "min_weight_version": 1, **body},
                headers={"Authorization": f"Bearer {KEY}"},
            )
            assert got.status_code == 409 and got.json()["error"]["param"] == "min_weight_version", got.text
            assert "min_weight_version" in got.json()["error"]["message"] and time.monotonic() - t0 >= 0.5
    finally:
        quick.stop()


# -- refusals -------------------------------------------------------------------------------


def test_a_wrong_or_missing_token_is_401(gw):
    with pytest.raises(openai.AuthenticationError):
        gw.client("wrong").completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert httpx.get(gw.url + "/v1/models").status_code == 401


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"prompt": PROMPT, "max_tokens": -1}, "max_tokens"),
        ({"prompt": "What is 2 + 2?", "max_tokens": 4}, "prompt"),
        ({"prompt": ["a", "b"], "max_tokens": 4}, "prompt"),
        ({"prompt": PROMPT, "max_tokens": 4, "temperature": 0.3}, "temperature"),
        ({"prompt": PROMPT, "max_tokens": 4, "logprobs": 2}, "logprobs"),
        ({"prompt": PROMPT, "max_tokens": 4, "seed": -5}, "seed"),
        ({"prompt": [300, 1], "max_tokens": 4}, "prompt"),  # outside the workers' vocabulary
    ],
)
def test_a_bad_completion_request_is_400_naming_the_field(gw, kw, field):
    with pytest.raises(openai.BadRequestError) as e:
        gw.client().completions.create(model=MODEL, **kw)
    assert e.value.status_code == 400 and field in e.value.message


def test_a_bad_chat_request_is_400_naming_the_field(gw):
    with pytest.raises(openai.BadRequestError) as e:
        gw.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert "messages[0].content" in e.value.message
    with pytest.raises(openai.NotFoundError) as nf:
        gw.client().completions.create(model="other", prompt=PROMPT)
    assert "model" in nf.value.message


def test_a_body_that_is_not_json_is_400_naming_the_body(gw):
    r = httpx.post(gw.url + "/v1/completions", content=b"{bad", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"


def overload(cfg: Config, n: int, max_tokens: int, **gateway) -> list[int | str]:
    """`n` requests at once through a gateway with these admission limits: 200, "429 <Retry-After>"
    or another status for each."""
    tight = serve(dataclasses.replace(cfg, gateway=dataclasses.replace(cfg.gateway, **gateway)))
    try:
        c = tight.client()

        def one(i: int) -> int | str:
            try:
                c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, seed=i)
                return 200
            except openai.RateLimitError as e:
                return f"429 {e.response.headers.get('retry-after')}"
            except openai.APIStatusError as e:
                return e.status_code

        with ThreadPoolExecutor(n) as pool:
            return list(pool.map(one, range(n)))
    finally:
        tight.stop()


def test_overload_is_429_with_retry_after_never_5xx(module_cfg, gw):
    got = overload(module_cfg, 8, 48, max_inflight=1, max_queue=0)
    assert 200 in got and any(str(x).startswith("429 ") for x in got), got
    assert all(x == 200 or (isinstance(x, str) and x.split()[-1].isdigit()) for x in got), got


# -- pure parts -----------------------------------------------------------------------------


def test_version_spans_are_contiguous_and_end_exclusive():
    assert version_spans([]) == []
    assert version_spans([3, 3, 4, 4, 4, 5]) == [
        {"version": 3, "start": 0, "end": 2},
        {"version": 4, "start": 2, "end": 5},
        {"version": 5, "start": 5, "end": 6},
    ]


class _Pipe:
    def __init__(self, log: list):
        self.log, self.ops = log, []

    def xadd(self, key, fields, **kw):
        self.ops.append((key, fields))

    def expire(self, key, ttl):
        pass

    def execute(self):
        self.log.append(self.ops)


class _FakeRedis:
    def __init__(self):
        self.log: list = []

    def pipeline(self, transaction=False):
        return _Pipe(self.log)


def test_the_token_streamer_batches_steps_and_sequences_into_few_round_trips():
    fr = _FakeRedis()
    st = TokenStreamer(fr, "w0", flush_ms=1000, flush_steps=4)
    made: dict[str, list[int]] = {f"s{i}": [] for i in range(8)}
    for step in range(40):
        for seq, toks in made.items():
            st.add(seq, f"k:{seq}", 0, len(toks), [step], [0], step * 0.001)
            toks.append(step)
        st.step(step * 0.001)
    for seq in made:
        st.finish(seq)
    assert st.flushes == len(fr.log) <= 40 // 4 + 2  # the first chunk at once, then every 4 steps
    assert len(fr.log[0]) == 8 and fr.log[0][0][1]["index"] == 0  # every sequence's first token, in one trip
    for seq, toks in made.items():
        chunks = [f for trip in fr.log for key, f in trip if key == f"k:{seq}"]
        assert [t for f in chunks for t in orjson.loads(f["tokens"])] == toks
        starts = [f["index"] for f in chunks]
        assert starts == sorted(starts) and starts[0] == 0
    slow = TokenStreamer(_FakeRedis(), "w0", flush_ms=5, flush_steps=100)
    slow.add("a", "k", 0, 0, [1], [0], 0.0)
    slow.step(0.0)  # the first chunk: sent at once
    slow.add("a", "k", 0, 1, [2], [0], 0.001)
    slow.step(0.001)
    assert slow.flushes == 1
    slow.step(0.007)  # the buffered token has waited flush_ms
    assert slow.flushes == 2


def test_task_stream_and_min_version_survive_the_queue_and_a_continuation():
    t = Task(task_id="x", prompt=[1, 2], max_turns=1, tokens_per_turn=8, stream=True, min_version=3, in_step=False)
    back = Task.from_dict(orjson.loads(orjson.dumps(t.to_dict())))
    assert back.stream is True and back.min_version == 3 and back.in_step is False
    ep = Episode(back, "w0", "g", False, 0.0)
    ep.on_token(5, 3, 0.0)
    cont = Task.from_dict(ep.continuation().to_dict())
    assert cont.stream is True and cont.min_version == 3 and cont.partial == [5] and cont.in_step is False
    old = Task.from_dict({"task_id": "y", "prompt": [1]})
    assert old.stream is False and old.min_version == 0 and old.in_step is True
    for bad in ({"stream": "yes"}, {"min_version": -1}, {"in_step": 0}):
        with pytest.raises(InvalidTask):
            Task.from_dict({"task_id": "z", "prompt": [1], **bad})


def test_the_gateway_section_loads_checks_and_hides_its_keys():
    env = {"ROSE_GATEWAY__API_KEYS": "k1, k2", "ROSE_GATEWAY__MAX_QUEUE": "0", "ROSE_GATEWAY__PORT": "9000"}
    g = load_config(env=env).gateway
    assert g.keys == ("k1", "k2") and g.max_queue == 0 and g.port == 9000
    assert load_config(env=env).redacted()["gateway"]["api_keys"] == "***" and "k1" not in repr(g)
    for key, value in [("max_inflight", "0"), ("request_timeout_s", "0"), ("max_queue", "-1"), ("port", "70000")]:
        with pytest.raises(ConfigError, match=f"gateway.{key}"):
            load_config(env={f"ROSE_GATEWAY__{key.upper()}": value})


def test_the_command_refuses_a_bad_port_in_one_line():
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROSE_")}
    p = subprocess.run(
        [sys.executable, "-m", "rose", "gateway", "--port", "70000"], env=clean, capture_output=True, text=True
    )
    assert p.returncode == 2 and p.stderr.strip() == "rose: --port: expected a port 0..65535, got 70000"


def test_admission_hands_places_on_in_order_and_refuses_past_the_queue():
    async def run() -> None:
        a = Admission(max_inflight=1, max_queue=1)
        await a.acquire(1.0)
        waiter = asyncio.ensure_future(a.acquire(1.0))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded):
            await a.acquire(1.0)
        a.release()
        await waiter
        assert a.inflight == 1 and a.waiting == 0
        with pytest.raises(Overloaded):  # queue free, but no place within the timeout
            await a.acquire(0.05)
        a.release()
        assert a.inflight == 0

    asyncio.run(run())


def test_a_turn_past_its_deadline_or_left_by_its_client_is_withdrawn(module_cfg):
    """No worker serves this job: a request ends at its deadline, or when its client leaves, and
    its task leaves the queue either way."""
    cfg = dataclasses.replace(
        module_cfg,
        executor=dataclasses.replace(module_cfg.executor, job="idle"),
        gateway=dataclasses.replace(module_cfg.gateway, request_timeout_s=1.5),
    )
    s = serve(cfg)
    r = redis.Redis.from_url(cfg.redis.url)
    stream = cfg.redis.key("tasks", "idle")
    try:
        with pytest.raises(openai.APIStatusError) as e:
            s.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        assert e.value.status_code == 504 and "request_timeout_s" in e.value.message
        wait_for(lambda: r.xlen(stream) == 0, 5, "the late turn withdrawn")
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):  # the client gives up well before the deadline
            httpx.post(
                s.url + "/v1/completions",
                json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4},
                headers={"Authorization": f"Bearer {KEY}"},
                timeout=0.3,
            )
        wait_for(lambda: r.xlen(stream) == 0, 5, "the abandoned turn withdrawn")
        assert time.monotonic() - t0 < 1.4  # before its deadline: the client leaving withdrew it
        t0 = time.monotonic()
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}
        with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=0.3) as h:
            with h.stream(
                "POST", s.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
            ) as sr:
                assert sr.status_code == 200
                sr.read()
        wait_for(lambda: r.xlen(stream) == 0, 5, "the abandoned streamed turn withdrawn")
        assert time.monotonic() - t0 < 1.4
    finally:
        r.close()
        s.stop()


def test_streamed_turns_do_not_open_a_redis_connection_each(gw, module_cfg):
    """A streamed turn ends without cancelling its pending token-stream read (a cancelled read
    drops its Redis connection): 10 streamed turns, one after another, open fewer than 5
    connections to Redis in all; each turn's streamed ids are its final ids, and its token
    stream is gone once it is answered (the end marker does not keep it)."""
    n = 10
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "stream": True}
    r = redis.Redis.from_url(module_cfg.redis.url)
    try:
        sse(gw.url, "/v1/completions", {**body, "seed": 100})  # the gateway's pools hold their connections
        before = int(r.info("stats")["total_connections_received"])
        runs = [sse(gw.url, "/v1/completions", {**body, "seed": i}) for i in range(n)]
        opened = int(r.info("stats")["total_connections_received"]) - before
        tids = [events[0][1]["id"].removeprefix("cmpl-") for events in runs]
        finals = {
            f[b"task_id"].decode(): orjson.loads(f[b"trajectory"])["turns"][0]["action"]
            for _i, f in r.xrange(module_cfg.redis.key("results", JOB))
            if f[b"task_id"].decode() in tids
        }
        keys = [module_cfg.redis.key("tasks", JOB, "tokens", t) for t in tids]
        wait_for(lambda: r.exists(*keys) == 0, 5, "the answered turns' token streams deleted")
    finally:
        r.close()
    assert opened < n // 2, f"{n} streamed turns opened {opened} Redis connections"
    for tid, events in zip(tids, runs):
        ids, idx = streamed_ids(events)
        assert ids == finals[tid] and idx == list(range(16)), tid


def test_the_end_marker_ends_a_pending_read_is_no_chunk_and_expires(module_cfg):
    """The dispatcher marks a streamed turn's token stream ended before it resolves the turn: a
    read pending on the stream returns at once with no chunk and says the stream ended, and the
    marker gives the stream a short expiry, also when the stream is already gone."""
    d = Dispatcher(module_cfg)
    key = d.queue.token_stream(f"gw-{uuid.uuid4().hex}")
    chunk = {"turn": 0, "index": 0, "tokens": "[7, 8]", "versions": "[0, 0]", "logprobs": "[]", "worker": "w0"}

    async def run() -> None:
        d.r.xadd(key, chunk)
        got, cursor, ended = await d.chunks(key, "0-0", 100)
        assert [(c.index, c.tokens, c.worker) for c in got] == [(0, [7, 8], "w0")] and not ended
        read = asyncio.ensure_future(d.chunks(key, cursor, 10_000))
        await asyncio.sleep(0.1)
        fut = asyncio.get_running_loop().create_future()
        t0 = time.monotonic()
        await asyncio.to_thread(d._answer, [(_Waiter(asyncio.get_running_loop(), fut, None, key), "answer")])
        assert await asyncio.wait_for(fut, 1) == "answer" and d.r.xlen(key) == 2  # marked before resolved
        got, _cursor, ended = await asyncio.wait_for(read, 1)
        assert got == [] and ended and time.monotonic() - t0 < 0.5
        assert 0 < d.r.ttl(key) <= END_TTL_S
        d.r.delete(key)
        d._mark_ends([key])  # the answer deleted the stream already
        assert 0 < d.r.ttl(key) <= END_TTL_S

    async def once() -> None:
        try:
            await run()
        finally:
            d.r.delete(key)
            await d.ar.aclose()
            d.close()

    asyncio.run(once())


# -- last: it stops one of the module's workers ----------------------------------------------


def test_a_streamed_turn_revoked_midway_is_answered_whole(gw, module_cfg, flags):
    """The worker running a streamed turn is stopped mid-turn (a revoke): it hands the tokens
    made so far on as a continuation, the other worker finishes the turn and streams on from the
    next index, and the client gets one answer whose streamed ids are the turn's, in order, with
    every token's version. Fails if the continuation does not carry the tokens already made (the
    next worker redoes the turn from token 0)."""
    rv = revoke_midway(
        gw.url, module_cfg, flags, {"model": MODEL, "prompt": PROMPT, "max_tokens": 120, "seed": 5, "stream": True}
    )
    r = redis.Redis.from_url(module_cfg.redis.url)
    task_id = rv.events[0][1]["id"].removeprefix("cmpl-")
    traj = next(
        orjson.loads(f[b"trajectory"])
        for _i, f in r.xrange(module_cfg.redis.key("results", JOB))
        if f[b"task_id"].decode() == task_id
    )
    r.close()
    events = rv.events
    ids, idx = streamed_ids(events)
    last = events[-1][1]["choices"][0]
    assert idx == list(range(120)) and ids == traj["turns"][0]["action"]  # contiguous, the final ids
    at = [t for t, e in events if e["choices"][0]["finish_reason"] is None and e["choices"][0].get("token_ids")]
    assert at[0] < events[-1][0] and len({round(t, 2) for t in at}) > 2  # streamed, not all at the end
    assert last["finish_reason"] == "length" and covers(last["weight_versions"], 120) == [0] * 120
    assert last["worker"] == rv.other
    # this turn's counters: the holder handed on every token it made (at least those the client
    # held before its pause), the other made only the rest
    made = rv.made(rv.held, "tokens")
    counted = {w: {c: rv.made(w, c) for c in ("tokens", "tokens_carried", "requeued")} for w in (rv.held, rv.other)}
    assert counted == {
        rv.held: {"tokens": made, "tokens_carried": made, "requeued": 1},
        rv.other: {"tokens": 120 - made, "tokens_carried": 120 - made, "requeued": 0},
    }, (rv.received, counted)
    assert rv.received <= made < 120, (rv.received, counted)
