"""`rose simulate --policy rose`: both lease kinds, chosen per replica (docs/contract.md §7),
through the live scheduler's path: the scheduling core with the fleet's pool, the pool stage on
the samples it returns, the intents in the core's next batch (rose.sim.lease_kinds_run)."""

from __future__ import annotations

import orjson

from rose.policy import pool_stage
from rose.policy.core import SchedulingCore
from rose.policy.pool import PoolConfig
from rose.sim.engine import SimConfig, simulate
from tests.test_simulate_replica import _trace

SMALL = dict(n_gpus=8, model="8B", duration_s=600, record_series=False, check_invariants=True)
SHORT_WINDOW = PoolConfig(window_s=30.0)  # a 10-minute run: the forecast looks back 30 s, not 5 min
# half of the roofline at the busiest minute: at the default 0.7 this fleet's co-resident leases
# alone already cost 1.3 points of SLO attainment in the busy thirds (docs/simulator.md "Both lease kinds")
LOAD = 0.5


def _ramp(t: float) -> float:
    """Busy, down over 100 s to a tenth, a trough, back up over 100 s: slower than the reclaim
    horizon, so the forecast sees the rise (a step up is late by construction:
    test_simulate_replica's reclaim test)."""
    if t < 150.0:
        return 10.0
    if t < 250.0:
        return 10.0 - 9.0 * (t - 150.0) / 100.0
    if t < 350.0:
        return 1.0
    if t < 450.0:
        return 1.0 + 9.0 * (t - 350.0) / 100.0
    return 10.0


def _run(rate, policies: tuple[str, ...], **kw) -> dict:
    cfg = SimConfig(**{**SMALL, "policies": policies, "replica_pool": SHORT_WINDOW, "load": LOAD, **kw})
    return simulate(_trace(rate), cfg)


def test_rose_grants_both_kinds_in_a_trough_and_keeps_the_slo():
    pol = _run(_ramp, ("static", "rose-coresident", "rose"))["policies"]
    static, co, rose = pol["static"], pol["rose-coresident"], pol["rose"]
    assert rose["replica_lease_hours"] > 0 and rose["coresident_lease_hours"] > 0
    assert rose["replica_grants"] > 0 and rose["grants"] > 0
    assert rose["reclaims_late"] == 0 and rose["drain_timeouts"] == 0
    assert rose["slo_attainment"] >= static["slo_attainment"] - 0.002
    # a lent replica runs rollout alone at the solo rate: more work than its co-resident share
    assert rose["rollout_episodes"] >= co["rollout_episodes"]
    assert rose["harvest_per_serving_gpu"] >= co["harvest_per_serving_gpu"]
    assert rose["work"]["parked"] + rose["work"]["recomputed"] > 0  # revokes hand their episodes on


def test_a_pool_never_lends_its_last_serving_replica():
    """Two replicas, a tenth of the load in the trough: one is lent, never both
    (`check_invariants` asserts a serving replica every window)."""
    rose = _run(_ramp, ("rose",), n_gpus=2)["policies"]["rose"]
    assert rose["replica_grants"] > 0 and rose["replica_lease_hours"] > 0


def test_a_run_that_lends_no_replica_is_rose_coresident_s():
    """At a flat load the pool stage lends nothing: the core's co-resident decisions, and every
    figure, are rose-coresident's."""
    pol = _run(lambda t: 10.0, ("rose-coresident", "rose"), duration_s=240)["policies"]
    co, rose = pol["rose-coresident"], pol["rose"]
    assert rose["replica_grants"] == 0 and rose["pool_decisions"] > 0 and rose["grants"] > 0
    assert {k: v for k, v in rose.items() if k in co} == co


def test_the_simulator_runs_the_pool_stage_and_feeds_its_intents_back(monkeypatch):
    """The lends come from rose.policy.pool_stage.decide_sample, through `Batch.intents` and the
    core's intent commands; a stage that decides nothing lends nothing."""
    batches = []
    apply = SchedulingCore.apply

    def spy(self, batch):
        out = apply(self, batch)
        if batch.intents:
            batches.append((batch, out))
        return out

    monkeypatch.setattr(SchedulingCore, "apply", spy)
    rose = _run(_ramp, ("rose",))["policies"]["rose"]
    assert batches and rose["replica_grants"] > 0
    kinds = {(c.kind, c.lease_kind) for _, out in batches for c in out.intent_commands}
    assert {("grant", "replica"), ("revoke", "replica")} <= kinds
    samples = [s for _, out in batches for s in out.samples]
    assert samples and {s.pool for s in samples} == {"serving"}

    def decides_nothing(state, s, cfg):
        return pool_stage.fold_sample(state, s, cfg), ()

    monkeypatch.setattr("rose.sim.replica_run.decide_sample", decides_nothing)
    none = _run(_ramp, ("rose",), duration_s=300)["policies"]["rose"]
    assert none["replica_grants"] == 0 and none["replica_lease_hours"] == 0 and none["pool_decisions"] > 0


def test_same_seed_same_json():
    a = _run(_ramp, ("rose",), duration_s=420)
    b = _run(_ramp, ("rose",), duration_s=420)
    assert a["policies"]["rose"]["replica_grants"] > 0
    assert orjson.dumps(a["policies"], option=orjson.OPT_SORT_KEYS) == orjson.dumps(
        b["policies"], option=orjson.OPT_SORT_KEYS
    )
