"""The lease policy against docs/contract.md §4: readable examples, one behaviour each (grant,
pause and resume, revoke and cooldown, hysteresis, trend, stale events, the share estimate).
The property tests are in tests/test_lease_policy.py."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from rose.config import GiB
from rose.policy.core import observe_lease_state
from rose.policy.lease_policy import POLICY_VERSION, GpuView, cooldown_for, decide
from tests.examples import lease_state_example
from tests.policy_examples import CFG, run, steady, tel


def test_grant_needs_three_events_of_headroom_then_sizes_from_this_gpu():
    ds = run(steady(3))
    assert [d.explain.action for d in ds] == ["none", "none", "grant"]
    assert ds[0].explain.reason == "headroom streak 1 < 3"
    g = ds[2].commands[0]
    assert (g.kind, g.epoch, g.lease_id, g.expires_at) == ("grant", 1, "n/0#1", 101.0 + 5.0)
    # 80 GiB total, 30 serving, 8 margin: 42 available; headroom 0.8 lends ~86 % of it
    assert 2 * GiB <= g.mem_bytes <= 42 * GiB and g.mem_bytes % (64 << 20) == 0
    assert ds[2].explain.headroom == {"ttft_p99": pytest.approx(0.8), "tpot_p99": pytest.approx(0.8)}
    small = run(steady(3, gpu="s/0", total_gib=24, serving_gib=10))[2].commands[0]
    assert small.mem_bytes < g.mem_bytes  # capacity from each GPU's own telemetry


def test_no_grant_without_memory_for_the_minimum_lease():
    ds = run(steady(4, total_gib=24, serving_gib=20))  # 24 - 20 - 2.4 margin = 1.6 GiB < 2 GiB
    assert all(not d.commands for d in ds)
    assert "< minimum lease 2.00 GiB" in ds[-1].explain.reason


def test_pause_on_the_very_event_that_loses_headroom_then_resume_after_the_streak_same_lease():
    ds = run(steady(3))
    granted = ds[-1].commands[0]
    bad = tel(3, 101.5, tpot_frac=0.92)
    d = decide(ds[-1].view, bad, CFG)
    (t,) = d.commands
    assert (t.kind, t.epoch, t.lease_id, t.cause_event_id, t.compute_share) == (
        "throttle",
        1,
        "n/0#1",
        bad.event_id,
        0.0,
    )
    assert t.reason.startswith("pause: headroom 0.08 < 0.10 on tpot_p99") and t.mem_bytes == granted.mem_bytes
    assert d.view.cooldown_until == 0.0 and d.view.lease_id == "n/0#1" and d.view.paused_since == 101.5
    # still slow: held paused (renewed as it comes due), never resumed
    view, kinds = d.view, []
    for i in range(4, 12):
        dd = decide(view, tel(i, 100 + 0.5 * i, tpot_frac=0.95), CFG)
        kinds.append(dd.explain.action)
        view = dd.view
        assert all(c.compute_share == 0.0 for c in dd.commands)
    assert set(kinds) <= {"hold", "renew"} and "renew" in kinds
    # calm again: resumed on the third calm event, same lease and epoch, no cooldown
    acts = []
    for i in range(12, 15):
        dd = decide(view, tel(i, 100 + 0.5 * i), CFG)
        acts.append(dd.explain.action)
        view = dd.view
    assert acts == ["hold", "hold", "throttle"]
    (r,) = dd.commands
    assert (r.kind, r.lease_id, r.epoch) == ("throttle", "n/0#1", 1) and r.compute_share > 0.0
    assert view.paused_since == -1.0 and view.epoch == 1


def test_a_pause_that_lasts_max_pause_s_is_revoked_with_a_cooldown():
    view = run(steady(3))[-1].view
    view = decide(view, tel(3, 101.5, tpot_frac=0.95), CFG).view
    t, i = 101.5, 4
    while t < 101.5 + CFG.max_pause_s - 0.5:
        t += 0.5
        d = decide(view, tel(i, t, tpot_frac=0.95), CFG)
        assert d.explain.action in ("hold", "renew"), d.explain
        view, i = d.view, i + 1
    d = decide(view, tel(i, 101.5 + CFG.max_pause_s, tpot_frac=0.95), CFG)
    (r,) = d.commands
    assert r.kind == "revoke" and r.reason.startswith(f"paused for {CFG.max_pause_s:.1f} s")
    assert d.view.lease_id is None and d.view.cooldown_until == d.view.last_ts + CFG.cooldown_s


def test_memory_revoke_starts_a_cooldown_with_backoff():
    ds = run(steady(3))
    lent = ds[-1].view.lease_mem_bytes / GiB
    bad = tel(3, 101.5, serving_gib=80 - lent - 7.0)  # free 7 GiB < 8 GiB margin
    d = decide(ds[-1].view, bad, CFG)
    (r,) = d.commands
    assert (r.kind, r.epoch, r.lease_id, r.cause_event_id) == ("revoke", 1, "n/0#1", bad.event_id)
    assert d.view.cooldown_until == 101.5 + 10.0 and d.view.lease_id is None
    # healthy again, but cooling down until 111.5
    view = d.view
    for i in range(4, 23):
        dd = decide(view, tel(i, 100 + 0.5 * i), CFG)
        assert not dd.commands
        view = dd.view
    assert "cooldown until 111.500" in dd.explain.reason
    g = decide(view, tel(24, 112.0), CFG).commands[0]
    assert (g.kind, g.epoch) == ("grant", 2)
    # a second revoke soon after doubles the cooldown
    lent = g.mem_bytes / GiB
    d2 = decide(decide(view, tel(24, 112.0), CFG).view, tel(25, 112.5, serving_gib=80 - lent - 7.0), CFG)
    assert d2.commands[0].kind == "revoke" and d2.view.cooldown_until == 112.5 + 20.0
    assert cooldown_for(20, CFG) == CFG.cooldown_max_s


def test_hysteresis_holds_and_renews_between_thresholds():
    view = run(steady(3, tpot_frac=0.65))[-1].view
    kinds = []
    for i in range(3, 20):  # headroom 0.2: below grant, above revoke; a gentle rise
        d = decide(view, tel(i, 100 + 0.5 * i, tpot_frac=0.8), CFG)
        kinds.append(d.explain.action)
        view = d.view
    assert "revoke" not in kinds and kinds.count("renew") >= 2
    renew = next(
        c for c in [decide(view, tel(99, view.lease_expires_at - 1.0, tpot_frac=0.8), CFG)] for c in c.commands
    )
    assert (renew.kind, renew.epoch, renew.lease_id) == ("renew", 1, "n/0#1")


def test_memory_pressure_revokes():
    view = run(steady(3))[-1].view
    lent = view.lease_mem_bytes / GiB
    d = decide(view, tel(3, 101.5, serving_gib=80 - lent - 7.0), CFG)  # free 7 GiB < 8 GiB margin
    assert d.commands[0].kind == "revoke" and "free memory" in d.commands[0].reason


def test_a_single_spike_does_not_revoke_but_a_sustained_climb_does_before_the_slo():
    view = run(steady(4))[-1].view  # lease granted on the 3rd event, held on the 4th
    # one window's p99 jumps 0.2 -> 0.65 of SLO (a prefill-chunk stall): no threshold crossed and
    # only one interval rose, so nothing is extrapolated (a two-point predictor said -0.1)
    d = decide(view, tel(4, 102.0, tpot_frac=0.65), CFG)
    assert d.explain.headroom["tpot_p99"] == pytest.approx(0.35)
    assert d.explain.predicted_headroom["tpot_p99"] == pytest.approx(0.35)
    assert d.commands == () and d.explain.action == "hold"
    # a climb: 0.2 -> 0.48 -> 0.76, rising on both intervals at 0.56 SLO/s; headroom is still 0.24,
    # but at that rate p99 is 1.04 x SLO in 0.5 s: revoke now, before the SLO is crossed
    view = run(steady(4))[-1].view
    d1 = decide(view, tel(4, 102.0, tpot_frac=0.48), CFG)
    assert d1.commands == ()
    d2 = decide(d1.view, tel(5, 102.5, tpot_frac=0.76), CFG)
    assert d2.explain.headroom["tpot_p99"] == pytest.approx(0.24)
    assert d2.explain.predicted_headroom["tpot_p99"] == pytest.approx(-0.04)
    assert d2.commands[0].kind == "throttle" and d2.commands[0].compute_share == 0.0
    assert d2.commands[0].reason.startswith("pause: trend: tpot_p99 rising")


def test_trend_takes_the_smaller_rate_of_the_two_intervals():
    view = run(steady(4))[-1].view
    d1 = decide(view, tel(4, 102.0, ttft_frac=0.7), CFG)  # a jump ...
    d2 = decide(d1.view, tel(5, 102.5, ttft_frac=0.75), CFG)  # ... then a small rise: 0.05 per 0.5 s
    assert d2.explain.predicted_headroom["ttft_p99"] == pytest.approx(0.2)
    assert d2.commands == ()


def test_view_from_an_older_dict_without_the_trend_history_loads():
    view = run(steady(4))[-1].view
    old = {k: v for k, v in view.to_dict().items() if not k.startswith("prev2_")}
    loaded = GpuView.from_dict(orjson.loads(orjson.dumps(old)))
    assert loaded.prev2_ts == -1.0 and loaded.lease_id == view.lease_id
    assert GpuView.from_dict(orjson.loads(orjson.dumps(view.to_dict()))) == view
    # no history: the next rising event predicts nothing; one more and the trend is back
    d1 = decide(loaded, tel(4, 102.0, tpot_frac=0.48), CFG)
    assert d1.explain.predicted_headroom["tpot_p99"] == pytest.approx(0.52) and d1.commands == ()
    d2 = decide(d1.view, tel(5, 102.5, tpot_frac=0.76), CFG)
    assert d2.commands[0].kind == "throttle"


def test_kv_cache_growth_revokes():
    view = run(steady(3))[-1].view
    d = decide(view, tel(3, 101.5, serving_gib=34.5), CFG)  # +4.5 GiB in 0.5 s >= 0.5 x 8 GiB margin
    assert d.commands[0].kind == "revoke" and "KV growth" in d.commands[0].reason


def test_expired_lease_is_never_renewed_or_revoked():
    view = run(steady(3))[-1].view  # expires at 106.0
    d = decide(view, tel(3, 106.0, tpot_frac=0.95), CFG)  # would revoke, but it lapsed
    assert d.commands == () and d.view.lease_id is None
    assert "expired at 106.000 without renewal" in d.explain.reason


def test_stale_and_duplicate_events_are_ignored_with_a_counter():
    ds = run(steady(2))
    v = ds[-1].view
    d = decide(v, tel(9, 100.2), CFG)
    assert (d.explain.action, d.commands, d.view.ignored_stale) == ("ignored", (), 1)
    d = decide(d.view, tel(1, 200.0), CFG)  # same event_id as the last one
    assert d.explain.action == "ignored" and d.view.ignored_stale == 2
    assert dataclasses.replace(d.view, ignored_stale=0) == v


def test_observe_lease_state_ends_the_lease_and_keeps_the_epoch_floor():
    view = run(steady(3))[-1].view
    ended = observe_lease_state(
        view, lease_state_example(gpu="n/0", lease_id="n/0#1", epoch=1, state="expired", ts=102.0), CFG
    )
    assert ended.lease_id is None and ended.epoch == 1
    fresh = observe_lease_state(None, lease_state_example(gpu="n/9", lease_id="n/9#7", epoch=7, state="active"), CFG)
    assert fresh.lease_id is None and fresh.epoch == 7
    assert POLICY_VERSION


def test_the_share_follows_the_interference_this_gpu_shows():
    """The online estimate: a GPU whose serving p99 rises a lot when the lease's worker starts
    gets a smaller share when it resumes than one whose p99 does not move; both stay within the
    cap. Only the start counts (the first event showing rollout memory against the one before):
    serving's own load rising later in the lease is not read as interference."""
    from rose.policy.compute_share import compute_share_for

    cfg = dataclasses.replace(CFG, max_compute_share=1.0)  # so the estimate, not the cap, sizes it

    def resumed_share(started_tpot_frac: float, later_tpot_frac: float) -> tuple[float, float]:
        view = run(steady(3, tpot_frac=0.6), cfg)[-1].view  # granted at load 0.6
        view = decide(view, tel(3, 101.5, tpot_frac=started_tpot_frac, rollout_gib=4), cfg).view  # the worker starts
        for i in range(4, 23):  # the rest of the lease: serving's own load moves
            view = decide(view, tel(i, 100 + 0.5 * i, tpot_frac=later_tpot_frac, rollout_gib=4), cfg).view
        view = decide(view, tel(23, 111.5, tpot_frac=0.95, rollout_gib=4), cfg).view  # a burst pauses it
        assert view.lease_compute_share == 0.0
        for i in range(24, 27):
            d = decide(view, tel(i, 100 + 0.5 * i, tpot_frac=0.6, rollout_gib=4), cfg)
            view = d.view
        (c,) = d.commands
        assert c.kind == "throttle" and 0.0 < c.compute_share <= cfg.max_compute_share
        return c.compute_share, view.slowdown_per_share

    quiet, a_quiet = resumed_share(0.6, 0.6)
    noisy, a_noisy = resumed_share(0.78, 0.78)
    assert a_noisy > a_quiet and noisy < quiet
    assert resumed_share(0.6, 0.85) == (quiet, a_quiet)  # a later load swing leaves the estimate alone
    # the sizing rule: headroom lands mid-hysteresis under the estimated slowdown
    target = (CFG.grant_headroom + CFG.revoke_headroom) / 2
    for load, a in ((0.6, 4.0), (0.6, 0.3), (0.75, 0.3)):
        share = compute_share_for(load, a, CFG)
        slowdown = 1 + a * share
        if share < CFG.max_compute_share:
            assert load * slowdown == pytest.approx(1 - target, rel=1e-3)
        else:
            assert load * slowdown <= 1 - target
    assert compute_share_for(0.85, 4.0, CFG) == 0.0  # no room left: no share
