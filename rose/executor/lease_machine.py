"""The executor's lease state machine for one GPU: a pure step `(state, input, now) -> (state', actions)`.

No I/O and no clock: `now` is the executor's monotonic clock, passed in. The imperative shell
(rose.executor.service) turns actions into process signals and Kafka messages, and turns process
exits, guard trips and the passage of time into inputs. Because it is pure, its safety rules
(one worker per GPU, only inside a lease; fencing by epoch; a terminal state published only once
the worker is gone; the GPU's current truth republished after any record that is not) are
property-tested over arbitrary command and time sequences (tests/test_lease_machine.py).
The rules one by one: docs/executor.md; the lease states: docs/contract.md §5.1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rose.contract.events import Command, LeaseState

SEEN_MAX = 256  # command ids remembered per GPU for duplicate detection, at least half of them


@dataclass(frozen=True, slots=True)
class Params:
    revoke_deadline_s: float = 2.0  # STOP -> SIGKILL
    restart_backoff_s: float = 1.0  # a worker that died inside a lease is restarted after this


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    epoch: int
    mem_bytes: int
    compute_share: float
    expires_at: float  # monotonic
    command_id: str
    group_id: str = ""  # a gang lease (docs/contract.md §2): one worker for group_size GPUs
    group_size: int = 0


@dataclass(frozen=True, slots=True)
class WorkerState:
    """The GPU's rollout worker as the machine believes it to be (until the shell reports its exit).
    `compute_share` is the share last handed to it (at start or by `Throttle`); `lease_id` is the
    lease it was started for: a worker never passes from one lease to another."""

    mem_bytes: int
    compute_share: float
    stopping: bool = False
    kill_at: float = float("inf")
    killed: bool = False
    lease_id: str = ""


@dataclass(frozen=True, slots=True)
class Record:
    """A lease state to publish (the shell adds ts and the measured rollout memory)."""

    lease_id: str
    epoch: int
    state: str
    command_id: str
    reason: str = ""  # why, where the state alone does not say (a rejected grant); "" = nothing to add


@dataclass(frozen=True, slots=True)
class GpuLease:
    gpu: str
    highest_epoch: int = -1
    lease: Lease | None = None
    worker: WorkerState | None = None
    ended: tuple[Record, ...] = ()  # terminal states waiting for the worker to be gone
    truth: Record | None = None  # the newest word on the GPU's highest epoch
    # command ids applied, for duplicate detection (epochs fence older ones): two generations of
    # up to SEEN_MAX // 2 each, so a lookup is a hash probe and an insert copies at most half
    seen: frozenset[str] = frozenset()
    seen_before: frozenset[str] = frozenset()
    guard_paused: bool = False
    restart_at: float = 0.0


# ---- inputs -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Event:
    """An input with no payload (time passed, the guard tripped or cleared, shutdown)."""


@dataclass(frozen=True, slots=True)
class Received:
    command: Command
    age_s: float = 0.0  # time the command spent in transit before receipt (>= 0)


class Tick(_Event):
    __slots__ = ()


@dataclass(frozen=True, slots=True)
class WorkerExited:
    """The lease's worker is gone; `refused` says why it refused the lease, where it did (a device
    check failed): restarting it cannot help, so the lease ends with that reason."""

    refused: str = ""


class GuardTrip(_Event):
    __slots__ = ()


class GuardClear(_Event):
    __slots__ = ()


class Shutdown(_Event):
    __slots__ = ()


@dataclass(frozen=True, slots=True)
class GroupEnded:
    """Another member of the gang `group_id` lost its lease: the group's one worker goes, so
    this member's lease ends too (any member's revoke revokes the group)."""

    group_id: str


Input = Received | Tick | WorkerExited | GuardTrip | GuardClear | Shutdown | GroupEnded


# ---- actions ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _OnWorker:
    """A signal to the GPU's worker (pause, resume, kill)."""

    gpu: str


@dataclass(frozen=True, slots=True)
class Start:
    gpu: str
    lease_id: str
    epoch: int
    mem_bytes: int
    compute_share: float
    paused: bool
    group_id: str = ""  # a gang member: the shell starts one worker once every member said Start
    group_size: int = 0


class Pause(_OnWorker):
    """The local guard's pause (orthogonal to the lease's share)."""

    __slots__ = ()


class Resume(_OnWorker):
    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Throttle:
    """Set the running worker's compute share; 0 pauses it within one decode step."""

    gpu: str
    compute_share: float


@dataclass(frozen=True, slots=True)
class Stop:
    gpu: str


class Kill(_OnWorker):
    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Publish:
    gpu: str
    record: Record

    def state(self, ts: float, rollout_mem_bytes: int = 0) -> LeaseState:
        """The rose.lease_state.v1 event this publication becomes, at `ts`."""
        r = self.record
        return LeaseState(
            gpu=self.gpu,
            lease_id=r.lease_id,
            epoch=r.epoch,
            state=r.state,
            ts=ts,
            rollout_mem_bytes=rollout_mem_bytes,
            command_id=r.command_id,
            reason=r.reason,
        )


Action = Start | Pause | Resume | Throttle | Stop | Kill | Publish

TERMINAL = ("revoked", "expired")


# ---- the step -----------------------------------------------------------------------------------


def initial(gpu: str) -> GpuLease:
    return GpuLease(gpu=gpu)


def restore(gpu: str, last: Record | None) -> tuple[GpuLease, tuple[Action, ...]]:
    """State after a restart, from the GPU's newest record on the compacted lease-state topic.
    A lease that was active or revoking when the executor died has no worker now (workers die
    with their executor): it is declared `expired`, and the scheduler grants a new epoch. So is a
    replica lease left draining or reclaiming (its replica is readmitted: rose.executor.replica_lease)."""
    s = GpuLease(gpu=gpu)
    if last is None:
        return s, ()
    s = replace(s, highest_epoch=last.epoch, truth=last)
    if last.state in ("active", "paused", "revoking", "draining", "reclaiming"):
        rec = Record(last.lease_id, last.epoch, "expired", last.command_id)
        return replace(s, truth=rec), (Publish(gpu, rec),)
    return s, ()


def step(s: GpuLease, inp: Input, now: float, p: Params = Params()) -> tuple[GpuLease, tuple[Action, ...]]:
    out: list[Action] = []
    if isinstance(inp, Received):
        s = _command(s, inp, now, out)
    elif isinstance(inp, Tick):
        if s.lease is not None and now >= s.lease.expires_at:
            s = _end(s, "expired", out)
    elif isinstance(inp, WorkerExited):
        crashed = s.worker is not None and not s.worker.stopping
        s = replace(s, worker=None)
        if crashed and s.lease is not None:
            if inp.refused:
                s = _end(s, "revoked", out, reason=inp.refused)
            else:
                s = replace(s, restart_at=now + p.restart_backoff_s)
    elif isinstance(inp, GuardTrip):
        s = replace(s, guard_paused=True)
        if s.worker is not None and not s.worker.stopping:
            out.append(Pause(s.gpu))
    elif isinstance(inp, GuardClear):
        s = replace(s, guard_paused=False)
        if s.worker is not None and not s.worker.stopping:
            out.append(Resume(s.gpu))
    elif isinstance(inp, Shutdown):
        if s.lease is not None:
            s = _end(s, "revoked", out)
    elif isinstance(inp, GroupEnded):
        if s.lease is not None and s.lease.group_id == inp.group_id:
            s = _end(s, "revoked", out)
    else:  # pragma: no cover - a bug in the shell
        raise TypeError(f"unknown input {inp!r}")
    s = _reconcile(s, now, p, out)
    return s, _with_truth(s, out)


def has_seen(s: GpuLease, command_id: str) -> bool:
    """Whether the command was applied already (among the last SEEN_MAX // 2 to SEEN_MAX ids)."""
    return command_id in s.seen or command_id in s.seen_before


def epoch_seen(s: GpuLease, epoch: int) -> bool:
    """Whether the GPU has seen `epoch` already: a command of it renews the held lease or is fenced
    (an older epoch, or a lease of this one that ended or was rejected); only a newer epoch may
    start a lease (docs/executor.md, fencing by epoch)."""
    return epoch <= s.highest_epoch


def _command(s: GpuLease, inp: Received, now: float, out: list[Action]) -> GpuLease:
    c = inp.command
    if c.gpu != s.gpu:
        raise ValueError(f"command for {c.gpu} routed to {s.gpu}")
    if has_seen(s, c.command_id):
        return s  # duplicate delivery: already applied
    if len(s.seen) >= SEEN_MAX // 2:
        s = replace(s, seen=frozenset((c.command_id,)), seen_before=s.seen)
    else:
        s = replace(s, seen=s.seen | {c.command_id})
    if c.epoch < s.highest_epoch:
        why = f"stale epoch: {c.epoch} < {s.highest_epoch}, the newest this GPU has seen"
        out.append(Publish(s.gpu, Record(c.lease_id, c.epoch, "rejected", c.command_id, why)))
        return s
    ttl_left = (c.expires_at - c.ts) - max(0.0, inp.age_s)
    held = s.lease is not None and s.lease.epoch == c.epoch
    if c.kind == "revoke":
        if held:
            return _end(s, "revoked", out, c.command_id)
        if not epoch_seen(s, c.epoch):  # a lease we never saw is over: fence it, end anything older
            if s.lease is not None:
                s = _end(s, "revoked", out, c.command_id)
            return _ended_unheld(s, Record(c.lease_id, c.epoch, "revoked", c.command_id))
        return s  # revoke of a lease that already ended: nothing to do
    # grant, renew or throttle: each states the desired lease (level-triggered)
    if held:
        lease = s.lease
        assert lease is not None  # held
        resized = (lease.mem_bytes, lease.compute_share) != (c.mem_bytes, c.compute_share)
        s = replace(
            s,
            lease=replace(
                lease,
                expires_at=max(lease.expires_at, now + ttl_left),
                mem_bytes=c.mem_bytes,
                compute_share=c.compute_share,
            ),
        )
        if resized:
            rec = Record(lease.lease_id, lease.epoch, lease_state(c.compute_share), c.command_id)
            out.append(Publish(s.gpu, rec))
            s = replace(s, truth=rec)
        return s
    if epoch_seen(s, c.epoch):  # this epoch's lease already ended (or was never held): fenced
        why = f"fenced: the lease of epoch {c.epoch} already ended here"
        out.append(Publish(s.gpu, Record(c.lease_id, c.epoch, "rejected", c.command_id, why)))
        return s
    # a newer epoch: it supersedes whatever lease is held
    if s.lease is not None:
        s = _end(s, "revoked", out, c.command_id)
    s = replace(s, highest_epoch=c.epoch)
    if ttl_left <= 0:
        return _ended_unheld(s, Record(c.lease_id, c.epoch, "expired", c.command_id))
    lease = Lease(
        c.lease_id, c.epoch, c.mem_bytes, c.compute_share, now + ttl_left, c.command_id, c.group_id, c.group_size
    )
    rec = Record(c.lease_id, c.epoch, lease_state(c.compute_share), c.command_id)
    out.append(Publish(s.gpu, rec))
    return replace(s, lease=lease, truth=rec, restart_at=now)


def _ended_unheld(s: GpuLease, rec: Record) -> GpuLease:
    """A lease of a newer epoch that never ran here is over. Its terminal word waits, like any
    other, until an older lease's worker is gone: a terminal state always means memory is back."""
    return replace(s, highest_epoch=rec.epoch, ended=s.ended + (rec,))


def _end(s: GpuLease, state: str, out: list[Action], command_id: str | None = None, reason: str = "") -> GpuLease:
    """End the held lease: pause at once; the terminal state waits until the worker is gone."""
    lease = s.lease
    assert lease is not None and state in TERMINAL
    cid = command_id or lease.command_id
    if s.worker is not None and not s.worker.stopping:
        out.append(Pause(s.gpu))
    if s.worker is not None:
        rec = Record(lease.lease_id, lease.epoch, "revoking", cid)
        out.append(Publish(s.gpu, rec))
        if lease.epoch >= s.highest_epoch:
            s = replace(s, truth=rec)
    return replace(s, lease=None, ended=s.ended + (Record(lease.lease_id, lease.epoch, state, cid, reason),))


def lease_state(compute_share: float) -> str:
    """The published state of a live lease: `paused` while its compute share is 0."""
    return "active" if compute_share > 0 else "paused"


def _reconcile(s: GpuLease, now: float, p: Params, out: list[Action]) -> GpuLease:
    w, want = s.worker, s.lease
    if w is not None and not w.stopping:
        # an ended or superseded lease stops its worker; memory is the contract: a new one restarts
        if want is None or w.lease_id != want.lease_id or w.mem_bytes != want.mem_bytes:
            if not any(isinstance(a, Pause) for a in out):
                out.append(Pause(s.gpu))
            out.append(Stop(s.gpu))
            w = replace(w, stopping=True, kill_at=now + p.revoke_deadline_s)
        elif w.compute_share != want.compute_share:  # compute yields in place
            out.append(Throttle(s.gpu, want.compute_share))
            w = replace(w, compute_share=want.compute_share)
    if w is not None and w.stopping and not w.killed and now >= w.kill_at:
        out.append(Kill(s.gpu))
        w = replace(w, killed=True)
    s = replace(s, worker=w)
    if w is None and s.ended:
        for rec in s.ended:
            out.append(Publish(s.gpu, rec))
            if rec.epoch >= s.highest_epoch:
                s = replace(s, truth=rec)
        s = replace(s, ended=())
    if w is None and want is not None and now >= s.restart_at and want.mem_bytes > 0:
        out.append(
            Start(
                s.gpu,
                want.lease_id,
                want.epoch,
                want.mem_bytes,
                want.compute_share,
                s.guard_paused,
                want.group_id,
                want.group_size,
            )
        )
        s = replace(s, worker=WorkerState(want.mem_bytes, want.compute_share, lease_id=want.lease_id))
    return s


def _with_truth(s: GpuLease, out: list[Action]) -> tuple[Action, ...]:
    pubs = [a for a in out if isinstance(a, Publish)]
    if pubs and s.truth is not None and pubs[-1].record != s.truth:
        out.append(Publish(s.gpu, s.truth))
    return tuple(out)


__all__ = [
    "Params",
    "Lease",
    "WorkerState",
    "Record",
    "GpuLease",
    "Received",
    "Tick",
    "WorkerExited",
    "GuardTrip",
    "GuardClear",
    "Shutdown",
    "GroupEnded",
    "Start",
    "Pause",
    "Resume",
    "Throttle",
    "Stop",
    "Kill",
    "Publish",
    "initial",
    "restore",
    "step",
    "lease_state",
    "epoch_seen",
    "TERMINAL",
]


# ---- gangs: the members of a group lease, across the executor's GPUs ---------------------------


@dataclass(frozen=True, slots=True)
class Gangs:
    """The executor's gang bookkeeping (docs/executor.md): per group, the members that said
    `Start` while the group's one worker has not started; per GPU, the group it belongs to, from
    its `Start` until its worker stops. Each rule returns a new value; none changes its input."""

    waiting: dict[str, dict[str, Start]]  # group_id -> gpu -> its Start
    member_of: dict[str, str]  # gpu -> group_id


NO_GANGS = Gangs({}, {})


def gang_start(g: Gangs, a: Start) -> tuple[Gangs, Start | None, tuple[str, ...]]:
    """Member `a.gpu` of group `a.group_id` said `Start`. Until every member has, no worker
    starts (None); then the group's one worker: the first member's `Start` holding the whole
    group's memory at the smallest share, paused if any member is. With it, the members that
    said `Start`, by GPU."""
    member_of = {**g.member_of, a.gpu: a.group_id}
    waiting = {**g.waiting.get(a.group_id, {}), a.gpu: a}
    members = tuple(sorted(waiting))
    if len(waiting) < a.group_size:
        return Gangs({**g.waiting, a.group_id: waiting}, member_of), None, members
    starts = list(waiting.values())
    lead = replace(
        waiting[members[0]],
        mem_bytes=sum(m.mem_bytes for m in starts),
        compute_share=min(m.compute_share for m in starts),
        paused=any(m.paused for m in starts),
    )
    return Gangs({k: v for k, v in g.waiting.items() if k != a.group_id}, member_of), lead, members


def gang_stop(g: Gangs, gpu: str) -> tuple[Gangs, tuple[tuple[str, Input], ...]]:
    """`gpu`'s worker is told to stop. Any member's end ends its gang: the group's one worker
    goes, so every member's lease does. The inputs that carries, per GPU: `WorkerExited` to
    `gpu` itself when the group's worker never started (there is none to wait for), and
    `GroupEnded` to every other member."""
    gid = g.member_of.get(gpu)
    if gid is None:
        return g, ()
    member_of = {k: v for k, v in g.member_of.items() if k != gpu}
    waiting = {k: v for k, v in g.waiting.get(gid, {}).items() if k != gpu}
    carry: list[tuple[str, Input]] = []
    if gpu in g.waiting.get(gid, {}):
        carry.append((gpu, WorkerExited()))
    groups = {k: v for k, v in g.waiting.items() if k != gid}
    if waiting:
        groups[gid] = waiting
    carry += [(other, GroupEnded(gid)) for other, og in member_of.items() if og == gid]
    return Gangs(groups, member_of), tuple(carry)
