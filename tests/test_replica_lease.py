"""The replica lease path's pure step (rose.executor.replica_lease) with the lease machine beside it,
over arbitrary command, drain, failure and time sequences. A small world does what the shell
would: it keeps whether the replica is in its router, runs the pretend rollout worker, answers
each step's action (ok or failed, as drawn) and feeds the result back."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rose.child_server import free_port
from rose.config import GiB
from rose.executor import lease_machine as lm
from rose.executor import replica_lease as rl
from tests.test_executor import env_for
from tests.test_lease_machine import GPU
from tests.test_lease_machine import cmd as lease_cmd

URL = "http://127.0.0.1:8001"
P = rl.Params(drain_timeout_s=3.0, retry_s=1.0)
LP = lm.Params(revoke_deadline_s=2.0, restart_backoff_s=1.0)


def cmd(kind: str, epoch: int, cid: str, ttl: float = 20.0, lease_kind: str = "replica"):
    """tests.test_lease_machine's command on the whole device, of `lease_kind`."""
    return replace(lease_cmd(kind, epoch, cid, mem=8 * GiB, share=1.0, ttl=ttl), lease_kind=lease_kind)


class World:
    def __init__(self, answers: list[bool] | None = None, in_flight: list[int] | None = None):
        self.r, self.s, self.now = rl.initial(GPU, URL), lm.initial(GPU), 0.0
        self.in_router, self.worker = True, False
        self.answers, self.in_flight = list(answers or []), list(in_flight or [])
        self.published: list[lm.Record] = []
        self.replica_leases: set[str] = set()  # the leases that drained their replica
        self.done: list[str] = []
        self.reports: list[str] = []

    def send(self, inp: rl.Input) -> None:
        self.r, acts = rl.step(self.r, inp, self.now, self.s, P)
        self._do(acts)

    def lease_input(self, inp: lm.Input) -> None:
        self.s, acts = lm.step(self.s, inp, self.now, LP)
        self.r, out = rl.on_lease_actions(self.r, acts, self.now)
        self._do(out)

    def _do(self, acts) -> None:
        for a in acts:
            if isinstance(a, rl.Forward):
                self.lease_input(a.received)
            elif isinstance(a, rl.Fence):
                self.s = rl.fence(self.s, a.record)
                self._publish(a.record)
            elif isinstance(a, lm.Publish):
                self._publish(a.record)
            elif isinstance(a, rl.Report):
                self.reports.append(a.event)
            elif isinstance(a, rl.ReadDrain):
                self.send(rl.InFlight(self.in_flight.pop(0) if self.in_flight else 0))
            elif isinstance(a, rl.Do):
                ok = self.answers.pop(0) if self.answers else True
                if ok and a.what == "remove":
                    self.in_router = False
                if ok and a.what == "readmit":
                    self.in_router = True
                self.done.append(a.what)
                self.send(rl.Done(a.what, ok, "" if ok else "drawn to fail"))
            elif isinstance(a, lm.Start):
                if a.lease_id in self.replica_leases:
                    assert not self.in_router, "rollout started on a replica still in its router"
                    assert self.r.phase == "lent"
                else:  # a co-resident lease: only beside a serving replica
                    assert self.r.phase == "serving" and self.in_router
                self.worker = True
            elif isinstance(a, lm.Stop | lm.Kill):
                pass  # the worker exits at the next `exit` of the sequence

    def _publish(self, rec: lm.Record) -> None:
        if rec.state in ("revoked", "expired") and rec.epoch == self.r.epoch and rec.lease_id == self.r.lease_id:
            assert self.in_router, f"{rec.state} published while the replica is out of its router"
        if self.r.phase != "serving" and self.r.lease_id:  # the newest word says the replica is out
            assert rec.epoch <= self.r.epoch, f"{rec.state} of a newer lease published while the replica is out"
        if rec.state == "draining":
            self.replica_leases.add(rec.lease_id)
        self.published.append(rec)

    def worker_exits(self) -> None:
        if self.worker:
            self.worker = False
            self.lease_input(lm.WorkerExited())

    def tick(self, dt: float) -> None:
        self.now += dt
        self.lease_input(lm.Tick())
        self.send(lm.Tick())

    def states(self) -> list[str]:
        return [r.state for r in self.published]


def test_grant_drains_lends_and_a_revoke_reclaims_before_revoked():
    w = World(in_flight=[2, 0])
    w.send(lm.Received(cmd("grant", 1, "g1")))
    assert w.states() == ["draining"] and not w.in_router and not w.worker
    w.tick(0.1)  # 2 in flight: still draining
    assert w.r.phase == "draining" and not w.worker
    w.tick(0.1)  # drained: the engine sleeps, the grant goes to the lease machine
    assert w.r.phase == "lent" and w.worker and w.states() == ["draining", "active"]
    assert w.done == ["remove", "sleep"]
    w.send(lm.Received(cmd("revoke", 1, "r1")))
    assert w.states()[-1] == "revoking" and w.r.phase == "lent"
    w.worker_exits()
    assert w.states()[2:] == ["revoking", "reclaiming", "revoked"] and w.in_router
    assert w.done[2:] == ["wake", "health", "readmit"] and w.r.phase == "serving"


def test_an_engine_that_cannot_sleep_is_reported_and_not_woken():
    w = World(answers=[True, False])  # remove ok, sleep refused (CPU)
    w.send(lm.Received(cmd("grant", 1, "g1")))
    w.tick(0.1)
    assert w.r.phase == "lent" and not w.r.slept and "replica.engine_stays_awake" in w.reports
    w.tick(30.0)  # the lease expires
    w.worker_exits()
    assert w.states()[-2:] == ["reclaiming", "expired"] and "wake" not in w.done and w.in_router


def test_a_drain_past_its_timeout_readmits_and_rejects_the_grant():
    w = World(in_flight=[1] * 100)
    w.send(lm.Received(cmd("grant", 1, "g1")))
    while w.r.phase == "draining":
        w.tick(0.5)
    assert w.states() == ["draining", "rejected"] and w.in_router and not w.worker
    assert "replica.drain_timeout" in w.reports and w.now >= P.drain_timeout_s
    assert w.published[-1].reason == "drain_timeout: 1 requests still in flight after executor.drain_timeout_s"
    w.send(lm.Received(cmd("renew", 1, "n1")))  # the rejected lease stays fenced
    assert w.states()[-1] == "rejected" and not w.worker


def test_a_failed_wake_is_retried_and_the_replica_comes_back():
    w = World(answers=[True, True, False, False])  # remove, sleep ok; two wakes fail
    w.send(lm.Received(cmd("grant", 1, "g1")))
    w.tick(0.1)
    w.send(lm.Received(cmd("revoke", 1, "r1")))
    w.worker_exits()
    assert w.r.phase == "reclaiming" and not w.in_router and w.reports.count("replica.wake_failed") == 1
    while w.r.phase == "reclaiming":
        w.tick(0.5)
    assert w.done.count("wake") == 3 and w.in_router and w.states()[-1] == "revoked"


def test_a_grant_the_replica_cannot_take_is_rejected_and_fenced_without_leaving_the_router():
    gang = replace(cmd("grant", 1, "g1"), group_id="g", group_size=2)
    late = replace(cmd("grant", 2, "g2"), expires_at=900.0)
    for c, why in ((gang, "gang"), (late, "expired")):
        w = World()
        w.send(lm.Received(c))
        assert w.states() == ["rejected"] and w.in_router and w.done == [] and w.s.highest_epoch == c.epoch, why
        assert why in w.published[-1].reason, w.published[-1]


def test_a_newer_coresident_grant_while_lent_reclaims_the_replica_before_any_worker_starts():
    """A co-resident grant of a newer epoch reaches a lent replica's GPU: it ends the replica lease
    as a newer epoch ends any lease, but starts nothing beside a replica that is out of its router.
    The replica is reclaimed (rollout stopped, health checked past a failure, readmitted); the old
    lease is `revoked` only once it serves, and the grant `rejected` and fenced after it, the
    newest word all along saying the replica is out; the scheduler's next grant starts beside the
    serving replica."""
    w = World(answers=[True, False, False])  # remove ok, sleep refused, the first health check fails
    w.send(lm.Received(cmd("grant", 1, "g1")))
    w.tick(1.0)
    assert w.r.phase == "lent" and w.worker and not w.in_router
    w.send(lm.Received(cmd("grant", 2, "g2", lease_kind="coresident")))
    assert w.s.lease is None and "replica.superseded" in w.reports and w.states()[2:] == ["revoking"]
    w.send(lm.Received(cmd("renew", 2, "n2", lease_kind="coresident")))  # no word until the replica serves
    w.worker_exits()  # the lent worker is gone: the replica is reclaimed, nothing starts
    assert (
        w.r.phase == "reclaiming" and not w.worker and not w.in_router and w.states()[2:] == ["revoking", "reclaiming"]
    )
    while w.r.phase == "reclaiming":
        w.tick(0.5)
    assert w.in_router and not w.worker and w.done[2:] == ["health", "health", "readmit"]
    assert [(r.epoch, r.state) for r in w.published[2:]] == [
        (1, "revoking"),
        (1, "reclaiming"),
        (1, "revoked"),
        (2, "rejected"),
    ]
    assert w.published[-2].command_id == "g2" and "lent for lease node-1/0#1" in w.published[-1].reason
    assert w.s.highest_epoch == 2 and w.s.truth == w.published[-1]
    w.lease_input(lm.Received(cmd("renew", 2, "n3", lease_kind="coresident")))  # epoch 2 stays fenced
    assert w.states()[-1] == "rejected" and not w.worker
    w.lease_input(lm.Received(cmd("grant", 3, "g3", lease_kind="coresident")))
    assert w.worker and w.states()[-1] == "active" and w.r.phase == "serving"


def test_a_newer_grant_while_draining_readmits_and_is_rejected():
    """Nothing ran on a draining replica: a newer grant readmits it at once, its lease `revoked`
    once it serves, and the grant is rejected and fenced (the scheduler grants again)."""
    w = World(in_flight=[2])
    w.send(lm.Received(cmd("grant", 1, "g1")))
    w.send(lm.Received(cmd("grant", 2, "g2")))
    assert w.r.phase == "serving" and w.in_router and w.done == ["remove", "readmit"] and not w.worker
    assert [(r.epoch, r.state) for r in w.published] == [(1, "draining"), (1, "revoked"), (2, "rejected")]
    assert w.s.highest_epoch == 2 and w.s.truth == w.published[-1]


def test_a_restart_readmits_a_replica_the_router_does_not_list():
    r, acts = rl.restart(GPU, URL, listed=False)
    assert r.phase == "reclaiming" and rl.Do(GPU, "leftover") in acts
    r, acts = rl.step(r, rl.Done("leftover", True), 0.0, lm.initial(GPU), P)
    assert acts == (rl.Do(GPU, "wake"),)
    r, acts = rl.step(r, rl.Done("wake", True), 0.0, lm.initial(GPU), P)
    r, acts = rl.step(r, rl.Done("health", True), 0.0, lm.initial(GPU), P)
    assert acts == (rl.Do(GPU, "readmit"),)
    r, acts = rl.step(r, rl.Done("readmit", True), 0.0, lm.initial(GPU), P)
    assert r.phase == "serving" and acts == ()
    assert rl.restart(GPU, URL, listed=True) == (rl.initial(GPU, URL), ())


@pytest.mark.parametrize(("deadline", "retry", "tick"), [(2.0, 1.0, 0.005), (3.0, 1.0, 0.05), (0.5, 2.0, 0.005)])
def test_a_restart_whose_leftover_process_never_exits_readmits_within_the_bound(deadline, retry, tick):
    """The worst case of `restart_reclaim_bound_s`: the dead executor's rollout process does not
    exit on its SIGTERM, so the shell (ReplicaShell._no_leftover) kills it at the first check past
    the revoke deadline; the readmission comes within the bound (calls answering at once)."""
    p = rl.Params(drain_timeout_s=3.0, retry_s=retry)
    now, killed, readmitted_at = 0.0, False, None
    r, acts = rl.restart(GPU, URL, listed=False)
    while readmitted_at is None:
        assert now < 60, "no readmission"
        for a in (x for x in acts if isinstance(x, rl.Do)):
            ok = a.what != "leftover" or killed
            killed = killed or (a.what == "leftover" and now > deadline)
            readmitted_at = now if a.what == "readmit" else None
            r, acts = rl.step(r, rl.Done(a.what, ok), now, lm.initial(GPU), p)
            break
        else:
            now += tick
            r, acts = rl.step(r, lm.Tick(), now, lm.initial(GPU), p)
    assert deadline < readmitted_at <= rl.restart_reclaim_bound_s(deadline, retry, 0.0)
    assert r.phase == "serving"


EVENTS = st.one_of(
    st.tuples(st.just("cmd"), st.sampled_from(["grant", "renew", "revoke"]), st.integers(1, 4), st.booleans()),
    st.tuples(st.just("tick"), st.floats(0.01, 4.0)),
    st.tuples(st.just("exit")),
)


@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(EVENTS, max_size=40),
    answers=st.lists(st.booleans(), max_size=40),
    in_flight=st.lists(st.integers(0, 3), max_size=40),
)
def test_rollout_never_runs_in_the_router_and_the_replica_always_comes_back(events, answers, in_flight):
    """Over any sequence: a worker starts only on a replica out of its router (World._do), a replica
    lease's terminal word comes only once it is back, and no newer lease's word while it is out
    (World._publish); and once the failures stop, every replica serves again and holds no lease,
    the newest record the GPU's current word."""
    w = World(answers=answers, in_flight=in_flight)
    for i, ev in enumerate(events):
        if ev[0] == "cmd":
            _, kind, epoch, replica = ev
            c = cmd(kind, epoch, f"c{i}", lease_kind="replica" if replica else "coresident")
            w.send(lm.Received(c)) if w.r.phase != "serving" or replica else w.lease_input(lm.Received(c))
        elif ev[0] == "tick":
            w.tick(ev[1])
        else:
            w.worker_exits()
    w.answers, w.in_flight = [], []
    for _ in range(20):  # time passes (every lease expires), workers exit, every step now succeeds
        w.tick(25.0)
        w.worker_exits()
    assert w.r.phase == "serving" and w.in_router and not w.worker and w.s.lease is None
    assert not w.published or w.published[-1] == w.s.truth, "the newest record is not the GPU's current word"


def _rose_executor(env: dict, *args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "rose", "executor", "--simulate", "1", *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def test_a_malformed_replica_option_is_one_line_and_exit_2():
    r = _rose_executor(dict(os.environ), "--replica", "sim/0:8000")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "rose: --replica: expected GPU=http://host:port, got 'sim/0:8000'"
    ]


@pytest.mark.stack
def test_a_router_that_does_not_answer_at_start_is_one_line_naming_router_url(cfg, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    env = env_for(cfg, tmp_path, ROSE_ROUTER__URL=url)
    r = _rose_executor(env, "--replica", "sim/0=http://127.0.0.1:1", "--log-level", "ERROR")
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("rose:")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert url in lines[0] and "router.url" in lines[0]
