"""Properties of the executor's lease state machine over arbitrary command/time sequences.

A tiny model of the world runs beside the machine: it executes Start/Stop/Kill on a pretend
worker process and feeds its exits back, so the invariants are checked against what the
processes would really hold, not only against the machine's own bookkeeping."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from rose.config import GiB
from rose.executor import lease_machine as lm
from tests.examples import command_example

GPU = "node-1/0"
P = lm.Params(revoke_deadline_s=2.0, restart_backoff_s=1.0)


def cmd(kind: str, epoch: int, cid: str, mem: int = 4 * GiB, share: float = 0.3, ttl: float = 5.0):
    return command_example(
        kind=kind,
        gpu=GPU,
        epoch=epoch,
        command_id=cid,
        lease_id=f"{GPU}#{epoch}",
        mem_bytes=mem,
        compute_share=share,
        ts=1000.0,
        expires_at=1000.0 + ttl,
    )


class World:
    """The machine plus a pretend worker process that obeys (or ignores) its signals."""

    def __init__(self):
        self.s = lm.initial(GPU)
        self.now = 0.0
        self.proc: dict | None = None  # {"mem", "stopping", "killed", "paused"}
        self.log: list[tuple[lm.Input, tuple[lm.Action, ...]]] = []
        self.sent: list = []

    def feed(self, inp: lm.Input) -> tuple[lm.Action, ...]:
        before = self.s
        self.s, acts = lm.step(self.s, inp, self.now, P)
        self.log.append((inp, acts))
        self._check_step(before, inp, acts)
        exited = False
        for a in acts:
            if isinstance(a, lm.Start):
                assert self.proc is None, "a second worker started while one is alive"
                assert self.s.lease is not None and a.mem_bytes <= self.s.lease.mem_bytes
                assert a.compute_share <= self.s.lease.compute_share
                self.proc = {"mem": a.mem_bytes, "stopping": False, "killed": False, "paused": a.paused}
            elif isinstance(a, lm.Pause) and self.proc:
                self.proc["paused"] = True
            elif isinstance(a, lm.Resume) and self.proc:
                self.proc["paused"] = False
            elif isinstance(a, lm.Stop):
                assert self.proc is not None
                assert self.proc["paused"], "stop without pausing first"
                self.proc["stopping"] = True
            elif isinstance(a, lm.Kill):
                assert self.proc is not None and self.proc["stopping"]
                exited = True
            elif isinstance(a, lm.Publish) and a.record.state in lm.TERMINAL:
                assert self.proc is None, "a terminal state published while rollout memory is held"
        self._check_state()
        if exited:
            self.proc = None
            self.feed(lm.WorkerExited())
        return acts

    def _check_step(self, before: lm.GpuLease, inp, acts):
        pubs = [a for a in acts if isinstance(a, lm.Publish)]
        if pubs:
            assert pubs[-1].record == self.s.truth, "the newest record per key must be the truth"
        if isinstance(inp, lm.Received):
            c = inp.command
            if lm.has_seen(before, c.command_id):
                assert acts == () and self.s == before, "a duplicate changed something"
            elif c.epoch < before.highest_epoch:
                assert pubs and pubs[0].record.state == "rejected" and pubs[0].record.epoch == c.epoch
                assert not any(isinstance(a, lm.Start) for a in acts)
                assert self.s.lease == before.lease
        if isinstance(inp, lm.Tick) and before.lease is not None and self.now >= before.lease.expires_at:
            assert self.s.lease is None, "an expired lease is still held"
        assert self.s.highest_epoch >= before.highest_epoch

    def _check_state(self):
        assert (self.proc is None) == (self.s.worker is None)
        if self.proc is not None and not self.proc["stopping"]:
            # never more rollout memory than granted
            assert self.s.lease is not None, "a worker runs without a lease"
            assert self.proc["mem"] <= self.s.lease.mem_bytes
            if self.s.guard_paused:
                assert self.proc["paused"]


ops = st.one_of(
    st.tuples(
        st.just("grant"),
        st.integers(-2, 2),
        st.integers(1, 8),
        st.sampled_from([0.3, 0.5]),
        st.sampled_from([0.0, 1.0, 5.0]),
        st.sampled_from([0.0, 0.5, 6.0]),
    ),
    st.tuples(
        st.just("renew"),
        st.integers(-1, 1),
        st.integers(1, 8),
        st.sampled_from([0.3, 0.5]),
        st.sampled_from([1.0, 5.0]),
        st.just(0.0),
    ),
    st.tuples(st.just("revoke"), st.integers(-1, 1)),
    st.tuples(st.just("dup"), st.integers(0, 50)),
    st.tuples(st.just("tick"), st.sampled_from([0.01, 0.5, 1.0, 2.5, 6.0])),
    st.tuples(st.just("crash")),
    st.tuples(st.just("refuse")),
    st.tuples(st.just("exit_if_stopping")),
    st.tuples(st.just("guard"), st.booleans()),
)


def run_ops(w: World, seq) -> None:
    n = 0
    for op in seq:
        kind = op[0]
        if kind in ("grant", "renew", "revoke"):
            n += 1
            epoch = max(0, w.s.highest_epoch + op[1])
            if kind == "revoke":
                c = cmd("revoke", epoch, f"c{n}")
                age = 0.0
            else:
                c = cmd(kind, epoch, f"c{n}", mem=op[2] * GiB, share=op[3], ttl=op[4])
                age = op[5]
            w.sent.append((c, age))
            w.feed(lm.Received(c, age_s=age))
        elif kind == "dup" and w.sent:
            c, age = w.sent[op[1] % len(w.sent)]
            w.feed(lm.Received(c, age_s=age))
        elif kind == "tick":
            w.now += op[1]
            w.feed(lm.Tick())
        elif kind == "crash" and w.proc is not None:
            w.proc = None
            w.feed(lm.WorkerExited())
        elif kind == "refuse" and w.proc is not None:  # the worker's device check refused the lease
            w.proc = None
            w.feed(lm.WorkerExited(refused="device check"))
        elif kind == "exit_if_stopping" and w.proc is not None and w.proc["stopping"]:
            w.proc = None
            w.feed(lm.WorkerExited())
        elif kind == "guard":
            w.feed(lm.GuardTrip() if op[1] else lm.GuardClear())


@settings(max_examples=300, deadline=None)
@given(st.lists(ops, max_size=40))
def test_invariants_hold_over_any_sequence(seq):
    w = World()
    run_ops(w, seq)
    # liveness: revoking whatever is held always ends in `revoked` with the worker gone,
    # even when the worker ignores STOP (it is killed at the deadline)
    lease = w.s.lease
    if lease is not None:
        w.feed(lm.Received(cmd("revoke", lease.epoch, "final-revoke")))
        for _ in range(5):
            w.now += 1.0
            w.feed(lm.Tick())
        assert w.proc is None
        published = [a.record for _, acts in w.log for a in acts if isinstance(a, lm.Publish)]
        assert lm.Record(lease.lease_id, lease.epoch, "revoked", "final-revoke") in published
        assert w.s.truth.state == "revoked" and w.s.lease is None


@settings(max_examples=200, deadline=None)
@given(st.lists(ops, max_size=30))
def test_no_renew_means_expiry(seq):
    w = World()
    run_ops(w, seq)
    lease = w.s.lease
    if lease is None:
        return
    for _ in range(12):  # 12 s without a renew: past any TTL here plus the kill deadline
        w.now += 1.0
        w.feed(lm.Tick())
    assert w.s.lease is None and w.proc is None
    last = [a.record for _, acts in w.log for a in acts if isinstance(a, lm.Publish) and a.record.epoch == lease.epoch]
    assert last[-1].state == "expired"


def states(acts):
    return [a.record.state for a in acts if isinstance(a, lm.Publish)]


def test_grant_starts_within_the_lease_and_revoke_frees_after_exit():
    s, acts = lm.step(lm.initial(GPU), lm.Received(cmd("grant", 3, "g")), 0.0, P)
    assert states(acts) == ["active"]
    start = next(a for a in acts if isinstance(a, lm.Start))
    assert (start.mem_bytes, start.compute_share, start.epoch) == (4 * GiB, 0.3, 3)
    s, acts = lm.step(s, lm.Received(cmd("revoke", 3, "r")), 0.1, P)
    assert [type(a) for a in acts] == [lm.Pause, lm.Publish, lm.Stop]
    assert states(acts) == ["revoking"]
    s, acts = lm.step(s, lm.Tick(), 2.2, P)
    assert [type(a) for a in acts] == [lm.Kill]
    s, acts = lm.step(s, lm.WorkerExited(), 2.3, P)
    assert states(acts) == ["revoked"] and s.worker is None


def test_stale_epoch_is_rejected_and_the_truth_republished():
    s, _ = lm.step(lm.initial(GPU), lm.Received(cmd("grant", 5, "g5")), 0.0, P)
    s2, acts = lm.step(s, lm.Received(cmd("grant", 4, "g4")), 0.1, P)
    assert states(acts) == ["rejected", "active"]
    assert acts[-1].record.epoch == 5 and s2.lease == s.lease


def test_renew_extends_and_resize_restarts_the_worker():
    s, _ = lm.step(lm.initial(GPU), lm.Received(cmd("grant", 1, "g", ttl=5.0)), 0.0, P)
    s, acts = lm.step(s, lm.Received(cmd("renew", 1, "n1", ttl=5.0)), 4.0, P)
    assert acts == () and s.lease.expires_at == 9.0
    s, acts = lm.step(s, lm.Tick(), 8.0, P)
    assert s.lease is not None
    s, acts = lm.step(s, lm.Received(cmd("renew", 1, "n2", mem=2 * GiB)), 8.5, P)
    assert states(acts) == ["active"] and any(isinstance(a, lm.Stop) for a in acts)
    s, acts = lm.step(s, lm.WorkerExited(), 8.6, P)
    start = next(a for a in acts if isinstance(a, lm.Start))
    assert start.mem_bytes == 2 * GiB


def test_a_grant_older_than_its_ttl_is_expired_on_arrival():
    s, acts = lm.step(lm.initial(GPU), lm.Received(cmd("grant", 1, "g", ttl=5.0), age_s=7.0), 0.0, P)
    assert states(acts) == ["expired"] and s.worker is None


def test_restore_declares_a_lease_held_by_a_dead_executor_expired():
    s, acts = lm.restore(GPU, lm.Record(f"{GPU}#7", 7, "active", "g7"))
    assert states(acts) == ["expired"] and s.highest_epoch == 7
    s, acts = lm.step(s, lm.Received(cmd("renew", 7, "n7")), 0.0, P)
    assert states(acts)[0] == "rejected"  # that lease is over; a new epoch must be granted
    s, acts = lm.step(s, lm.Received(cmd("grant", 8, "g8")), 0.0, P)
    assert states(acts) == ["active"]


def test_guard_pause_survives_a_restart_of_the_worker():
    s, _ = lm.step(lm.initial(GPU), lm.Received(cmd("grant", 1, "g")), 0.0, P)
    s, acts = lm.step(s, lm.GuardTrip(), 0.1, P)
    assert acts == (lm.Pause(GPU),)
    s, acts = lm.step(s, lm.WorkerExited(), 0.2, P)  # crashed
    assert acts == ()
    s, acts = lm.step(s, lm.Tick(), 1.3, P)
    assert next(a for a in acts if isinstance(a, lm.Start)).paused
    s, acts = lm.step(s, lm.GuardClear(), 1.4, P)
    assert acts == (lm.Resume(GPU),)


def test_shutdown_revokes_and_publishes_after_exit():
    s, _ = lm.step(lm.initial(GPU), lm.Received(cmd("grant", 1, "g")), 0.0, P)
    s, acts = lm.step(s, lm.Shutdown(), 0.1, P)
    assert states(acts) == ["revoking"]
    s, acts = lm.step(s, lm.WorkerExited(), 0.2, P)
    assert states(acts) == ["revoked"]


def test_a_newer_grant_of_the_same_size_stops_the_old_worker_first():
    s, _ = lm.step(lm.initial(GPU), lm.Received(cmd("grant", 1, "g1")), 0.0, P)
    s, acts = lm.step(s, lm.Received(cmd("grant", 2, "g2")), 0.5, P)  # same mem_bytes and share
    assert states(acts) == ["revoking", "active"] and lm.Stop(GPU) in acts
    assert not any(isinstance(a, lm.Start) for a in acts)
    s, acts = lm.step(s, lm.WorkerExited(), 0.6, P)
    assert states(acts) == ["revoked", "active"]  # the old lease's word, then the truth again
    start = next(a for a in acts if isinstance(a, lm.Start))
    assert (start.lease_id, start.epoch) == (f"{GPU}#2", 2)


def test_rejected_records_carry_the_stale_command_and_why():
    c = replace(cmd("revoke", 0, "old"))
    s, _ = lm.step(lm.initial(GPU), lm.Received(cmd("grant", 2, "g")), 0.0, P)
    _, acts = lm.step(s, lm.Received(c), 0.0, P)
    why = "stale epoch: 0 < 2, the newest this GPU has seen"
    assert acts[0].record == lm.Record(c.lease_id, 0, "rejected", "old", why)
    assert acts[0].state(1.0).reason == why


def test_a_worker_that_refuses_its_lease_ends_it_with_the_reason_and_is_not_restarted():
    """A worker whose device check refused the lease would be refused again on the same device:
    the lease ends (revoked, with the worker's reason) instead of a restart after the backoff."""
    s, acts = lm.step(lm.initial(GPU), lm.Received(cmd("grant", 1, "g")), 0.0, P)
    assert any(isinstance(a, lm.Start) for a in acts)
    s, acts = lm.step(s, lm.WorkerExited(refused="the GEMM check failed"), 0.2, P)
    assert [(a.record.state, a.record.reason) for a in acts if isinstance(a, lm.Publish)] == [
        ("revoked", "the GEMM check failed")
    ]
    assert s.lease is None
    s, acts = lm.step(s, lm.Tick(), 0.2 + 2 * P.restart_backoff_s, P)
    assert not any(isinstance(a, lm.Start) for a in acts), "a refused lease's worker was restarted"


def test_a_duplicate_is_recognised_among_the_last_half_of_seen_max_commands():
    s, _ = lm.step(lm.initial(GPU), lm.Received(cmd("grant", 1, "g", ttl=1e6)), 0.0, P)
    ids = ["g"] + [f"n{i}" for i in range(lm.SEEN_MAX)]
    for i, cid in enumerate(ids[1:], 1):
        s, _ = lm.step(s, lm.Received(cmd("renew", 1, cid, ttl=1e6)), float(i) * 1e-3, P)
        window = ids[max(0, i + 1 - lm.SEEN_MAX // 2) : i + 1]  # always remembered
        assert all(lm.has_seen(s, x) for x in window)
        assert len(s.seen) + len(s.seen_before) <= lm.SEEN_MAX
    again, acts = lm.step(s, lm.Received(cmd("renew", 1, ids[-1], ttl=1e6)), 1.0, P)
    assert again == s and acts == ()  # applied once
    assert not lm.has_seen(s, "g")  # the oldest are forgotten: epochs fence them


def _start(gpu: str, mem: int, share: float, paused: bool = False, group: str = "n#n/0#1") -> lm.Start:
    return lm.Start(gpu, f"{gpu}#1", 1, mem, share, paused, group, 2)


def test_a_gang_starts_one_worker_once_every_member_said_start():
    g0 = lm.NO_GANGS
    g1, lead, members = lm.gang_start(g0, _start("n/1", 3 * GiB, 0.3, paused=True))
    assert lead is None and members == ("n/1",) and g0 == lm.NO_GANGS  # the input is left as it was
    g2, lead, members = lm.gang_start(g1, _start("n/0", 2 * GiB, 0.5))
    assert members == ("n/0", "n/1")
    assert lead == _start("n/0", 5 * GiB, 0.3, paused=True)  # the first member's, for the whole group
    assert g2.waiting == {} and g2.member_of == {"n/1": "n#n/0#1", "n/0": "n#n/0#1"}
    assert g1.waiting == {"n#n/0#1": {"n/1": _start("n/1", 3 * GiB, 0.3, paused=True)}}


def test_any_members_stop_ends_its_gang():
    g, _, _ = lm.gang_start(lm.NO_GANGS, _start("n/0", GiB, 0.5))
    g, _, _ = lm.gang_start(g, _start("n/1", GiB, 0.5))
    g, _, _ = lm.gang_start(g, _start("m/0", GiB, 0.5, group="m#m/0#1"))  # another gang, still waiting
    after, carry = lm.gang_stop(g, "n/1")
    assert carry == (("n/0", lm.GroupEnded("n#n/0#1")),)
    assert after.member_of == {"n/0": "n#n/0#1", "m/0": "m#m/0#1"} and after.waiting == g.waiting
    after, carry = lm.gang_stop(after, "n/0")
    assert carry == () and after.member_of == {"m/0": "m#m/0#1"}
    # a member whose group's worker never started has no worker to wait for
    after, carry = lm.gang_stop(after, "m/0")
    assert carry == (("m/0", lm.WorkerExited()),) and after == lm.NO_GANGS
    assert lm.gang_stop(after, "x/0") == (after, ())
