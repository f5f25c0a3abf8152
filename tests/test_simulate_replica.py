"""`rose simulate` with replica leases (docs/contract.md §7): `rose-replica` lends whole serving
replicas in a trough through the pool decision (rose.policy.pool), routes the pool's load to the
replicas that serve, and reclaims them; `rose-coresident` grants co-resident leases only (`rose`,
both kinds: tests/test_simulate_lease_kinds.py)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import orjson
import pytest

from rose.policy import pool as pool_decision
from rose.policy.pool import PoolConfig
from rose.sim.engine import SimConfig, simulate
from rose.sim.requests import balance, two_choices
from rose.sim.traces import Trace

SMALL = dict(n_gpus=8, model="8B", duration_s=600, record_series=False, check_invariants=True)
SHORT_WINDOW = PoolConfig(window_s=30.0)  # a 10-minute run: the forecast looks back 30 s, not 5 min


def _trace(rate, span: float = 600.0, seed: int = 0) -> Trace:
    """Poisson arrivals at `rate(t)` requests/s (a function of time), 512-token prompts, 128 out."""
    rng = np.random.default_rng(seed)
    t, x = [], 0.0
    while True:
        x += rng.exponential(1.0 / rate(x))
        if x >= span:
            break
        t.append(x)
    n = len(t)
    return Trace("synthetic", "azure", np.array(t), np.full(n, 512, np.int32), np.full(n, 128, np.int32))


def _trough(t: float) -> float:
    """Busy for the first and last third, a tenth of that in between."""
    return 10.0 if t < 200.0 or t > 400.0 else 1.0


def _run(tr: Trace, policies: tuple[str, ...], **kw) -> dict:
    return simulate(tr, SimConfig(**{**SMALL, "policies": policies, "replica_pool": SHORT_WINDOW, **kw}))["policies"]


def test_a_trough_lends_replicas_and_keeps_the_slo():
    pol = _run(_trace(_trough), ("static", "rose-replica"))
    static, rep = pol["static"], pol["rose-replica"]
    assert rep["grants"] > 0 and rep["revokes"] > 0  # lent in the trough, reclaimed as the load rose
    assert rep["episodes"] > static["episodes"] and rep["harvest_per_serving_gpu"] > 0
    assert rep["replica_lease_hours"] > 0 and rep["coresident_lease_hours"] == 0
    assert isinstance(rep["reclaims_late"], int) and rep["reclaims_late"] >= 0
    assert rep["slo_attainment"] >= static["slo_attainment"] - 0.002
    assert rep["drain_timeouts"] == 0 and 0 < rep["mean_drain_s"] < 30
    assert rep["warm_starts"] + rep["cold_starts"] == rep["grants"]
    assert rep["work"]["parked"] + rep["work"]["recomputed"] > 0  # reclaims hand their episodes on


def test_a_reclaim_slower_than_the_rise_is_counted_late():
    """A replica that takes a minute to be readmitted is still out when the load comes back."""
    slow = PoolConfig(window_s=70.0, readmit_s=60.0)
    rep = _run(_trace(_trough), ("rose-replica",), replica_pool=slow)["rose-replica"]
    assert rep["grants"] > 0 and rep["reclaims_late"] > 0


def test_a_flat_load_at_capacity_lends_nothing():
    pol = _run(_trace(lambda t: 10.0), ("static", "rose-replica"))
    static, rep = pol["static"], pol["rose-replica"]
    assert rep["grants"] == 0 and rep["replica_lease_hours"] == 0 and rep["pool_decisions"] > 0
    # nothing lent: the router sends every request where static's does, the same serving figures
    assert rep["slo_attainment"] == static["slo_attainment"] and rep["episodes"] == static["episodes"]


def test_the_pool_decision_is_the_policy_s_own(monkeypatch):
    """The simulator lends what rose.policy.pool.decide_pool says, through the pool stage
    (rose.policy.pool_stage): one that lends nothing, nothing."""
    calls = []

    def keep_all(view, cfg):
        calls.append(view)
        d = pool_decision.decide_pool(view, cfg)
        return replace(d, lend=(), reclaim=())

    monkeypatch.setattr("rose.policy.pool_stage.decide_pool", keep_all)
    rep = _run(_trace(_trough), ("rose-replica",))["rose-replica"]
    assert calls and rep["grants"] == 0 and rep["pool_decisions"] == len(calls)
    assert {r.serving_state for r in calls[-1].replicas} == {"serving"} and len(calls[-1].replicas) == 8


def test_rose_coresident_grants_co_resident_leases_only():
    co = _run(_trace(_trough), ("rose-coresident",), duration_s=240)["rose-coresident"]
    assert co["grants"] > 0 and co["replica_lease_hours"] == 0 and co["coresident_lease_hours"] > 0
    assert co["reclaims_late"] == 0


def test_the_router_sends_nothing_to_a_replica_that_is_out():
    load = np.array([3.0, 0.0, 1.0, 2.0, 0.0, 5.0])
    every = balance(4, 500, load, 7, two_choices(4, 500, 6, 7))
    assert (every == balance(4, 500, load, 7, admitting=np.ones(6, dtype=bool))).all()  # all in: as before
    admitting = np.array([True, False, True, True, False, True])
    some = balance(4, 500, load, 7, two_choices(4, 500, 6, 7), admitting)
    assert set(some.tolist()) <= {0, 2, 3, 5} and 2 in some  # the least loaded inside gets the most
    one = balance(4, 50, load, 7, admitting=np.eye(6, dtype=bool)[3])
    assert (one == 3).all()


def test_cli_names_the_new_policies(traces_dir):
    p = subprocess.run(
        [sys.executable, "-m", "rose", "simulate", "--trace", str(traces_dir / "burstgpt1_first400.csv"),
         "--gpus", "4", "--duration", "60", "--policy", "static,rose-replica,rose-coresident,rose", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    pol = orjson.loads(p.stdout)["policies"]
    assert list(pol) == ["static", "rose", "rose-coresident", "rose-replica"]
    for name in ("rose", "rose-coresident", "rose-replica"):
        assert {"replica_lease_hours", "coresident_lease_hours", "reclaims_late"} <= set(pol[name])


def test_cli_plays_the_configured_pool_settings(traces_dir, tmp_path):
    """`[policy.pools.serving]` in the configuration file is the simulated pool's decision
    settings, so an operator's forecast window is what the run plays; without it, the product's."""
    conf = tmp_path / "pool.toml"
    conf.write_text("[policy.pools.serving]\nwindow_s = 900.0\nheadroom = 0.5\n")

    def pool(*config: str) -> dict:
        p = subprocess.run(
            [sys.executable, "-m", "rose", *config, "simulate", "--trace", str(traces_dir / "burstgpt1_first400.csv"),
             "--gpus", "4", "--duration", "30", "--policy", "rose", "--json"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert p.returncode == 0, p.stderr
        return orjson.loads(p.stdout)["config"]["replica_pool"]

    configured = pool("--config-file", str(conf))
    assert (configured["window_s"], configured["headroom"]) == (900.0, 0.5)
    assert pool()["window_s"] == PoolConfig().window_s


@pytest.mark.parametrize("bad", ["rose-both", "replica"])
def test_cli_unknown_policy_lists_the_new_ones(traces_dir, bad):
    p = subprocess.run(
        [sys.executable, "-m", "rose", "simulate", "--trace", str(traces_dir / "burstgpt1_first400.csv"),
         "--duration", "10", "--policy", bad],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2 and "rose-replica" in p.stderr and len(p.stderr.strip().splitlines()) == 1
