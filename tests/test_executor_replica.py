"""The executor's replica lease path (CONTRACT §7) on the real things: the local Kafka, vllm-router
(PyPI) fronting the session's vLLM server (tests/conftest.py: vllm_server) under two URLs, and a
real rollout worker. The executor runs in this process, its loop on a thread, so a test reads its
published states and can abandon it as a SIGKILL would; the SIGKILL test runs `rose executor`
processes. On CPU vLLM cannot sleep: the engine stays awake and idle while lent."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import orjson
import psutil
import pytest
import redis

from rose.config import GiB, PoolConfig
from rose.contract.events import Command
from rose.contract.records import Heartbeat, WorkerRegistry
from rose.contract.wire import encode
from rose.executor import replica_lease as rl
from rose.executor.service import Executor
from rose.kafka.producer import make_producer, produce
from rose.rollout.episode import Task
from rose.rollout.policy_model import ModelSpec, init_state_dict
from rose.rollout.tasks import TaskQueue
from rose.router.vllm_router import VllmRouterAdapter
from rose.weights.stream import WeightPublisher
from tests.examples import command_example
from tests.relay import stream_completion
from tests.test_executor import JOB, ExecutorProc, LeaseStates, env_for, wait_until
from tests.test_router import (  # noqa: F401 - `relays` and `router` are fixtures
    HELD_AFTER_BYTES,
    _complete,
    _workers,
    hold_the_stream,
    needs_vllm,
    relays,
    router,
)

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


def send(cfg, kind: str, epoch: int, cid: str, ttl: float = 120.0, gpu: str = GPU) -> Command:
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
    return c


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


def test_a_replica_that_does_not_drain_in_time_is_readmitted_and_its_grant_rejected(
    cfg,
    router,  # noqa: F811
    relays,  # noqa: F811
    adapter,
    vllm_server,
):
    """Both replicas are the executor's (GPUs sim/0 and sim/1), so the grant goes, at once, to the
    one the stream runs on."""
    by_gpu = dict(zip((GPU, "sim/1"), _workers(router), strict=True))
    run = Running(executor(cfg, router, by_gpu, drain_timeout_s=0.5))
    first_tokens, streamed = threading.Event(), {}
    for r in relays.values():
        r.hold_replies_after(HELD_AFTER_BYTES)
    t = threading.Thread(target=stream_completion, args=(router.url, vllm_server.model, 1000, first_tokens, streamed))
    t.start()
    try:
        busy = hold_the_stream(relays, first_tokens, adapter.in_flight)
        (gpu,) = [g for g, w in by_gpu.items() if w == busy]
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
        for r in relays.values():
            r.release()
        t.join(300)
        run.close()
    assert streamed.get("done") and "error" not in streamed, f"the stream in flight failed: {streamed}"


def test_a_restarted_executor_readmits_the_replica_its_dead_predecessor_lent(cfg, router, adapter):  # noqa: F811
    """The first executor dies with the replica lent (its loop stops, no shutdown); its rollout
    worker goes with it (PR_SET_PDEATHSIG), and a process standing for one that does not exit is
    noted in its place: the next executor kills that process past its revoke deadline, then
    readmits the replica within the restart's reclaim bound. (A real SIGKILL, the worker's drain:
    test_sigkill_of_the_executor_while_its_replica_is_lent.)"""
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
    second = Running(executor(cfg, router, w0, revoke_deadline_s=1.0))
    try:
        wait_until(lambda: w0 in adapter.serving(), 60, "the lent replica readmitted after the restart")
        back_s = time.monotonic() - second.ex.replica._started_at  # from the restart's reconcile
        assert left.poll() is not None, "the replica was readmitted with the old lease's rollout process left"
        assert "expired" in second.states()
        calls_s = PoolConfig().wake_s + PoolConfig().readmit_s
        bound_s = rl.restart_reclaim_bound_s(1.0, cfg.executor.restart_backoff_s, calls_s)
        # the leftover gets no SIGTERM from this executor: it is SIGKILLed only past the revoke deadline
        # (1.0 s), so the replica cannot be back before it, and must be by the bound (+ the 0.1 s poll)
        assert back_s > 1.0, f"readmitted {back_s:.2f} s after the restart, before the revoke deadline"
        assert back_s <= bound_s + 0.1, f"readmitted {back_s:.2f} s after the restart, past the bound {bound_s:.2f} s"
    finally:
        second.close()
        if left.poll() is None:
            left.kill()
        left.wait(10)


# The SIGKILL test's grant: long enough for the lent worker's cold start (torch and the model, at
# nice 5 on the busy 2-core machine: up to 15 s) and its first tokens before the kill
TTL_S = 30.0
# one turn of 1000 tokens after a 4-token prompt (the reference model's max_seq is 1024): at the
# lent worker's ~150 tokens/s (docs/measured/cpu/bench-replica.json) shared by 8 episodes, every
# turn is still being decoded for tens of seconds after its first tokens
TURN_TOKENS, EPISODES = 1000, 8


def _long_turns(cfg) -> TaskQueue:
    q = TaskQueue(redis.Redis.from_url(cfg.redis.url), cfg.redis, JOB)
    for i in range(EPISODES):
        q.submit(Task(f"long-{i}", [1 + i, 2, 3, 4], max_turns=1, tokens_per_turn=TURN_TOKENS, obs_tokens=0, seed=i))
    return q


def _beat(reg: WorkerRegistry, wid: str, pred, timeout: float, what: str) -> Heartbeat:
    deadline, hb = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        hb = reg.read(wid)
        if hb is not None and pred(hb):
            return hb
        time.sleep(0.05)
    raise AssertionError(f"{what} within {timeout}s; the worker's last heartbeat: {hb}")


def _watch_readmission(adapter: VllmRouterAdapter, url: str, model: str, out: dict) -> None:
    """Polls the router until it lists `url`, then sends a one-token completion straight to it;
    `out["back"]`: the monotonic time it answered."""
    deadline = time.monotonic() + 300
    while url not in adapter.serving() and time.monotonic() < deadline:
        time.sleep(0.02)
    out["listed"] = time.monotonic()
    out["tokens"] = _complete(url, model, [1, 2, 3], max_tokens=1)
    out["back"] = time.monotonic()


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `procs` still running (a zombie has exited: its memory is back)."""
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def _handed_on(q: TaskQueue) -> tuple[list[Task], list[dict]]:
    """The tasks in the shared stream (each entry decoded) and the results."""
    tasks = [Task.from_dict(orjson.loads(f[b"task"])) for _i, f in q.r.xrange(q.stream)]
    return tasks, q.all_results()


def test_sigkill_of_the_executor_while_its_replica_is_lent(cfg, tmp_path, router, adapter, vllm_server, redis_client):  # noqa: F811
    """`rose executor` (a process) lends its replica; its cold rollout worker decodes 8 turns of 1000
    tokens, with policy version 2 published mid-turn; the executor is SIGKILLed. The worker gets
    SIGTERM (PR_SET_PDEATHSIG) and hands each episode on as a continuation with its tokens and
    their versions; a new `rose executor`, started at once as a supervisor would, publishes the
    lease `expired` and readmits the replica, answering, within the lease's TTL and the restart's
    reclaim bound (replica_lease.restart_reclaim_bound_s), no process of the old lease left."""
    w0, w1 = _workers(router)
    env = env_for(
        cfg,
        tmp_path,
        ROSE_ROUTER__URL=router.url,
        ROSE_ROUTER__METRICS_URL=router.metrics_url,
        ROSE_EXECUTOR__WORKER_WEIGHTS="follow",
        ROSE_EXECUTOR__WARM_WORKERS="0",
    )
    args = ("--replica", f"{GPU}={w0}")
    pub = WeightPublisher(redis_client, cfg.redis, cfg.executor.model)
    pub.publish(init_state_dict(ModelSpec(), 1))  # version 1, before the lease
    q, states, watched = _long_turns(cfg), LeaseStates(cfg), {}
    reg = WorkerRegistry(redis_client, cfg.redis.key, q.workers_key)
    first, second = ExecutorProc(env, args=args), None
    try:
        grant = send(cfg, "grant", 1, "g1", ttl=TTL_S)
        states.wait("active", 1, timeout=60)
        assert adapter.serving() == {w1}, "the lent replica is still in the router"
        wid = f"{socket.gethostname()}:{GPU}:1"  # rose.executor.workers.worker_config
        hb = _beat(reg, wid, lambda h: h.tokens > 0 and h.version == 1, 120, "the lent worker's first tokens")
        pub.publish(init_state_dict(ModelSpec(), 2))  # version 2, mid-turn
        hb = _beat(reg, wid, lambda h: h.version == 2, 60, "version 2 applied")
        hb = _beat(reg, wid, lambda h, n=hb.tokens: h.tokens > n, 60, "tokens of version 2")
        assert hb.episodes_done == 0 and hb.active == EPISODES, f"every turn in flight at the kill: {hb}"
        lease_procs = psutil.Process(first.proc.pid).children(recursive=True)
        assert hb.pid in [p.pid for p in lease_procs], f"worker {hb.pid} is not the executor's: {lease_procs}"
        killed_wall, killed = time.time(), time.monotonic()
        assert killed_wall < grant.expires_at, "the lease ran out before the kill"
        first.proc.kill()
        first.proc.wait(10)
        watcher = threading.Thread(target=_watch_readmission, args=(adapter, w0, vllm_server.model, watched))
        watcher.start()
        second = ExecutorProc(env, args=args)  # as a supervisor would, at once
        watcher.join(300)
        assert "back" in watched and watched["tokens"], f"the replica was not readmitted and answering: {watched}"
        back_s = watched["back"] - killed
        revoke_deadline_s = float(env["ROSE_EXECUTOR__REVOKE_DEADLINE_S"])
        calls_s = PoolConfig().wake_s + PoolConfig().readmit_s
        reclaim_s = rl.restart_reclaim_bound_s(revoke_deadline_s, cfg.executor.restart_backoff_s, calls_s)
        ttl_left_s = grant.expires_at - killed_wall
        print(
            f"SIGKILL -> readmitted and answering: {back_s:.2f} s (listed {watched['listed'] - killed:.2f} s); "
            f"the lease's TTL {TTL_S} s, {ttl_left_s:.1f} s of it left at the kill; reclaim bound {reclaim_s} s"
        )
        # by the lease's end + the reclaim bound: within TTL + reclaim of the SIGKILL, however late in the lease
        assert back_s <= ttl_left_s + reclaim_s, f"readmitted {back_s:.2f} s after the SIGKILL"
        assert not _alive(lease_procs), f"processes of the old lease left: {_alive(lease_procs)}"
        states.wait("expired", 1, timeout=30)
        seen = states.states()
        assert ("active", 1) not in seen[seen.index(("expired", 1)) :], f"the old lease came back: {seen}"
        _check_handed_on(q, reg.read(wid))
    finally:
        if second is not None:
            second.stop()
        first.stop()
        states.close()


def _check_handed_on(q: TaskQueue, hb: Heartbeat | None) -> None:
    """Every episode is in the queue or completed, exactly once; each continuation carries its
    turn's tokens with one published version each (1, then 2), and every token decoded is there."""
    assert hb is not None and hb.state == "stopped", f"the worker did not drain on its SIGTERM: {hb}"
    tasks, results = _handed_on(q)
    ids = sorted([t.task_id for t in tasks] + [r["task_id"] for r in results])
    assert ids == sorted(f"long-{i}" for i in range(EPISODES)), f"lost or duplicated: {ids}"
    assert q.r.xpending(q.stream, q.group)["pending"] == 0, "entries left held by the dead worker"
    carried = [t for t in tasks if t.moves == 1]
    assert len(carried) == hb.requeued and hb.lost == 0, (len(carried), hb)
    for t in carried:
        assert t.partial and len(t.partial) == len(t.partial_versions), t.task_id
        assert t.partial_versions == sorted(t.partial_versions) and set(t.partial_versions) <= {1, 2}, t.task_id
        assert len(t.partial_logprobs) in (0, len(t.partial)), t.task_id
    assert any(set(t.partial_versions) == {1, 2} for t in carried), "no turn carries tokens of both versions"
    done_tokens = sum(len(turn["action"]) for r in results for turn in r["turns"])
    assert sum(len(t.partial) for t in carried) + done_tokens == hb.tokens == hb.tokens_carried, hb
