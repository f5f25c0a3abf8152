"""The replica-lease audit (tests/faults/replica_audit.py) on hand-made committed logs, no
Kafka: a log the pure stages wrote passes, and each fault the audit is there for fails it,
naming the fault."""

from __future__ import annotations

import dataclasses

import pytest

from rose.config import PolicyConfig, PoolConfig
from rose.policy.lease_policy import GpuView
from rose.policy.pool_records import LEND, PoolSample
from rose.policy.pool_stage import PoolState, decide_sample
from rose.policy.replica_intents import apply_intent, holds_replica_lease
from tests.faults.replica_audit import _takeover_state, check_replicas, pool_replay

POOL = PoolConfig(replica_capacity_rps=10.0, window_s=20.0, bin_s=5.0)  # as tests/test_scheduler_pools.py
POLICY = PolicyConfig(ttl_s=60.0)
GPUS = {"r0": "pl/0", "r1": "pl/1", "r2": "pl/2"}
T0 = 1_700_000_000.0
RISE = 50  # the tick from which r0 serves 25 rps: four replicas needed, the lent two come back


def _log(takeover_at: int = -1, takeover_window_s: float = 0.0) -> tuple[list, list, list]:
    """60 ticks of 0.5 s of three idle replicas through the pool stage and each GPU's stage: once
    the samples cover the window two replicas are lent (and report `lent`), and after the rise
    reclaimed. Record times: a sample at its event time, its intents 0.1 s and commands 0.2 s later.
    `takeover_at`: the pool stage is taken over before that sample, reading back `takeover_window_s`."""
    state, views = PoolState(), {}
    samples, intents, cmds = [], [], []
    for tick in range(60):
        ts = T0 + 0.5 * tick
        for r, gpu in GPUS.items():
            v = views.get(gpu)
            lent = holds_replica_lease(v)
            rps = 0.0 if lent else 25.0 if (r == "r0" and tick >= RISE) else 1.0
            lease = (v.lease_id, v.epoch) if lent else ("", 0)
            s = PoolSample(
                f"{gpu}#{tick}", ts, "chat", gpu, r, "lent" if lent else "serving", rps, True, 80 << 30,
                v.epoch if v else 0, *lease,
            )  # fmt: skip
            if len(samples) == takeover_at:
                state = _takeover_state(samples, intents, takeover_at, POOL, takeover_window_s)
            samples.append((s, ts))
            state, new = decide_sample(state, s, POOL)
            for i in new:
                intents.append((i, ts + 0.1))
                views[i.gpu], out = apply_intent(views.get(i.gpu, GpuView(gpu=i.gpu)), i, POLICY)
                cmds += [(c.to_dict(), ts + 0.2) for c in out]
    return samples, intents, cmds


def _check(samples, intents, cmds, rebuilds=()) -> dict:
    return check_replicas({"chat": POOL}, samples, intents, cmds, rebuilds=rebuilds)


def test_the_stages_own_log_passes():
    samples, intents, cmds = _log()
    counts = _check(samples, intents, cmds)
    assert counts["replica_grant"] == 2 and counts["replica_revoke"] == 2, counts
    assert counts["intents_lend"] == 2 and counts["intents_reclaim"] == 2, counts
    # a takeover anywhere rebuilds the state the run carried: no rebuild is needed to explain it
    ok, info = pool_replay(samples, intents, POOL, [(T0, T0 + 60)], POOL.window_s)
    assert ok and info["rebuilt"] == 0, info


def test_a_takeover_counts_only_inside_a_rebuild_window():
    """A stage that took over just before the lend reading back 1 s only (too little history to
    lend: nothing is lent, so nothing comes back): its intents are no carried state's decision, and
    are the decision of a takeover in a window around that sample."""
    whole, lends, _ = _log()
    k = next(n for n, (x, _) in enumerate(whole) if x.event_id == lends[0][0].cause_event_id)
    samples, intents, _ = _log(takeover_at=k, takeover_window_s=1.0)
    assert not intents, "the short view lends nothing"
    ok, info = pool_replay(samples, intents, POOL, (), 1.0)
    assert not ok and info["at"] <= k, info
    at = samples[k][1]
    ok, info = pool_replay(samples, intents, POOL, [(at - 0.01, at + 0.01)], 1.0)
    assert ok and info["rebuilt"] == 1, info
    ok, _ = pool_replay(samples, intents, POOL, [(at + 5.0, at + 6.0)], 1.0, lag_s=1.0)
    assert not ok, "a window after the takeover (by more than the lag) explains nothing"


def _grant(cmds: list) -> tuple[dict, float]:
    return next(x for x in cmds if x[0]["kind"] == "grant" and x[0].get("lease_kind") == "replica")


def test_a_duplicated_replica_command_is_named():
    samples, intents, cmds = _log()
    with pytest.raises(AssertionError, match="duplicated replica commands"):
        _check(samples, intents, [*cmds, _grant(cmds)])


def test_a_replica_granted_twice_is_named():
    """The GPU stage applying one lend twice (as if it had lost the intent id it applied): a
    second grant of the same replica at the next epoch, while the first lease is held."""
    samples, intents, cmds = _log()
    g, t = _grant(cmds)
    again = {
        **g,
        "command_id": g["command_id"] + "x",
        "epoch": g["epoch"] + 1,
        "lease_id": f"{g['gpu']}#{g['epoch'] + 1}",
    }
    k = cmds.index((g, t))
    with pytest.raises(AssertionError, match="granted again while lent"):
        _check(samples, intents, [*cmds[: k + 1], (again, t), *cmds[k + 1 :]])


def test_a_lend_of_the_pools_last_serving_replica_is_named():
    """The decision that lends r1 and r2 also lending r0: no replica left serving."""
    samples, intents, cmds = _log()
    i, t = next(x for x in intents if x[0].action == LEND)
    last = dataclasses.replace(i, intent_id="last", replica="r0", gpu="pl/0")
    with pytest.raises(AssertionError, match="last serving replica"):
        _check(samples, [*intents, (last, t)], cmds)


def test_a_lost_reclaim_intent_is_not_the_decision():
    samples, intents, cmds = _log()
    kept = [x for x in intents if not (x[0].action != LEND and x[0].replica == "r2")]
    lost = {x[0].intent_id for x in intents} - {x[0].intent_id for x in kept}
    rest = [x for x in cmds if x[0]["cause_event_id"] not in lost]
    with pytest.raises(AssertionError, match="not the pool stage's decision"):
        _check(samples, kept, rest)


@pytest.mark.parametrize("kind", ["grant", "revoke"])
def test_an_intent_whose_replica_command_was_lost_is_named(kind):
    samples, intents, cmds = _log()
    gone = next(x for x in cmds if x[0]["kind"] == kind and x[0].get("lease_kind") == "replica")
    with pytest.raises(AssertionError, match="lost"):
        _check(samples, intents, [x for x in cmds if x is not gone])


def test_a_revoke_of_a_lease_the_gpu_does_not_hold_is_named():
    samples, intents, cmds = _log()
    r, t = next(x for x in cmds if x[0]["kind"] == "revoke" and x[0].get("lease_kind") == "replica")
    wrong = {**r, "command_id": r["command_id"] + "x", "lease_id": r["gpu"] + "#99"}
    with pytest.raises(AssertionError, match="revoked"):
        _check(samples, intents, [x if x[0] is not r else (wrong, t) for x in cmds])
