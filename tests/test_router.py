"""Replica leases' router adapters against the real things: vllm-router (PyPI) fronting vLLM's
OpenAI server on the tiny checkpoint, the one server reached through two relays so the router has
two workers (tests/relay.py: a relay can hold a reply, so a stream stays in flight for as long as
a test needs); and the readiness endpoint read by a real HTTP client. The router starts once for
the module."""

from __future__ import annotations

import importlib.util
import json
import re
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest

from rose.router.base import RouterError
from rose.router.process import RouterProcess, router_argv, start_router, stop_router
from rose.router.readiness import ReadinessAdapter
from rose.router.vllm_router import VllmRouterAdapter
from rose.stack.ports import free_port
from tests.relay import Relay, stream_completion

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("vllm_router") is None,
    reason="needs vLLM and vllm-router installed",
)


@pytest.fixture(scope="module")
def relays(vllm_server) -> Iterator[dict[str, Relay]]:
    """The router's two workers, by URL: each a relay to the one vLLM server."""
    target = urllib.parse.urlsplit(vllm_server.url)
    rs = [Relay((target.hostname, target.port)) for _ in range(2)]
    try:
        yield {r.url: r for r in rs}
    finally:
        for r in rs:
            r.close()


@pytest.fixture(scope="module")
def router(relays, tmp_path_factory) -> Iterator[RouterProcess]:
    rp = start_router(list(relays), tmp_path_factory.mktemp("router") / "router.log")
    try:
        yield rp
    finally:
        stop_router(rp)


@pytest.fixture
def adapter(router, relays) -> Iterator[VllmRouterAdapter]:
    a = VllmRouterAdapter(router.url, router.metrics_url)
    yield a
    for r in relays.values():  # every test leaves no reply held and both workers in
        r.release()
    for w in _workers(router):
        a.readmit(w)


def _workers(router: RouterProcess) -> list[str]:
    argv = router.proc.args
    return list(argv[argv.index("--worker-urls") + 1 :])


MAX_STREAM_TOKENS = 1000  # with the 3-token prompt, within the server's max_model_len (1024)
HELD_AFTER_BYTES = 8192  # a held stream's client still reads its first tokens (about 250 bytes each)


def hold_the_stream(relays: dict[str, Relay], first_tokens: threading.Event, in_flight) -> str:
    """Once a stream started after `hold_replies_after` on every relay gave its first tokens: the
    one worker it is in flight on (by the router's count), every other relay released."""
    assert first_tokens.wait(120), "the stream gave no tokens"
    busy = [w for w in relays if in_flight(w)]
    assert len(busy) == 1, f"expected the stream in flight on one worker, got {busy}"
    for w, r in relays.items():
        if w != busy[0]:
            r.release()
    return busy[0]


def _complete(url: str, model: str, prompt: list[int], max_tokens: int = 4) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310 - local router
        return json.loads(r.read())["choices"][0]["token_ids"]


def _processed(router: RouterProcess) -> dict[str, float]:
    """The router's own count of requests it sent to each worker."""
    with urllib.request.urlopen(router.metrics_url + "/metrics", timeout=10) as r:  # noqa: S310 - local router
        text = r.read().decode()
    return {
        m[1]: float(m[2])
        for m in re.finditer(r'^vllm_router_processed_requests_total\{worker="([^"]*)"\} (\S+)$', text, re.M)
    }


@needs_vllm
@pytest.mark.timeout(600)  # the server's start (tests/conftest.py: vllm_server) counts here
def test_requests_through_the_router_are_answered_by_both_workers(router, adapter, vllm_server):
    assert adapter.serving() == frozenset(_workers(router))
    for i in range(4):
        assert len(_complete(router.url, vllm_server.model, [1, 2, 3 + i])) == 4


@needs_vllm
def test_a_removed_worker_finishes_its_stream_and_gets_no_new_request_until_readmitted(
    router, adapter, relays, vllm_server
):
    """Remove the worker a streaming completion runs on: the stream ends with every token asked
    for, every request sent meanwhile is answered, and the router sends none of them to the
    removed worker; readmitted, the worker is in the routing set again. The worker's relay holds
    the stream's reply after its first tokens until the removal is done, so it is still in flight
    then, however fast the engine decodes."""
    streamed: dict[str, object] = {}
    first_tokens = threading.Event()

    for r in relays.values():
        r.hold_replies_after(HELD_AFTER_BYTES)
    t = threading.Thread(
        target=stream_completion,
        args=(router.url, vllm_server.model, MAX_STREAM_TOKENS, first_tokens, streamed),
        daemon=True,
    )
    t.start()
    gone = hold_the_stream(relays, first_tokens, adapter.in_flight)
    adapter.remove(gone)
    assert gone not in adapter.serving()
    adapter.remove(gone)  # a second removal is a no-op
    (other,) = set(_workers(router)) - {gone}
    with pytest.raises(RouterError, match="last worker"):
        adapter.remove(other)
    before = _processed(router).get(gone, 0.0)
    for i in range(4):
        assert len(_complete(router.url, vllm_server.model, [9, 8, i])) == 4
    assert _processed(router).get(gone, 0.0) == before, "the router sent a new request to the removed worker"
    assert adapter.in_flight(gone) == 1, "the stream is not in flight on the removed worker"
    relays[gone].release()
    assert adapter.wait_drained(gone, timeout_s=240), "the removed worker's stream never finished"
    t.join(60)
    assert streamed == {"tokens": MAX_STREAM_TOKENS, "done": True}
    adapter.readmit(gone)
    assert adapter.serving() == frozenset(_workers(router))
    assert len(_complete(router.url, vllm_server.model, [1, 1, 1])) == 4


@needs_vllm
def test_the_router_runs_only_policies_that_count_requests_in_flight():
    """A drain reads the router's in-flight count (`VllmRouterAdapter.in_flight`), which only
    `cache_aware` (the default) and `power_of_two` keep."""

    def policy(*given: str) -> str:
        argv = router_argv(["http://127.0.0.1:8001"], 8000, 8002, 10.0, *given)
        return argv[argv.index("--policy") + 1]

    assert policy() == "cache_aware" and policy("power_of_two") == "power_of_two"
    with pytest.raises(RouterError, match="'round_robin' is not one of .*in-flight count"):
        policy("round_robin")


def test_a_router_that_does_not_answer_is_one_clear_error():
    url = f"http://127.0.0.1:{free_port()}"
    a = VllmRouterAdapter(url, timeout_s=2)
    with pytest.raises(RouterError, match=re.escape(url) + r".*does not answer.*router\.url"):
        a.serving()
    with pytest.raises(RouterError, match="does not answer"):
        a.remove("http://127.0.0.1:1")


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 - local endpoint
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_the_readiness_endpoint_answers_503_while_a_replica_is_out():
    replicas = ["replica-a", "http://10.0.0.2:8000"]
    r = ReadinessAdapter(replicas)
    try:
        probe = {x: r.url + "/ready/" + urllib.parse.quote(x, safe="") for x in replicas}
        assert [_status(probe[x]) for x in replicas] == [200, 200]
        r.remove("http://10.0.0.2:8000")
        assert r.serving() == frozenset({"replica-a"})
        assert [_status(probe[x]) for x in replicas] == [200, 503]
        assert _status(probe["http://10.0.0.2:8000"]) == 503
        assert r.not_ready_answers("http://10.0.0.2:8000") == 2
        assert r.in_flight("replica-a") is None
        r.readmit("http://10.0.0.2:8000")
        assert [_status(probe[x]) for x in replicas] == [200, 200]
        assert _status(r.url + "/ready/nobody") == 404
        assert _status(r.url + "/elsewhere") == 404
        with pytest.raises(RouterError, match="unknown replica 'nobody'"):
            r.remove("nobody")
    finally:
        r.close()
