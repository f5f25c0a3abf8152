"""The lease protocol, model-checked (docs/contract.md §4, §5.1).

A hypothesis state machine runs the pure halves of both ends of the protocol against a model of
everything between them, and checks the contract's lease invariants after every step:

- the scheduler: the policy through `SchedulingCore.apply` (a held batch, then committed), as the scheduler
  service runs it, over telemetry of three GPUs (calm, between the thresholds, slow, short of
  memory, or silent), with gang leases of two GPUs in `TestGangLeaseProtocol`; a restart rebuilds
  the core with `SchedulingCore.restore` from the `scheduler-state` changelog (the last view per
  GPU, committed with the commands) and the whole `lease-state` log, then folds that log again
  from its start, as the service does;
- the log: the commands topic as a list of records (offset, record time, transaction), and the
  `lease-state` topic as a list of the executor's publications, which the scheduler folds after
  a telemetry period or when a rule says so (lease states reach it late or not yet);
- faults between log and executor: after a period the executor reads what waits, or nothing yet,
  or loses a record, or reads the newest first; rules deliver in order, lose, reorder, duplicate
  and delay commands (time passes while records wait), and commit the executor's offsets;
- the executor: the pure lease machine per GPU and the shell's part of the protocol (the
  commands' transit age from its wall clock, gang bookkeeping with `gang_start` / `gang_stop`,
  deferred inputs, worker processes that drain, crash or are killed, whose memory shows in
  telemetry a second after they start); a restart is a fresh machine per GPU restored from the
  `lease-state` log (`lease_machine.restore`, as the service's rebuild calls it) reading from its
  committed offset, or `executor.lookback_s` back on a first start; its workers die with it;
- clocks: the scheduler's clock is the telemetry's time; the executor's wall clock differs from
  it by up to `executor.max_clock_skew_s` (either way, set at start, stepped, changed at
  restarts); its monotonic clock starts anywhere. Time passes in ticks of `TICK`, the executor's
  Tick each; silence lets leases expire.

Invariants (`LeaseProtocol.check`):
- at most one live lease per GPU at the executor: one worker per GPU, and a running worker
  belongs to the lease its GPU holds;
- epochs strictly increase per GPU in the leases the executor takes, across its restarts (and
  in the grants the scheduler issues, across its restarts);
- no lease held at the executor past its `expires_at` (the latest the scheduler gave it) plus the
  skew bound, and no rollout memory past that plus `revoke_deadline_s`; a terminal state is
  published only once the lease's worker is gone;
- gangs all or none: the k grants of a gang are in one transaction, and a gang's worker runs
  only while every member holds its lease of that gang at the executor.

Left out: the telemetry topic's own faults (admission and duplicate telemetry are tested with
the policy), publications lost when an executor dies before its producer flushed, workers that
outlive their executor while draining, the local guard, the scheduler's processing lag between
an event and its commands' record time, several scheduler instances.

The variants at the end are lease machines with one rule broken (no fencing, no expiry, no
transit age, a worker handed on to a newer lease); the model must catch each, within a bounded,
derandomised search.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import orjson
import pytest
from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from rose.config import ExecutorConfig, GiB, PolicyConfig
from rose.contract.events import Command, LeaseState, Telemetry
from rose.executor import lease_machine as lm
from rose.policy.core import Arrival, Batch, SchedulingCore
from rose.policy.lease_policy import GpuView
from tests.policy_examples import tel

EXECUTOR = ExecutorConfig()
SKEW = EXECUTOR.max_clock_skew_s
PARAMS = lm.Params(revoke_deadline_s=EXECUTOR.revoke_deadline_s, restart_backoff_s=EXECUTOR.restart_backoff_s)
# the defaults, with short cooldowns and pauses so that a run of a few dozen steps sees leases
# granted, paused, resumed, renewed, revoked and granted again; no memory peak held (kv_peak_hold_s
# 0: a grant's size is a rule of the policy, tested with it; a peak held would size leases apart, and
# one short period hold back grants for the rest of a run)
POLICY = PolicyConfig(cooldown_s=1.0, cooldown_max_s=4.0, max_pause_s=4.0, kv_peak_hold_s=0.0)
TICK = 0.1  # the model's executor tick (the real one is executor.tick_s, 5 ms)
PERIOD = 0.5  # telemetry period
TOTAL_GIB = 80
WARMUP_S = 3.0  # a worker's memory shows in telemetry this long after its start (imports, model, KV cache)
EPS = 1e-6

# per GPU per period: (ttft, tpot as a share of the SLO, serving memory in GiB), or no event
CALM, BETWEEN, SLOW, SHORT = (0.2, 0.2, 30), (0.8, 0.5, 30), (0.95, 0.5, 30), (0.2, 0.2, 75)
CONDITION = st.sampled_from([CALM] * 9 + [BETWEEN, SLOW, SHORT, None])
# after a period the executor reads all that waits, or nothing yet, or all but the next record
# (lost), or all with the newest record first (reordered); the scheduler reads the lease states or not
EXECUTOR_READS = st.sampled_from(["all"] * 5 + ["nothing", "all but one", "newest first"])
PERIOD_PLAN = st.tuples(
    st.lists(CONDITION, min_size=3, max_size=3), EXECUTOR_READS, st.sampled_from([True] * 4 + [False])
)
SKEWS = st.sampled_from([0.0, SKEW, -SKEW, SKEW / 2, -SKEW / 2])


@dataclass(frozen=True)
class CommandRecord:
    offset: int
    ts: float  # record time: the scheduler's clock when it produced the record
    txn: int  # the scheduler's transaction
    command: Command


@dataclass
class Worker:
    """A rollout worker process: one per lease, or one per gang on every member's GPU."""

    leases: dict[str, str]  # gpu -> the lease it runs for
    mem: dict[str, int]  # gpu -> its memory there
    group_id: str = ""
    stopping: bool = False
    started_at: float = 0.0


class LeaseProtocol(RuleBasedStateMachine):
    GPUS: tuple[str, ...] = ("n/0", "n/1", "m/0")
    POLICY = POLICY
    machine = staticmethod(lm.step)  # the executor's lease machine (the variants replace it)

    def __init__(self) -> None:
        super().__init__()
        self.t = 1_000.0  # the scheduler's clock (telemetry time)
        self.core = SchedulingCore(self.POLICY)
        self.events = 0
        self.txn = 0
        self.log: list[CommandRecord] = []
        self.changelog: dict[str, bytes] = {}  # scheduler-state: the last view per GPU
        self.lease_log: list[LeaseState] = []
        self.folded = 0  # lease states the scheduler has read
        # the executor
        self.skew = 0.0
        self.mono_origin = 0.0
        self.states = {g: lm.initial(g) for g in self.GPUS}
        self.gangs = lm.NO_GANGS
        self.workers: dict[str, Worker] = {}
        self.pos = 0  # next offset it reads in order
        self.committed: int | None = None
        self.early: set[int] = set()  # offsets delivered ahead of their turn
        self.delivered: list[int] = []
        # what the checks remember
        self.expiry: dict[str, float] = {}  # lease id -> the latest expires_at the scheduler gave it
        self.accepted: dict[str, int] = {}  # gpu -> the newest epoch the executor took a lease of
        self.granted: dict[str, int] = {}  # gpu -> the newest epoch the scheduler granted

    # ---- the scheduler -------------------------------------------------------------------------
    @rule(periods=st.lists(PERIOD_PLAN, min_size=1, max_size=12), silent=st.sampled_from([None, None, 0, 1, 2]))
    def serving_runs(self, periods: list, silent: int | None) -> None:
        """Telemetry periods (GPU number `silent` sends none: its agent is down); after each, the
        executor reads the commands and the scheduler the lease states, as the period says."""
        for conditions, executor_reads, scheduler_reads in periods:
            self.advance_time(PERIOD)
            self.telemetry([None if i == silent else c for i, c in enumerate(conditions)])
            if executor_reads == "all but one":
                self.delivery("lost", 0)
            elif executor_reads == "newest first" and self.next_in_order() is not None:
                self.early.add(len(self.log) - 1)
                self.receive(len(self.log) - 1)
            if executor_reads != "nothing":
                self.deliver(len(self.log))
            if scheduler_reads:
                self.scheduler_reads_lease_states(len(self.lease_log))
            self.check()

    def telemetry(self, conditions: list) -> None:
        """One period's telemetry, decided in one batch and produced in one transaction."""
        events = []
        for gpu, cond in zip(self.GPUS, conditions, strict=True):
            if cond is None:
                continue
            ttft, tpot, serving = cond
            rollout = min(self.rollout_mem(gpu) / GiB, TOTAL_GIB - serving)
            self.events += 1
            ev = tel(self.events, self.t, ttft, tpot, TOTAL_GIB, serving, rollout, gpu=gpu)
            events.append(Arrival(ev, int(self.t * 1000), gpu))
        batch = self.core.apply(Batch(telemetry=events, hold=True))
        assert all(isinstance(ev, Telemetry) for ev in batch.admitted), batch.admitted  # none to the dlq
        self.core.apply(Batch(committed=batch.views))
        self.txn += 1
        grants: dict[str, list[Command]] = {}
        for c in (c for d in batch.decisions for c in d.commands):
            if c.kind == "grant":
                assert c.epoch > self.granted.get(c.gpu, 0), f"grant epochs: {c.lease_id} after epoch {self.granted}"
                self.granted[c.gpu] = c.epoch
                grants.setdefault(c.group_id, []).append(c)
            self.expiry[c.lease_id] = max(self.expiry.get(c.lease_id, 0.0), c.expires_at)
            self.log.append(CommandRecord(len(self.log), self.t, self.txn, c))
        for gid, members in grants.items():
            if gid:
                assert len(members) == members[0].group_size, f"gang all-or-none: {gid} granted {len(members)}"
        for gpu, v in batch.views.items():
            self.changelog[gpu] = orjson.dumps(v.to_dict())

    @rule(n=st.integers(1, 8))
    def scheduler_reads_lease_states(self, n: int) -> None:
        self.core.apply(Batch(lease_states=self.lease_log[self.folded : self.folded + n]))
        self.folded = min(len(self.lease_log), self.folded + n)

    @rule()
    def scheduler_restarts(self) -> None:
        self.core = SchedulingCore(self.POLICY)
        views = (GpuView.from_dict(orjson.loads(v)) for v in self.changelog.values())
        self.core.restore(views, list(self.lease_log))
        self.folded = 0  # its lease-state consumer starts at the beginning of the topic

    # ---- between the log and the executor ------------------------------------------------------
    @rule(
        fault=st.sampled_from(["in order", "lost", "reordered", "duplicated", "offsets committed"]),
        k=st.integers(0, 63),
    )
    def delivery(self, fault: str, k: int) -> None:
        """The executor reads the next 1-4 records in order; or loses the next one; or reads one
        a few records ahead of its turn (and not again in order); or reads one it read before;
        or commits the offset it has read up to."""
        if fault == "in order":
            self.deliver(1 + k % 4)
        elif fault == "lost":
            off = self.next_in_order()
            if off is not None:
                self.pos = off + 1
        elif fault == "reordered":
            waiting = [o for o in range(self.pos, len(self.log)) if o not in self.early]
            ahead = 1 + k % 3
            if len(waiting) > ahead:
                self.early.add(waiting[ahead])
                self.receive(waiting[ahead])
        elif fault == "duplicated":
            if self.delivered:
                self.receive(self.delivered[-1 - k % len(self.delivered)])
        else:
            self.committed = self.pos

    @rule(dt=st.sampled_from([1.0, 2.5, 4.0]))
    def commands_delayed(self, dt: float) -> None:
        """The executor reads nothing for `dt` (a slow broker, a long poll), then all that waits."""
        self.advance_time(dt)
        self.deliver(len(self.log))

    @rule(dt=st.sampled_from([1.0, 2.5, 6.0, 10.0]))
    def silence(self, dt: float) -> None:
        """Time passes with no telemetry and nothing read (the executor still ticks)."""
        self.advance_time(dt)

    # ---- the executor --------------------------------------------------------------------------
    @initialize(skew=SKEWS)
    def executor_clock(self, skew: float) -> None:
        self.skew = skew

    @rule(skew=SKEWS, restarts=st.booleans())
    def executor_clock_steps_or_restarts(self, skew: float, restarts: bool) -> None:
        """The executor's wall clock steps to another offset within the bound; or the executor
        restarts (with its clock at that offset)."""
        self.skew = skew
        if restarts:
            self.restart_executor()

    def restart_executor(self) -> None:
        """A fresh executor: its workers died with the old one (PR_SET_PDEATHSIG); each GPU's
        machine is restored from the lease-state log as the service rebuilds it; it reads from
        its committed offset, or from `lookback_s` back."""
        self.workers.clear()
        self.gangs = lm.NO_GANGS
        self.mono_origin -= 1_234.5
        self.states = {g: lm.initial(g) for g in self.GPUS}
        last: dict[str, LeaseState] = {}
        highest: dict[str, int] = {}
        for ls in self.lease_log:
            last[ls.gpu] = ls
            highest[ls.gpu] = max(highest.get(ls.gpu, -1), ls.epoch)
        for gpu, ls in last.items():
            rec = lm.Record(ls.lease_id, max(ls.epoch, highest[gpu]), ls.state, ls.command_id)
            self.states[gpu], actions = lm.restore(gpu, rec)
            for a in actions:
                self.act(a)
        self.early = set()
        if self.committed is not None:
            self.pos = self.committed
        else:
            since = self.wall() - EXECUTOR.lookback_s
            self.pos = next((r.offset for r in self.log if r.ts >= since), len(self.log))

    @rule(i=st.integers(0, 3), crash=st.booleans())
    def worker_exits(self, i: int, crash: bool) -> None:
        """A stopping worker finishes draining; or a running one crashes."""
        ws = [w for w in self.live_workers() if w.stopping != crash]
        if ws:
            self.apply_all(self.exit(ws[i % len(ws)]))

    def deliver(self, n: int) -> None:
        """The executor reads the next `n` records in order."""
        for _ in range(n):
            off = self.next_in_order()
            if off is None:
                return
            self.pos = off + 1
            self.receive(off)

    # ---- the model's machinery -----------------------------------------------------------------
    def wall(self) -> float:
        return self.t + self.skew

    def mono(self) -> float:
        return self.t + self.mono_origin

    def rollout_mem(self, gpu: str) -> int:
        """What the agent measures: a worker fills its memory over its first second (model, KV
        cache); the checks count it as held from its start."""
        w = self.workers.get(gpu)
        return w.mem[gpu] if w is not None and self.t - w.started_at >= WARMUP_S else 0

    def live_workers(self) -> list[Worker]:
        return list({id(w): w for w in self.workers.values()}.values())

    def next_in_order(self) -> int | None:
        off = self.pos
        while off < len(self.log) and off in self.early:
            off += 1
        return off if off < len(self.log) else None

    def receive(self, offset: int) -> None:
        r = self.log[offset]
        self.delivered.append(offset)
        age = max(0.0, self.wall() - r.ts)  # as the service measures it: its clock less the record's
        self.apply_all([(r.command.gpu, lm.Received(r.command, age_s=age))])

    def advance_time(self, dt: float) -> None:
        end = self.t + dt
        while self.t < end - EPS:
            self.t = min(end, self.t + TICK)
            for g in self.GPUS:
                self.apply_all([(g, lm.Tick())])
            self.check()

    def apply_all(self, inputs: list[tuple[str, lm.Input]]) -> None:
        """Step the machines, the inputs the actions carry (a gang's ends, worker exits) after."""
        queue = list(inputs)
        while queue:
            gpu, inp = queue.pop(0)
            before = self.states[gpu]
            after, actions = type(self).machine(before, inp, self.mono(), PARAMS)
            self.states[gpu] = after
            if after.lease is not None and (before.lease is None or before.lease.lease_id != after.lease.lease_id):
                newest = self.accepted.get(gpu, 0)
                assert after.lease.epoch > newest, f"epochs: {gpu} took epoch {after.lease.epoch} after {newest}"
                self.accepted[gpu] = after.lease.epoch
            for a in actions:
                queue.extend(self.act(a))

    def act(self, a: lm.Action) -> list[tuple[str, lm.Input]]:
        """Carry out one action as the shell does; the inputs it carries to the machines."""
        if isinstance(a, lm.Start):
            self.start(a)
        elif isinstance(a, lm.Stop):
            w = self.workers.get(a.gpu)
            if w is not None:
                w.stopping = True
            self.gangs, carry = lm.gang_stop(self.gangs, a.gpu)
            return list(carry)
        elif isinstance(a, lm.Kill):
            w = self.workers.get(a.gpu)
            if w is not None:
                return self.exit(w)
        elif isinstance(a, lm.Publish):
            w = self.workers.get(a.gpu)
            if a.record.state in lm.TERMINAL:
                assert w is None or w.leases[a.gpu] != a.record.lease_id, (
                    f"memory: {a.record.state} of {a.record.lease_id} published while its worker runs"
                )
            self.lease_log.append(a.state(self.wall(), self.rollout_mem(a.gpu)))
        return []

    def start(self, a: lm.Start) -> None:
        starts = {a.gpu: a}
        if a.group_size > 1:
            starts = {**self.gangs.waiting.get(a.group_id, {}), a.gpu: a}
            self.gangs, lead, _ = lm.gang_start(self.gangs, a)
            if lead is None:
                return
        for g in starts:
            assert g not in self.workers, f"one lease per GPU: a second worker on {g}"
        leases = {g: s.lease_id for g, s in starts.items()}
        w = Worker(leases, {g: s.mem_bytes for g, s in starts.items()}, a.group_id, started_at=self.t)
        for g in starts:
            self.workers[g] = w

    def exit(self, w: Worker) -> list[tuple[str, lm.Input]]:
        for g in w.leases:
            self.workers.pop(g, None)
        return [(g, lm.WorkerExited()) for g in w.leases]

    # ---- the invariants ------------------------------------------------------------------------
    @invariant()
    def contract_holds(self) -> None:
        self.check()

    def check(self) -> None:
        late = SKEW + TICK + EPS  # a lease ends at the first tick after its expiry on the executor's clock
        for g in self.GPUS:
            lease = self.states[g].lease
            if lease is not None:
                expiry = self.expiry[lease.lease_id]
                assert self.t <= expiry + late, f"expiry: {lease.lease_id} held at {self.t:.2f}, expired {expiry:.2f}"
            w = self.workers.get(g)
            if w is None:
                continue
            lid = w.leases[g]
            expiry = self.expiry[lid]
            assert self.t <= expiry + late + PARAMS.revoke_deadline_s + TICK, (
                f"memory: {lid}'s worker holds memory on {g} at {self.t:.2f}, expired {expiry:.2f}"
            )
            if w.stopping:
                continue
            assert lease is not None and lease.lease_id == lid, f"one lease per GPU: {g} runs {lid}, holds {lease}"
            for m in w.leases:
                ml = self.states[m].lease
                assert ml is not None and ml.group_id == w.group_id, f"gang all-or-none: {m} left {w.group_id}"


class GangLeaseProtocol(LeaseProtocol):
    """Gang leases of two GPUs on a node of three."""

    GPUS = ("n/0", "n/1", "n/2")
    POLICY = replace(POLICY, group_size=2)


BOUNDED = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestLeaseProtocol = LeaseProtocol.TestCase
TestLeaseProtocol.settings = BOUNDED
TestGangLeaseProtocol = GangLeaseProtocol.TestCase
TestGangLeaseProtocol.settings = BOUNDED


# ---- broken lease machines: the model must catch each ------------------------------------------


def accepts_stale_epochs(s: lm.GpuLease, inp: lm.Input, now: float, p: lm.Params = PARAMS):
    """No fencing: a grant, renew or throttle of an older epoch is taken as a new lease."""
    if isinstance(inp, lm.Received) and inp.command.kind != "revoke" and inp.command.epoch < s.highest_epoch:
        s = replace(s, highest_epoch=inp.command.epoch - 1)
    return lm.step(s, inp, now, p)


def never_expires(s: lm.GpuLease, inp: lm.Input, now: float, p: lm.Params = PARAMS):
    """A lease that is not renewed lives on."""
    lease = s.lease
    if lease is None or not isinstance(inp, lm.Tick):
        return lm.step(s, inp, now, p)
    s, actions = lm.step(replace(s, lease=replace(lease, expires_at=float("inf"))), inp, now, p)
    if s.lease is not None and s.lease.lease_id == lease.lease_id:
        s = replace(s, lease=replace(s.lease, expires_at=lease.expires_at))
    return s, actions


def ignores_transit_age(s: lm.GpuLease, inp: lm.Input, now: float, p: lm.Params = PARAMS):
    """A lease's TTL counted from receipt: a delayed command outlives its expires_at."""
    if isinstance(inp, lm.Received):
        inp = replace(inp, age_s=0.0)
    return lm.step(s, inp, now, p)


def hands_the_worker_on(s: lm.GpuLease, inp: lm.Input, now: float, p: lm.Params = PARAMS):
    """A newer lease of the same size takes over the running worker of the lease it superseded
    (paused, never stopped) instead of stopping it and starting its own."""
    before = s.worker
    s, actions = lm.step(s, inp, now, p)
    w, lease = s.worker, s.lease
    if before is None or before.stopping or w is None or not w.stopping or lease is None:
        return s, actions
    if before.mem_bytes != lease.mem_bytes or before.lease_id == lease.lease_id:
        return s, actions
    s = replace(s, worker=replace(before, lease_id=lease.lease_id, compute_share=lease.compute_share))
    kept = tuple(a for a in actions if not isinstance(a, lm.Stop))
    if before.compute_share != lease.compute_share:
        kept += (lm.Throttle(s.gpu, lease.compute_share),)
    return s, kept


HUNT = settings(
    max_examples=1000,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.generate],
    report_multiple_bugs=False,
    verbosity=Verbosity.quiet,
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.parametrize(
    ("machine", "caught_by"),
    [
        (accepts_stale_epochs, "epochs"),
        (never_expires, "expiry"),
        (ignores_transit_age, "expiry"),
        (hands_the_worker_on, "one lease per GPU"),
    ],
)
def test_the_model_catches_a_broken_lease_machine(machine, caught_by):
    broken = type(f"Broken_{machine.__name__}", (LeaseProtocol,), {"machine": staticmethod(machine)})
    with pytest.raises(AssertionError, match=f"^{caught_by}:"):
        run_state_machine_as_test(broken, settings=HUNT)
