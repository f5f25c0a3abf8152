"""A replica lease's path on one GPU (CONTRACT §7, docs/executor.md "Replica leases"): a pure step
`(state, input, now) -> (state', actions)` beside the lease machine, in its style.

The lease machine (rose.executor.lease_machine) runs the rollout worker of a replica lease as it
runs any lease; this step wraps it with what a whole replica needs before and after:

    serving --grant--> draining --drained--> (engine put to sleep where it can) --> lent
    lent --the lease machine's terminal word--> reclaiming --wake, health, readmit--> serving

While draining, the grant is held here and handed to the lease machine only once the replica is
drained, so its `active` (and its worker's `Start`) comes after the drain. While reclaiming, the
lease machine's terminal word (`revoked`, `expired`) is held here and published only once the
replica serves again, so a terminal state of a replica lease means the replica is back in its
router. A drain past `drain_timeout_s` readmits the replica and publishes the grant `rejected`.
A step that fails (the engine does not wake, its health check fails, the router refuses) is
reported and tried again after `retry_s`; the replica is never given up on. A command of a newer
epoch while the replica is out of its router ends its lease (fencing by epoch), but the replica is
reclaimed before anything of the newer lease runs: a newer grant is rejected once it serves.

No I/O and no clock: the shell (rose.executor.service) does each action and feeds its result back
as `Done`, and reads the drain's count when asked (`ReadDrain` -> `InFlight`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rose.executor import lease_machine as lm

PHASES = ("serving", "draining", "lent", "reclaiming")
# the drain's count is read this often: a tenth of the shortest completion the tiny test model
# streams, far below the drain times of real requests (as rose.router.vllm_router's wait_drained)
DRAIN_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class Params:
    drain_timeout_s: float = 30.0  # executor.drain_timeout_s
    retry_s: float = 1.0  # a failed wake, health check or readmission is tried again after this


@dataclass(frozen=True, slots=True)
class Replica:
    """One GPU's serving replica as the path believes it to be. `lease_id`/`epoch`: the replica
    lease in progress (none while serving). `grant`: draining, the newest grant or renew of it,
    received at `received_at`. `held`: reclaiming, the terminal word published once the replica
    serves again (None after a restart: the lease machine's restore published it). `next`:
    reclaiming, the step to do next (leftover, wake, health, readmit). `after`: the words of newer
    epochs that superseded the lease while the replica was out, published after `held`."""

    gpu: str
    url: str
    phase: str = "serving"
    lease_id: str = ""
    epoch: int = -1
    grant: lm.Received | None = None
    received_at: float = 0.0
    expires_at: float = 0.0  # draining: the grant's end on the monotonic clock
    drain_until: float = 0.0
    poll_at: float = 0.0
    slept: bool = False
    held: lm.Record | None = None
    next: str = ""
    retry_at: float = 0.0
    after: tuple[lm.Record, ...] = ()


# ---- inputs -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InFlight:
    """The drain's count read now: the router's, else the engine's (None: neither can tell)."""

    n: int | None


@dataclass(frozen=True, slots=True)
class Done:
    """The result of an action: `what` is remove, sleep, leftover, wake, health or readmit."""

    what: str
    ok: bool
    detail: str = ""


Input = lm.Received | InFlight | Done | lm.Tick | lm.Shutdown


# ---- actions ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Do:
    """Do `what` to the replica (remove, sleep, leftover, wake, health, readmit) and feed back `Done`.
    `leftover`: check that no rollout process of an earlier executor's lease is left on the GPU."""

    gpu: str
    what: str


@dataclass(frozen=True, slots=True)
class ReadDrain:
    gpu: str


@dataclass(frozen=True, slots=True)
class Forward:
    """Hand the command to the lease machine."""

    gpu: str
    received: lm.Received


@dataclass(frozen=True, slots=True)
class Fence:
    """Publish `record` as the GPU's word and fence its epoch in the lease machine (its highest
    epoch is at least `record.epoch`), so a later renew of an ended lease is rejected there."""

    gpu: str
    record: lm.Record


@dataclass(frozen=True, slots=True)
class Report:
    """A log line (warning) and nothing else: what went wrong, and why."""

    gpu: str
    event: str
    reason: str


Action = Do | ReadDrain | Forward | Fence | Report | lm.Publish
ShellAction = lm.Action | Action  # what the executor carries out for a GPU with a replica


# ---- the step -----------------------------------------------------------------------------------


def initial(gpu: str, url: str) -> Replica:
    return Replica(gpu=gpu, url=url)


def restart(gpu: str, url: str, listed: bool) -> tuple[Replica, tuple[Action, ...]]:
    """After a restart (the executor may have been SIGKILLed mid-lease): a replica the router does
    not list is reclaimed at once: no rollout process left, engine woken, healthy, readmitted."""
    r = Replica(gpu=gpu, url=url)
    if listed:
        return r, ()
    r = replace(r, phase="reclaiming", next="leftover", slept=True, retry_at=float("inf"))
    return r, (Report(gpu, "replica.readmit_after_restart", "the router does not list it"), Do(gpu, "leftover"))


def restart_reclaim_bound_s(revoke_deadline_s: float, retry_s: float, calls_s: float) -> float:
    """The longest a restarted executor takes, from its start, to readmit a replica its dead
    predecessor lent. The predecessor's rollout process got SIGTERM as it died and drains; the
    leftover check runs every `retry_s` and SIGKILLs it at the first check past
    `revoke_deadline_s`, so it is seen gone at most `revoke_deadline_s + 2 * retry_s` after the
    start; then wake, health check and readmission, `calls_s` together (the pool decision counts
    policy.pools' `wake_s + readmit_s` for them). The executor's own restart comes before this,
    inside the lease's TTL (docs/executor.md "Restart")."""
    return revoke_deadline_s + 2 * retry_s + calls_s


def step(
    r: Replica, inp: Input, now: float, lease: lm.GpuLease, p: Params = Params()
) -> tuple[Replica, tuple[Action, ...]]:
    """`lease` is the GPU's lease machine state, read only (whether it holds a lease, its epoch)."""
    out: list[Action] = []
    if isinstance(inp, lm.Received):
        r = _command(r, inp, now, lease, p, out)
    elif isinstance(inp, InFlight):
        r = _drain_read(r, inp.n, now, out)
    elif isinstance(inp, Done):
        r = _done(r, inp, now, p, out)
    elif isinstance(inp, lm.Tick):
        r = _tick(r, now, out)
    elif isinstance(inp, lm.Shutdown):
        if r.phase == "draining" and r.grant is not None and not r.next:  # the executor stops: no lease
            rec = lm.Record(r.lease_id, r.epoch, "revoked", r.grant.command.command_id)
            r = _start_next(_abort(r, rec, now), out)
    else:  # pragma: no cover - a bug in the shell
        raise TypeError(f"unknown input {inp!r}")
    return r, tuple(out)


def _command(r: Replica, inp: lm.Received, now: float, lease: lm.GpuLease, p: Params, out: list[Action]) -> Replica:
    c = inp.command
    if r.phase == "serving":
        return _serving(r, inp, now, lease, p, out)
    known = max(r.epoch, lease.highest_epoch)
    if c.epoch > max((known, *(w.epoch for w in r.after))):
        return _superseded(r, inp, now, lease, out)
    if c.epoch > known:
        return r  # a lease that superseded this one: its word waits until the replica serves
    if r.phase == "lent":  # the lease machine's: the lent lease's renew or revoke, a stale command
        out.append(Forward(r.gpu, inp))
        return r
    # draining or reclaiming: the replica is out; only its own lease's words count
    if c.epoch != r.epoch or c.lease_id != r.lease_id:
        if c.kind != "revoke":  # a grant while the replica is out: the scheduler asks again once it serves
            why = f"the replica is {r.phase} for lease {r.lease_id}"
            out.append(lm.Publish(r.gpu, lm.Record(c.lease_id, c.epoch, "rejected", c.command_id, why)))
            word = _current(r, lease)
            if word is not None:  # the GPU's current word again, newest on the compacted topic
                out.append(lm.Publish(r.gpu, word))
        return r
    if r.phase == "reclaiming":
        return r  # its end is under way
    if c.kind == "revoke":
        return _start_next(_abort(r, lm.Record(c.lease_id, c.epoch, "revoked", c.command_id), now), out)
    ttl_left = (c.expires_at - c.ts) - max(0.0, inp.age_s)
    return replace(r, grant=inp, received_at=now, expires_at=max(r.expires_at, now + ttl_left))


def _serving(r: Replica, inp: lm.Received, now: float, lease: lm.GpuLease, p: Params, out: list[Action]) -> Replica:
    c = inp.command
    if c.lease_kind != "replica" or c.kind == "revoke" or lm.epoch_seen(lease, c.epoch):
        out.append(Forward(r.gpu, inp))  # the lease machine's (a co-resident lease, a stale or fenced one)
        return r
    ttl_left = (c.expires_at - c.ts) - max(0.0, inp.age_s)
    why = (
        "a co-resident lease holds the GPU"
        if lease.lease is not None
        else "it arrived expired"
        if ttl_left <= 0
        else "a replica over several GPUs (a gang) is not lent yet"
        if c.group_size > 1
        else ""
    )
    if why:
        out.append(Report(r.gpu, "replica.grant_rejected", why))
        out.append(Fence(r.gpu, lm.Record(c.lease_id, c.epoch, "rejected", c.command_id, why)))
        return r
    out.append(lm.Publish(r.gpu, lm.Record(c.lease_id, c.epoch, "draining", c.command_id)))
    out.append(Do(r.gpu, "remove"))
    return replace(
        r,
        phase="draining",
        lease_id=c.lease_id,
        epoch=c.epoch,
        grant=inp,
        received_at=now,
        expires_at=now + ttl_left,
        drain_until=now + p.drain_timeout_s,
        poll_at=now,
        slept=False,
    )


def _superseded(r: Replica, inp: lm.Received, now: float, lease: lm.GpuLease, out: list[Action]) -> Replica:
    """A command of a newer epoch while the replica is out of its router (draining, lent,
    reclaiming). The newer epoch ends the replica lease as it ends any older lease: the scheduler
    has moved on and renews it no more. Its replica is reclaimed first (rollout stopped, engine
    woken, health checked, readmitted, then the lease's `revoked`), so nothing of the newer lease
    runs: a grant or renew of it is `rejected` with the reason, a revoke `revoked`. That word is
    held, with the newer epoch, until the replica serves, as the lease machine holds a newer
    lease's terminal word until an older worker is gone: until then the GPU's newest word stays
    the replica lease's, which says (to the node's telemetry too) that the replica is out."""
    c = inp.command
    why = f"the replica is {r.phase} for lease {r.lease_id}: it serves again first, then a grant is taken"
    if r.phase == "lent" and lease.lease is not None and lease.lease.epoch == r.epoch:
        # ended in the lease machine as a newer grant would end it there: its worker stopped, its
        # terminal word held here until the replica serves again (on_lease_actions)
        end = replace(c, kind="revoke", lease_id=r.lease_id, epoch=r.epoch, lease_kind="replica")
        out.append(Forward(r.gpu, lm.Received(end, inp.age_s)))
    elif r.phase == "draining":  # nothing ran on it: readmitted (woken first where a sleep was asked)
        ended = _abort(r, lm.Record(r.lease_id, r.epoch, "revoked", c.command_id), now)
        woken = r.next == "sleep"
        r = _start_next(replace(ended, next="wake" if woken else "readmit", slept=woken), out)
    if c.kind == "revoke":
        word = lm.Record(c.lease_id, c.epoch, "revoked", c.command_id)
    else:
        word = lm.Record(c.lease_id, c.epoch, "rejected", c.command_id, why)
        out.append(Report(r.gpu, "replica.superseded", why))
    return replace(r, after=r.after + (word,))


def _current(r: Replica, lease: lm.GpuLease) -> lm.Record | None:
    """The GPU's current word while its replica is out: the lease machine's where it is newer (the
    one restored after a restart), else the replica lease's own (draining or reclaiming)."""
    if lease.truth is not None and lease.truth.epoch > r.epoch:
        return lease.truth
    return _word(r) if r.lease_id else None


def _abort(r: Replica, rec: lm.Record, now: float) -> Replica:
    """The drain ends without a lease: readmit the replica (nothing ran on it), then publish `rec`."""
    return replace(r, phase="reclaiming", grant=None, held=rec, next="readmit", retry_at=now)


def _drain_read(r: Replica, n: int | None, now: float, out: list[Action]) -> Replica:
    if r.phase != "draining" or r.next:
        return r
    assert r.grant is not None  # draining holds its grant
    cid = r.grant.command.command_id
    if now >= r.expires_at:
        why = "the lease ran out while the replica drained"
        out.append(Report(r.gpu, "replica.grant_expired", why))
        return _start_next(_abort(r, lm.Record(r.lease_id, r.epoch, "expired", cid, why), now), out)
    if not n:  # 0, or no count to read: the router and the engine see nothing in flight
        out.append(Do(r.gpu, "sleep"))
        return replace(r, next="sleep")
    if now >= r.drain_until:
        why = f"drain_timeout: {n} requests still in flight after executor.drain_timeout_s"
        out.append(Report(r.gpu, "replica.drain_timeout", why))
        return _start_next(_abort(r, lm.Record(r.lease_id, r.epoch, "rejected", cid, why), now), out)
    return replace(r, poll_at=now + DRAIN_POLL_S)


def _done(r: Replica, d: Done, now: float, p: Params, out: list[Action]) -> Replica:
    if r.phase == "draining" and d.what == "remove":
        if d.ok:
            return r
        out.append(Report(r.gpu, "replica.remove_failed", d.detail))
        why = f"the router did not remove the replica: {d.detail}"
        rec = lm.Record(r.lease_id, r.epoch, "rejected", r.grant.command.command_id if r.grant else "", why)
        return _start_next(_abort(r, rec, now), out)
    if r.phase == "draining" and d.what == "sleep":
        assert r.grant is not None  # draining holds its grant
        if not d.ok:
            out.append(Report(r.gpu, "replica.engine_stays_awake", d.detail))
        g = r.grant
        out.append(Forward(r.gpu, lm.Received(g.command, age_s=g.age_s + (now - r.received_at))))
        return replace(r, phase="lent", grant=None, slept=d.ok, next="")
    if r.phase != "reclaiming" or d.what != r.next:
        return r
    if not d.ok:
        out.append(Report(r.gpu, f"replica.{d.what}_failed", d.detail))
        return replace(r, retry_at=now + p.retry_s)
    if d.what == "readmit":
        for rec in ((r.held,) if r.held is not None else ()) + r.after:  # the newest epoch last
            out.append(Fence(r.gpu, rec))
        return Replica(gpu=r.gpu, url=r.url)
    after = {"leftover": "wake" if r.slept else "health", "wake": "health", "health": "readmit"}[d.what]
    return _start_next(replace(r, next=after, retry_at=now), out)


def _start_next(r: Replica, out: list[Action] | list[ShellAction]) -> Replica:
    """Do the next reclaim step now; its `Done` says how it went (no retry before)."""
    out.append(Do(r.gpu, r.next))
    return replace(r, retry_at=float("inf"))


def _tick(r: Replica, now: float, out: list[Action]) -> Replica:
    if r.phase == "draining" and not r.next and now >= r.poll_at:
        out.append(ReadDrain(r.gpu))
    elif r.phase == "reclaiming" and now >= r.retry_at:
        out.append(Do(r.gpu, r.next))
        r = replace(r, retry_at=float("inf"))  # until its Done says how it went
    return r


def on_lease_actions(r: Replica, actions: tuple[lm.Action, ...], now: float) -> tuple[Replica, tuple[ShellAction, ...]]:
    """The lease machine's actions for a lent replica's GPU, seen before the shell does them: its
    terminal word on the lent lease is held (published once the replica serves again) and
    `reclaiming` published in its place; the first reclaim step follows."""
    if r.phase not in ("lent", "reclaiming"):
        return r, actions
    out: list[ShellAction] = []
    for a in actions:
        if not (isinstance(a, lm.Publish) and a.record.lease_id == r.lease_id and a.record.epoch == r.epoch):
            out.append(a)
        elif r.phase == "lent" and a.record.state in lm.TERMINAL:
            r = replace(r, phase="reclaiming", held=a.record, next="wake" if r.slept else "health")
            out.append(lm.Publish(r.gpu, _reclaiming(a.record)))
            r = _start_next(r, out)
        elif r.phase == "reclaiming" and a.record == r.held:
            out.append(lm.Publish(r.gpu, _reclaiming(a.record)))  # the lease machine's truth, said early
        else:
            out.append(a)
    return r, tuple(out)


def _word(r: Replica) -> lm.Record:
    """The replica lease's current state as a record: draining or reclaiming."""
    cid = r.grant.command.command_id if r.grant is not None else r.held.command_id if r.held is not None else ""
    return lm.Record(r.lease_id, r.epoch, r.phase, cid)


def _reclaiming(rec: lm.Record) -> lm.Record:
    return lm.Record(rec.lease_id, rec.epoch, "reclaiming", rec.command_id)


def fence(s: lm.GpuLease, rec: lm.Record) -> lm.GpuLease:
    """The lease machine's state with `rec`'s epoch fenced and `rec` its word when it is the newest."""
    if rec.epoch < s.highest_epoch:
        return s
    return replace(s, highest_epoch=rec.epoch, truth=rec)
