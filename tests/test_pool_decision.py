"""The pool decision (rose.policy.pool): properties over generated pools, and the forecast on a
synthetic trough and a ramp."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rose.config import PolicyConfig
from rose.contract.events import Command
from rose.contract.wire import decode, encode
from rose.policy.pool import (
    FORECASTS,
    LEASE_CORESIDENT,
    LEASE_NONE,
    LEASE_REPLICA,
    PoolConfig,
    ReplicaLease,
    decide_pool,
    forecast_rps,
    lease_kinds,
    pool_view,
    replica_commands,
    replicas_needed,
    window_bins,
)
from rose.policy.replay import encode_commands
from tests.examples import telemetry_example

T0 = 1_700_000_000.0
STATES = ("serving", "serving", "serving", "draining", "lent", "reclaiming")


def events_of(pool):
    """Telemetry of a generated pool: per replica (state, gpus, rps per sample), one event per GPU
    per sample, 5 s apart."""
    out = []
    for i, (state, ngpu, series) in enumerate(pool):
        for k, rps in enumerate(series):
            for g in range(ngpu):
                out.append(
                    telemetry_example(
                        event_id=f"r{i}g{g}s{k}",
                        ts=T0 + 5.0 * k + 0.01 * g,
                        node=f"node-{i}",
                        gpu=f"node-{i}/{g}",
                        replica=f"r{i}",
                        serving_state=state,
                        rps=rps,
                    )
                )
    return out


pools = st.lists(
    st.tuples(
        st.sampled_from(STATES),
        st.integers(1, 2),
        st.lists(st.floats(0, 50, allow_nan=False), min_size=1, max_size=8),
    ),
    min_size=1,
    max_size=6,
)
configs = st.builds(
    PoolConfig,
    replica_capacity_rps=st.floats(0.5, 40, allow_nan=False),
    forecast=st.sampled_from(FORECASTS),
    window_s=st.sampled_from((10.0, 30.0, 60.0)),
)


def decide(pool, cfg):
    view = pool_view(events_of(pool), cfg)
    assert view is not None
    return view, decide_pool(view, cfg)


@settings(max_examples=200, deadline=None)
@given(pool=pools, cfg=configs)
def test_never_fewer_serving_than_the_forecast_needs_and_never_the_last(pool, cfg):
    view, d = decide(pool, cfg)
    needed = replicas_needed(
        forecast_rps(cfg.forecast, view.load, cfg.bin_s, cfg.horizon_s), cfg.replica_capacity_rps, cfg.headroom
    )
    assert d.needed == needed >= 1
    states = {r.replica: r.serving_state for r in view.replicas}
    serving = [r for r, s in states.items() if s == "serving"]
    assert len(d.keep) >= min(needed, len(view.replicas))  # kept or coming back within the horizon
    assert set(d.lend) <= set(serving) and set(d.reclaim) <= {r for r, s in states.items() if s in ("draining", "lent")}
    if serving:
        assert len(set(serving) - set(d.lend)) >= 1  # the last serving replica is never lent
    assert not (d.lend and d.reclaim)
    if d.lend:  # lending only a surplus: what stays (serving or back) still covers the need
        assert (
            len([r for r in d.keep if states[r] in ("serving", "reclaiming")]) >= needed
            or len(serving) - len(d.lend) == 1
        )


@settings(max_examples=200, deadline=None)
@given(pool=pools, cfg=configs)
def test_nothing_is_lent_on_less_than_a_window_of_history(pool, cfg):
    """The forecast was chosen on decisions with a window of history (docs/policy.md): a view whose
    bins do not cover the window lends nothing, whatever its load, and says so; a deficit is
    reclaimed all the same."""
    view, d = decide(pool, cfg)
    surplus = sum(r.serving_state in ("serving", "reclaiming") for r in view.replicas) - d.needed
    if len(view.load) >= window_bins(cfg):
        assert not d.history_short
        return
    assert d.lend == () and d.history_short == (surplus > 0)
    # the same view with the window's missing bins at 0 rps: for `peak` and `last` the same forecast
    full = decide_pool(replace(view, load=(0.0,) * (window_bins(cfg) - len(view.load)) + view.load), cfg)
    if full.forecast_rps == d.forecast_rps:
        assert d.reclaim == full.reclaim and d.needed == full.needed


def test_a_new_pool_lends_nothing_on_its_first_seconds():
    """Two replicas at 2 rps each, whose first 0.5 s windows happened to finish no request: the
    pool's first samples read 0 rps, whose peak is no forecast of the next minutes. The same
    samples a window later (two 5 s bins of 10 s) are its forecast."""
    cfg = PoolConfig(replica_capacity_rps=3.0, window_s=10.0)
    first = [
        telemetry_example(
            event_id=f"r{i}", ts=T0 + 0.01 * i, node=f"node-{i}", gpu=f"node-{i}/0", replica=f"r{i}", rps=0.0
        )
        for i in range(2)
    ]
    d = decide_pool(pool_view(first, cfg), cfg)
    assert (d.forecast_rps, d.needed, d.lend, d.history_short) == (0.0, 1, (), True)
    assert "less than a window of history: nothing lent" in d.explain()
    later = [replace(e, event_id=e.event_id + "+5s", ts=e.ts + 5.0) for e in first]
    d = decide_pool(pool_view(first + later, cfg), cfg)
    assert (d.forecast_rps, d.lend, d.history_short) == (0.0, ("r1",), False)


@settings(max_examples=100, deadline=None)
@given(pool=pools, cfg=configs, seed=st.integers(0, 2**16))
def test_deterministic_whatever_the_event_order(pool, cfg, seed):
    evs = events_of(pool)
    shuffled = list(evs)
    random.Random(seed).shuffle(shuffled)
    v1, v2 = pool_view(evs, cfg), pool_view(shuffled, cfg)
    assert v1 == v2
    d1, d2 = decide_pool(v1, cfg), decide_pool(v2, cfg)
    assert d1 == d2 and d1.explain() == d2.explain()
    cause = max(evs, key=lambda e: (e.ts, e.event_id))
    epochs = {e.gpu: 3 for e in evs}
    leases = {e.gpu: ReplicaLease(e.gpu, f"{e.gpu}#3", 3) for e in evs if e.serving_state in ("lent", "draining")}
    c1 = replica_commands(d1, v1, cause, epochs, leases, PolicyConfig())
    c2 = replica_commands(d2, v2, cause, dict(reversed(epochs.items())), leases, PolicyConfig())
    assert encode_commands(c1) == encode_commands(c2)
    assert len({c.command_id for c in c1}) == len(c1)
    assert all(decode(encode(c), Command) == c for c in c1)


@settings(max_examples=200, deadline=None)
@given(pool=pools, cfg=configs, factor=st.floats(1.0, 10.0))
def test_more_load_never_lends_more(pool, cfg, factor):
    """Every replica's load scaled up (for every forecast), or one sample raised (the peak)."""
    _, d = decide(pool, cfg)
    louder = [(s, n, [x * factor for x in series]) for s, n, series in pool]
    _, d2 = decide(louder, cfg)
    assert len(d2.lend) <= len(d.lend) and len(d2.reclaim) >= len(d.reclaim)
    if cfg.forecast == "peak":
        s, n, series = pool[0]
        _, d3 = decide([(s, n, series[:-1] + [series[-1] + 10 * factor]), *pool[1:]], cfg)
        assert len(d3.lend) <= len(d.lend)


def noisy_events(n_replicas, tp, means, rng, period=0.5, bin_s=5.0, bins=6):
    """Telemetry of `n_replicas` replicas of `tp` GPUs each: every `period` one sample per GPU of
    a Poisson count over the period as its rps, replica i's mean rate `means[i]` (the GPUs of a
    replica report the same requests)."""
    out, per_bin = [], round(bin_s / period)
    for i in range(n_replicas):
        for k in range(bins * per_bin):
            rps = _poisson(rng, means[i] * period) / period
            for g in range(tp):
                out.append(
                    telemetry_example(
                        event_id=f"r{i}g{g}s{k}", ts=T0 + period * (k + 1) - 0.001 * (g + 1), node=f"node-{i}",
                        gpu=f"node-{i}/{g}", replica=f"r{i}", serving_state="serving", rps=rps,
                    )
                )  # fmt: skip
    return out


def _poisson(rng, lam):
    """Knuth's method: a Poisson draw of mean `lam` from a seeded `random.Random`."""
    k, p, limit = 0, 1.0, pow(2.718281828459045, -lam)
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def test_the_pool_load_is_the_sum_of_replica_means_not_of_sample_maxima():
    """64 replicas of 2 GPUs at 4.6 rps each (the Azure conv trace's 294 rps over 64), sampled
    every 0.5 s: the pool's load per bin is within 5 % of 64 × 4.6, not the sum of each replica's
    highest sample (over twice that), nor twice it for the two GPUs."""
    rng = random.Random(7)
    evs = noisy_events(64, 2, [4.6] * 64, rng)
    view = pool_view(evs, PoolConfig(replica_capacity_rps=10.0, window_s=30.0))
    assert view is not None and len(view.load) == 6
    for load in view.load:
        assert load == pytest.approx(64 * 4.6, rel=0.05)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(0.0, 40.0, allow_nan=False), min_size=1, max_size=5),
    st.integers(1, 2),
    st.integers(0, 2**32 - 1),
)
def test_a_bins_pool_load_lies_between_its_smallest_and_largest_summed_sample(means, tp, seed):
    """Per bin, the pool's load lies between the smallest and the largest over the bin's sample
    instants of the replicas' rps summed (a mean lies between its extremes)."""
    rng = random.Random(seed)
    evs = noisy_events(len(means), tp, means, rng, bins=2)
    view = pool_view(evs, PoolConfig(replica_capacity_rps=10.0, window_s=10.0))
    assert view is not None and len(view.load) == 2
    for b, load in enumerate(view.load):
        summed: dict[str, float] = {}  # per sample instant, over the replicas' first GPUs
        for e in evs:
            if max(0, 1 - int((view.now - e.ts) / 5.0)) == b and e.gpu.endswith("/0"):
                instant = e.event_id.split("s")[-1]
                summed[instant] = summed.get(instant, 0.0) + e.rps
        assert min(summed.values()) - 1e-6 <= load <= max(summed.values()) + 1e-6


def test_the_trough_lends_only_once_the_peak_leaves_the_window():
    """Four replicas at 8 rps each, then a trough at 1 rps each: with capacity 10 rps a replica,
    the peak forecast keeps all four until the window no longer holds the high samples, then
    keeps ceil(4 × 1.3 / 10) = 1 and lends the three highest ids."""
    cfg = PoolConfig(replica_capacity_rps=10.0, forecast="peak", window_s=30.0)
    series = [8.0] * 6 + [1.0] * 12  # 90 s: the trough starts at 30 s
    pool = [("serving", 1, series) for _ in range(4)]
    evs = events_of(pool)
    during = [e for e in evs if e.ts <= T0 + 45]  # the window (30 s) still holds 8 rps samples
    d = decide_pool(pool_view(during, cfg), cfg)
    assert d.forecast_rps == 32.0 and d.needed == 5 and d.lend == ()
    d = decide_pool(pool_view(evs, cfg), cfg)
    assert d.forecast_rps == 4.0 and d.needed == 1
    assert d.lend == ("r1", "r2", "r3") and d.keep == ("r0",)
    assert "forecast peak 4.000 rps" in d.explain() and "keep [r0]" in d.explain()
    assert "capacity 10.000 rps/replica (config)" in d.explain()


def test_a_rising_ramp_reclaims_before_the_peak_arrives_with_the_trend():
    """One replica serving, two lent; the load ramps 2 → 9 rps over 40 s. The peak forecast sees 9;
    the trend adds the slope over the horizon, so it asks for more replicas earlier."""
    ramp = [2.0 + k for k in range(8)]
    pool = [("serving", 1, ramp), ("lent", 1, [0.0] * 8), ("lent", 1, [0.0] * 8)]
    base = PoolConfig(replica_capacity_rps=6.0, window_s=60.0, wake_s=20.0)  # a slow wake: horizon 24 s
    _, peak = decide(pool, replace(base, forecast="peak"))
    _, trend = decide(pool, replace(base, forecast="peak_trend"))
    assert peak.forecast_rps == 9.0 and trend.forecast_rps > 9.0 + 0.2 * 24 - 1e-9
    assert peak.reclaim == ("r1",) and trend.reclaim == ("r1", "r2")


def test_no_capacity_figure_lends_nothing_and_reclaims_everything():
    cfg = PoolConfig(replica_capacity_rps=0.0)
    slo_missed = [("serving", 1, [5.0]), ("lent", 1, [0.0])]
    evs = [replace(e, latency_ms=e.slo_ms) for e in events_of(slo_missed)]  # no sample with headroom
    d = decide_pool(pool_view(evs, cfg), cfg)
    assert d.capacity_source == "none" and d.lend == () and d.reclaim == ("r1",)
    # with headroom on the samples, the highest serving rps seen is the capacity estimate
    d = decide_pool(pool_view(events_of([("serving", 1, [5.0]), ("serving", 1, [1.0])]), cfg), cfg)
    assert (d.capacity_source, d.capacity_rps, d.needed) == ("estimated", 5.0, 2)


def test_lease_kinds_replica_where_spared_else_coresident_where_predicted():
    cfg = PoolConfig(replica_capacity_rps=10.0, window_s=10.0)
    _, d = decide([("serving", 1, [1.0, 1.0]) for _ in range(3)], cfg)  # two 5 s bins: the window
    assert d.keep == ("r0",) and d.lend == ("r1", "r2")
    assert lease_kinds(d, {"r0": True, "r1": True}) == {
        "r0": LEASE_CORESIDENT,
        "r1": LEASE_REPLICA,
        "r2": LEASE_REPLICA,
    }
    assert lease_kinds(d, {})["r0"] == LEASE_NONE


def test_replica_commands_are_gangs_of_the_replica_and_revokes_of_live_leases():
    cfg = PoolConfig(replica_capacity_rps=10.0, window_s=10.0)
    evs = events_of([("serving", 1, [1.0, 1.0]), ("serving", 2, [1.0, 1.0])])
    view = pool_view(evs, cfg)
    d = decide_pool(view, cfg)
    cause = max(evs, key=lambda e: (e.ts, e.event_id))
    grants = replica_commands(d, view, cause, {"node-1/0": 4, "node-1/1": 6}, {}, PolicyConfig())
    assert [(c.kind, c.gpu, c.epoch, c.group_id, c.group_size, c.lease_kind) for c in grants] == [
        ("grant", "node-1/0", 7, "r1#7", 2, "replica"),
        ("grant", "node-1/1", 7, "r1#7", 2, "replica"),
    ]
    assert all(c.compute_share == 1.0 and c.cause_event_id == cause.event_id for c in grants)
    assert b'"lease_kind":"replica"' in encode(grants[0])
    rising = events_of([("serving", 1, [30.0]), ("lent", 2, [0.0])])
    view = pool_view(rising, cfg)
    d = decide_pool(view, cfg)
    leases = {"node-1/0": ReplicaLease("node-1/0", "node-1/0#7", 7)}  # node-1/1's lease already ended
    revokes = replica_commands(d, view, max(rising, key=lambda e: e.ts), {}, leases, PolicyConfig())
    assert d.reclaim == ("r1",) and [(c.kind, c.lease_id) for c in revokes] == [("revoke", "node-1/0#7")]


def test_bad_pool_settings_name_the_setting():
    from rose.policy.pool import check_pool_config

    check_pool_config("chat", PoolConfig())
    for bad, setting in (
        (PoolConfig(forecast="daily"), "policy.pools.chat.forecast"),
        (PoolConfig(replica_capacity_rps=-1.0), "policy.pools.chat.replica_capacity_rps"),
        (PoolConfig(bin_s=0.0), "policy.pools.chat.bin_s"),
        (PoolConfig(window_s=2.0), "policy.pools.chat.window_s"),
    ):
        with pytest.raises(ValueError, match=setting.replace(".", r"\.")) as e:
            check_pool_config("chat", bad)
        assert "\n" not in str(e.value)


def test_forecast_eval_scores_a_step_rise():
    """A load that steps from 1 to 8 rps: `last` under-provisions at the step; a peak whose window
    still holds an earlier 8 rps burst does not, and frees less."""
    import numpy as np

    from rose.sim.forecast_eval import evaluate

    load = np.array([1.0] * 5 + [8.0] + [1.0] * 10 + [8.0] * 3)
    last = evaluate(load, 5.0, "last", 5.0, 4.4)
    peak = evaluate(load, 5.0, "peak", 75.0, 4.4)  # 15 bins: the window at every decision holds an 8
    assert peak["decisions"] == 4 and peak["under_provisioned"] == 0 and last["under_provisioned"] > 0
    assert peak["capacity_freed"] < last["capacity_freed"]
    assert last["largest_rise"] == 8.0 and last["under_after_no_load"] == 0
    # the pool carries 8 rps × 1.3 on 8 replicas; a decision's headroom of ×8 keeps 7 of them on a
    # forecast of 1 rps, which carry the step: the rise, not the pool, was short
    assert evaluate(load, 5.0, "last", 5.0, 4.4, headroom=7.0)["under_provisioned"] == 0
