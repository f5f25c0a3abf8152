"""Pool intents at the GPU stage (rose.policy.replica_intents through SchedulingCore.apply): a
lend revokes a co-resident lease first and grants the replica lease above every epoch the GPU
used; no co-resident lease is granted while the replica is lent; an intent applies once, also
after a takeover from the published views; a held batch decides as an applied one."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rose.config import GiB, PolicyConfig
from rose.contract.events import Latency
from rose.policy.core import Batch, SchedulingCore
from rose.policy.lease_policy import GpuView
from rose.policy.pool import PoolConfig
from rose.policy.pool_records import LEND, RECLAIM, PoolIntent, intent_id
from rose.policy.pool_stage import run_stage
from tests.examples import telemetry_example

T0 = 1_700_000_000.0
GPU = "node-1/0"
CFG = PolicyConfig()
CALM = Latency(ttft_p99=100.0, tpot_p99=10.0)


def event(n: int, ts: float):
    return telemetry_example(event_id=f"ev-{n}", ts=ts, gpu=GPU, latency_ms=CALM, mem_used_bytes=30 * GiB)


def intent(n: int, action: str, ts: float, epoch: int = 1) -> PoolIntent:
    iid = intent_id(f"sample-{n}", "r0", action)
    return PoolIntent(iid, ts, "serving", f"sample-{n}", "r0", action, GPU, 1, 80 * GiB, epoch, "", "test")


def test_lend_revokes_the_coresident_lease_then_grants_the_replica_and_reclaim_revokes_it():
    core = SchedulingCore(CFG)
    t = T0
    granted = []
    for n in range(20):  # calm telemetry until decide() grants a co-resident lease
        t += 0.5
        granted += [c for c in core.apply(Batch(telemetry=[event(n, t)])).commands if c.kind == "grant"]
        if granted:
            break
    assert granted and granted[0].lease_kind == "coresident"
    lend = intent(1, LEND, t)
    cmds = core.apply(Batch(intents=[lend])).commands
    assert [(c.kind, c.lease_kind) for c in cmds] == [("revoke", "coresident"), ("grant", "replica")]
    assert cmds[0].lease_id == granted[0].lease_id and cmds[1].epoch > granted[0].epoch
    assert cmds[1].compute_share == 1.0 and cmds[1].group_id == "r0#1"
    assert core.apply(Batch(intents=[lend])).commands == []  # applied once
    for n in range(20, 40):  # lent: renewed as a replica lease, never a co-resident grant
        t += 0.5
        for c in core.apply(Batch(telemetry=[event(n, t)])).commands:
            assert (c.kind, c.lease_kind) == ("renew", "replica")
    back = core.apply(Batch(intents=[intent(2, RECLAIM, t)])).commands
    assert [(c.kind, c.lease_kind, c.lease_id) for c in back] == [("revoke", "replica", cmds[1].lease_id)]


STEPS = st.lists(
    st.one_of(st.just(("ev",)), st.tuples(st.just("intent"), st.sampled_from((LEND, RECLAIM)), st.integers(0, 5))),
    max_size=40,
)


def run(steps, restart_at: int | None = None, hold: bool = False):
    """The steps through one core (or, from `restart_at`, a new core restored from the views the
    first published); every command, in order."""
    core, out, t = SchedulingCore(CFG), [], T0
    for k, step in enumerate(steps):
        if k == restart_at:
            core = SchedulingCore(CFG, {g: GpuView.from_dict(v.to_dict()) for g, v in core.views.items()})
        t += 0.5
        if step[0] == "ev":
            batch = Batch(telemetry=[event(k, t)], hold=hold)
        else:
            batch = Batch(intents=[intent(step[2], step[1], t, epoch=step[2])], hold=hold)
        applied = core.apply(batch)
        if hold:
            core.apply(Batch(committed=applied.views))
        out.extend(applied.commands)
    return out


@given(STEPS, st.data())
@settings(max_examples=150, deadline=None)
def test_epochs_rise_intents_apply_once_and_lent_gpus_get_no_coresident_lease(steps, data):
    cmds = run(steps)
    top, replica_until = 0, 0.0  # the replica lease's expiry as its commands set it
    for c in cmds:
        if c.kind == "grant":
            assert c.epoch > top, "a grant reused an epoch"
            top = c.epoch
            if c.lease_kind == "coresident":
                assert c.ts >= replica_until, "co-resident grant on a lent GPU"
        if c.lease_kind == "replica":
            replica_until = c.expires_at if c.kind in ("grant", "renew") else 0.0
    assert len({c.command_id for c in cmds}) == len(cmds)
    k = data.draw(st.integers(0, len(steps)))
    assert run(steps, restart_at=k) == cmds  # a takeover from the published views
    assert run(steps, hold=True) == cmds


def test_samples_of_a_pool_become_intents_and_replica_grants():
    """Three one-GPU replicas of a pool with replica leases at 1 rps each, 10 rps a replica: the
    GPU stage writes a sample per event, the pool stage lends the two it can spare, and the GPU
    stage grants them replica leases. A pool without replica leases writes no samples."""
    pool = PoolConfig(replica_capacity_rps=10.0, window_s=20.0)
    core = SchedulingCore(CFG, pools={"serving": pool})
    gpus = ("n/0", "n/1", "n/2")
    evs = [
        telemetry_example(event_id=f"{g}-{k}", ts=T0 + 5 * k, gpu=g, rps=1.0, latency_ms=CALM)
        for k in range(4)  # the pool's window (20 s: four 5 s bins) of history, which a lend needs
        for g in gpus
    ]
    applied = core.apply(Batch(telemetry=evs))
    assert [s.event_id for s in applied.samples] == [e.event_id for e in evs]
    assert all(s.headroom_ok and s.replica == s.gpu for s in applied.samples)
    intents = run_stage(applied.samples, pool)[1]
    assert sorted((i.gpu, i.action) for i in intents) == [("n/1", LEND), ("n/2", LEND)]
    cmds = core.apply(Batch(intents=intents)).commands
    for g in ("n/1", "n/2"):  # the co-resident lease decide() granted on the calm events goes first
        assert [(c.kind, c.lease_kind) for c in cmds if c.gpu == g] == [("revoke", "coresident"), ("grant", "replica")]
    assert not [c for c in cmds if c.gpu == "n/0"]
    assert SchedulingCore(CFG).apply(Batch(telemetry=evs)).samples == ()
