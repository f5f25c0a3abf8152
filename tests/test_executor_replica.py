"""The executor's replica lease path (CONTRACT §7) on the real things: the local Kafka, vllm-router
(PyPI) fronting the session's vLLM server (tests/conftest.py: vllm_server) under two URLs, and a
real rollout worker. The executor runs in this process, its loop on a thread, so a test reads its
published states and can abandon it as a SIGKILL would. On CPU vLLM cannot sleep: the engine
stays awake and idle while lent."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator

import psutil
import pytest

from rose.config import GiB
from rose.contract.wire import encode
from rose.executor.service import Executor
from rose.kafka.producer import make_producer, produce
from rose.router.vllm_router import VllmRouterAdapter
from tests.examples import command_example
from tests.test_executor import wait_until
from tests.test_router import _workers, needs_vllm, router  # noqa: F401 - `router` is a fixture

pytestmark = [pytest.mark.stack, needs_vllm, pytest.mark.timeout(600)]

GPU = "sim/0"


@pytest.fixture
def adapter(router) -> Iterator[VllmRouterAdapter]:  # noqa: F811 - the imported fixture
    a = VllmRouterAdapter(router.url, router.metrics_url)
    yield a
    for w in _workers(router):  # every test leaves both workers in
        a.readmit(w)


class Running:
    """An executor's loop on a thread; `crash` stops it without its shutdown, as SIGKILL would."""

    def __init__(self, ex: Executor):
        self.ex, self.stop = ex.start(), threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            self.ex.run_once()

    def states(self, gpu: str = GPU) -> list[str]:
        return [s.state for s in list(self.ex.published) if s.gpu == gpu]

    def wait_state(self, state: str, timeout: float = 60, gpu: str = GPU) -> None:
        try:
            wait_until(lambda: state in self.states(gpu), timeout, f"lease state {state} of {gpu}")
        except AssertionError as e:  # say what it went through instead
            raise AssertionError(f"{e}; its states: {self.states(gpu)}") from None

    def crash(self) -> None:
        self.stop.set()
        self.thread.join(30)
        assert self.ex.consumer is not None
        self.ex.consumer.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
        self.ex.shutdown(timeout_s=10)


def executor(cfg, router, replica: str | dict[str, str], **executor_settings) -> Executor:  # noqa: F811
    """An executor of GPU, the serving replica `replica` behind `router` (or of each GPU of a
    {gpu: replica}), on cold-started workers."""
    replicas = replica if isinstance(replica, dict) else {GPU: replica}
    e = dataclasses.replace(cfg.executor, warm_workers=0, **executor_settings)
    return Executor(
        dataclasses.replace(cfg, executor=e),
        list(replicas),
        guard=False,
        replicas=replicas,
        router=VllmRouterAdapter(router.url, router.metrics_url),
    )


def send(cfg, kind: str, epoch: int, cid: str, ttl: float = 120.0, gpu: str = GPU) -> None:
    now = time.time()
    c = command_example(
        kind=kind,
        gpu=gpu,
        epoch=epoch,
        command_id=cid,
        lease_id=f"{gpu}#{epoch}",
        mem_bytes=GiB,
        compute_share=1.0,
        ts=now,
        expires_at=now + ttl,
        lease_kind="replica",
    )
    p = make_producer(cfg.kafka)
    produce(p, cfg.kafka.commands_topic, encode(c), gpu)
    p.flush(10)


def in_order(seen: list[str], want: list[str]) -> bool:
    it = iter(seen)
    return all(s in it for s in want)


def test_grant_drains_and_lends_the_replica_and_revoke_brings_it_back(cfg, router, adapter):  # noqa: F811
    w0, w1 = _workers(router)
    run = Running(executor(cfg, router, w0))
    try:
        send(cfg, "grant", 1, "g1")
        run.wait_state("active")
        assert in_order(run.states(), ["draining", "active"])
        assert adapter.serving() == {w1}, "the lent replica is still in the router"
        wait_until(lambda: GPU in run.ex.workers, 30, "the lease's rollout worker started")
        worker = run.ex.workers[GPU].proc
        assert worker.poll() is None, "no rollout worker runs in the lease"
        send(cfg, "revoke", 1, "r1")
        run.wait_state("revoked")
        assert in_order(run.states(), ["draining", "active", "reclaiming", "revoked"])
        assert worker.poll() is not None and GPU not in run.ex.workers
        assert adapter.serving() == {w0, w1}, "the replica is not back in the router"
    finally:
        run.close()


def _stream(url: str, model: str, first_tokens: threading.Event, release: threading.Event, out: dict) -> None:
    """A long streaming completion through the router that stops reading after its first tokens
    until `release`. The router counts a request in flight until the engine has generated all of it
    (it buffers what the client does not read), so only the engine's time holds it there: 32
    completions of 1000 tokens stay in flight 12.7 s on the 2-core machine (4 completions: 5.6 s),
    against well under a second from the grant to the executor's drain deadline."""
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 1000, "n": 32, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:  # noqa: S310 - local router
            for n, raw in enumerate(r):
                if n >= 3 and not first_tokens.is_set():
                    first_tokens.set()
                    release.wait(120)
                out["done"] = raw.strip() == b"data: [DONE]" or out.get("done", False)
    except OSError as e:
        out["error"] = repr(e)
    first_tokens.set()


def test_a_replica_that_does_not_drain_in_time_is_readmitted_and_its_grant_rejected(
    cfg,
    router,  # noqa: F811
    adapter,
    vllm_server,
):
    """Both replicas are the executor's (GPUs sim/0 and sim/1), so the grant goes, at once, to the
    one the stream runs on."""
    by_gpu = dict(zip((GPU, "sim/1"), _workers(router), strict=True))
    run = Running(executor(cfg, router, by_gpu, drain_timeout_s=0.5))
    first_tokens, release, streamed = threading.Event(), threading.Event(), {}
    t = threading.Thread(target=_stream, args=(router.url, vllm_server.model, first_tokens, release, streamed))
    t.start()
    try:
        assert first_tokens.wait(120), f"the stream gave no tokens: {streamed}"
        busy = [g for g, w in by_gpu.items() if adapter.in_flight(w)]
        assert len(busy) == 1, f"the stream is in flight on {busy}, not on one replica: {streamed}"
        (gpu,) = busy
        send(cfg, "grant", 1, "g1", gpu=gpu)
        run.wait_state("rejected", gpu=gpu)
        assert run.states(gpu) == ["draining", "rejected"]
        (rejected,) = [s for s in list(run.ex.published) if s.gpu == gpu and s.state == "rejected"]
        assert rejected.reason.startswith("drain_timeout: "), rejected  # published with the reason
        assert by_gpu[gpu] in adapter.serving(), "the replica that did not drain was not readmitted"
        assert gpu not in run.ex.workers, "rollout ran on a replica that did not drain"
        send(cfg, "renew", 1, "n1", gpu=gpu)  # the rejected lease stays fenced
        wait_until(lambda: len(run.states(gpu)) >= 3, 60, "the renewal's answer")
        assert run.states(gpu)[2] == "rejected" and gpu not in run.ex.workers
    finally:
        release.set()
        t.join(300)
        run.close()
    assert streamed.get("done") and "error" not in streamed, f"the stream in flight failed: {streamed}"


def test_a_restarted_executor_readmits_the_replica_its_dead_predecessor_lent(cfg, router, adapter):  # noqa: F811
    """The first executor dies with the replica lent (its loop stops, no shutdown); its rollout
    worker goes with it (PR_SET_PDEATHSIG), and a process standing for one that has not exited yet
    is noted in its place: the next executor stops that process, then readmits the replica."""
    w0, w1 = _workers(router)
    first = Running(executor(cfg, router, w0, revoke_deadline_s=1.0))
    send(cfg, "grant", 1, "g1")
    first.wait_state("active")
    wait_until(lambda: GPU in first.ex.workers, 30, "the lease's rollout worker started")
    first.crash()
    assert adapter.serving() == {w1}
    left = subprocess.Popen(["sleep", "300"])
    note = {"pid": left.pid, "create_time": psutil.Process(left.pid).create_time()}
    first.ex.replica._marker(GPU).write_text(json.dumps(note))
    started = time.monotonic()
    second = Running(executor(cfg, router, w0, revoke_deadline_s=1.0))
    try:
        wait_until(lambda: w0 in adapter.serving(), 60, "the lent replica readmitted after the restart")
        assert left.poll() is not None, "the replica was readmitted with the old lease's rollout process left"
        assert "expired" in second.states()
        assert time.monotonic() - started < 120.0  # within the lease's TTL
    finally:
        second.close()
        if left.poll() is None:
            left.kill()
        left.wait(10)
