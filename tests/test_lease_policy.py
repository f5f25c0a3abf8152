"""The lease policy against docs/contract.md §4: property tests over generated per-GPU telemetry
sequences (every invariant checked on every event). The readable examples are in
tests/test_lease_policy_examples.py."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rose.config import GiB
from rose.contract.events import Latency, Telemetry
from rose.policy.core import observe_lease_state
from rose.policy.deferral import DEFERRED_KEPT, deferrable
from rose.policy.lease_policy import GpuView, decide
from tests.examples import lease_state_example
from tests.policy_examples import CFG, SLO, command_bytes, run, steady, tel

# --- generated sequences -------------------------------------------------------------------

# Latency and serving memory follow random walks in percent of the SLO / of total memory, so
# sequences hold leases for a while, cross the grant (70 %) and revoke (90 %) lines in small
# steps, and sometimes jump (a burst) or lapse (a telemetry gap of 6 s).
LAT_STEPS = [-10, -5, -1, 0, 0, 0, 0, 0, 1, 2, 5, 10, 30]
MEM_STEPS = [-5, -1, 0, 0, 0, 0, 0, 0, 1, 2, 8]
DTS = [0.5] * 12 + [0.25, 1.0, 3.0, 6.0, 0.0, -0.7]  # 0 and negative: stale


STEP = st.tuples(
    st.sampled_from(DTS),
    st.sampled_from(LAT_STEPS),
    st.sampled_from(LAT_STEPS),
    st.sampled_from(MEM_STEPS),
    st.sampled_from([None] * 20 + [0.0, 0.1, 0.3, 1.0]),
    st.sampled_from([0.0, 0.3, 0.9, 1.0]),
    st.integers(0, 30),
)


@st.composite
def sequences(draw):
    total = draw(st.sampled_from([16, 24, 40, 80, 141]))  # heterogeneous fleet
    ttft, tpot = draw(st.integers(2, 75)), draw(st.integers(2, 75))
    serving = draw(st.integers(5, 95))
    rollout_frac = 0.0
    ts, events = 1_000.0, []
    for i, (dt, d_ttft, d_tpot, d_mem, new_rollout, util, dup) in enumerate(
        draw(st.lists(STEP, min_size=30, max_size=100))
    ):
        ts = max(0.0, ts + dt)
        ttft = min(140, max(1, ttft + d_ttft))
        tpot = min(140, max(1, tpot + d_tpot))
        serving = min(100, max(1, serving + d_mem))
        rollout_frac = rollout_frac if new_rollout is None else new_rollout
        serving_gib = total * serving / 100
        eid = events[-1].event_id if events and dup == 0 else None
        events.append(
            tel(
                i,
                ts,
                ttft / 100,
                tpot / 100,
                total,
                serving_gib,
                (total - serving_gib) * rollout_frac,
                util,
                event_id=eid,
            )
        )
    return events


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequences())
def test_invariants_hold_on_every_event(events):  # noqa: C901 - one check per invariant of the contract, over one event stream
    cfg = CFG
    decisions = run(events)
    last_ts, last_id = -1.0, None
    streak = 0
    lease = None  # the live lease as the commands describe it: dict(id, epoch, mem, expires_at)
    last_grant_epoch = 0
    revoked_at = None
    for e, d in zip(events, decisions):
        cmds = d.commands
        assert len(cmds) <= 1
        for c in cmds:
            assert c.ts == e.ts and c.cause_event_id == e.event_id and c.gpu == e.gpu
        stale = e.ts <= last_ts or e.event_id == last_id
        if stale:
            assert d.explain.action == "ignored" and cmds == ()
            assert d.view.ignored_stale == decisions[decisions.index(d) - 1].view.ignored_stale + 1
            continue
        last_ts, last_id = e.ts, e.event_id
        h = [1 - e.latency_ms.ttft_p99 / e.slo_ms.ttft_p99, 1 - e.latency_ms.tpot_p99 / e.slo_ms.tpot_p99]
        streak = streak + 1 if min(h) >= cfg.grant_headroom else 0
        total, rollout = e.mem_total_bytes, e.rollout_mem_bytes
        serving = e.mem_used_bytes - rollout
        margin = int(total * cfg.mem_margin_frac)
        if lease is not None and e.ts >= lease["expires_at"]:
            lease = None  # lapsed: the executor revoked itself
        kinds = [c.kind for c in cmds]

        if lease is not None:
            free = total - serving - max(lease["mem"], rollout)
            slow = min(h) < cfg.revoke_headroom
            paused_long = lease["paused_since"] is not None and e.ts - lease["paused_since"] >= cfg.max_pause_s
            if free < margin or paused_long:  # memory, or a pause that lasted: revoke
                assert kinds == ["revoke"], (h, free, margin, d.explain)
            elif slow and lease["share"] > 0:  # latency: pause on that very event, same lease
                kv_revoke = kinds == ["revoke"] and "KV growth" in cmds[0].reason  # memory outranks it
                assert kv_revoke or (kinds == ["throttle"] and cmds[0].compute_share == 0.0), (h, d.explain)
            if kinds == ["revoke"]:  # only for memory, or after max_pause_s paused
                assert free < margin or paused_long or "KV growth" in cmds[0].reason, d.explain
            assert "grant" not in kinds  # one lease at a time
            for c in cmds:  # renew, throttle and revoke carry their lease
                assert (c.lease_id, c.epoch) == (lease["id"], lease["epoch"])
            if not cmds and lease["expires_at"] - e.ts < cfg.renew_before_s:
                pytest.fail(f"lease {lease['id']} due for renewal got neither renew nor revoke")
            if kinds in (["renew"], ["throttle"]):
                c = cmds[0]
                assert c.expires_at == e.ts + cfg.ttl_s and c.mem_bytes == lease["mem"]
                assert d.view.cooldown_until == decisions[decisions.index(d) - 1].view.cooldown_until
                if kinds == ["renew"]:
                    assert c.compute_share == lease["share"]
                elif c.compute_share > 0:  # a resume: only after the grant streak, never while slow
                    assert lease["share"] == 0.0 and streak >= cfg.grant_streak and not slow
                    assert c.compute_share <= cfg.max_compute_share
                lease.update(
                    expires_at=c.expires_at,
                    share=c.compute_share,
                    paused_since=lease["paused_since"]
                    if c.compute_share == lease["share"]
                    else (e.ts if c.compute_share == 0.0 else None),
                )
            elif kinds == ["revoke"]:
                assert d.explain.action == "revoke"
                lease, revoked_at = None, e.ts
        else:
            assert kinds in ([], ["grant"]), "renew/revoke without a live lease (e.g. after expiry)"
            if kinds == ["grant"]:
                g = cmds[0]
                assert streak >= cfg.grant_streak
                assert min(h) >= cfg.grant_headroom
                assert total - e.mem_used_bytes - margin >= cfg.min_lease_bytes
                assert cfg.min_lease_bytes <= g.mem_bytes <= total - serving - margin
                assert 0.0 <= g.compute_share <= cfg.max_compute_share
                assert g.epoch > last_grant_epoch
                assert g.expires_at == e.ts + cfg.ttl_s
                if revoked_at is not None:
                    assert e.ts >= revoked_at + cfg.cooldown_s
                last_grant_epoch = g.epoch
                assert g.compute_share > 0.0
                lease = dict(
                    id=g.lease_id,
                    epoch=g.epoch,
                    mem=g.mem_bytes,
                    expires_at=g.expires_at,
                    share=g.compute_share,
                    paused_since=None,
                )
        assert d.view.epoch == last_grant_epoch


PCT = st.one_of(st.integers(0, 140), st.integers(88, 92))  # latency in % of SLO, dense at the revoke line


@settings(max_examples=300, deadline=None)
@given(
    total_gib=st.sampled_from([16, 24, 80, 141]),
    serving_pct=st.integers(5, 60),
    rollout_pct=st.integers(0, 100),
    ttft_pct=PCT,
    tpot_pct=PCT,
    delta=st.integers(-(1 << 31), 1 << 31),
    trend=st.booleans(),
)
def test_pause_or_revoke_on_the_very_event_that_shows_trouble(
    total_gib, serving_pct, rollout_pct, ttft_pct, tpot_pct, delta, trend
):
    """Boundaries exactly: a lease is held, then one arbitrary event; free memory < margin must
    revoke on that event, and otherwise headroom < 0.10 on any metric must pause it (throttle to
    share 0, same lease and epoch, no cooldown). Without `trend`, the trend and KV-growth
    predictors are off (horizon 0) so the thresholds are tested alone."""
    cfg = CFG if trend else dataclasses.replace(CFG, trend_horizon_s=0.0)
    serving = total_gib * serving_pct / 100
    ds = run(steady(3, total_gib=total_gib, serving_gib=serving), cfg)
    assume(ds[-1].commands)
    lease_mem = ds[-1].commands[0].mem_bytes
    total = int(total_gib * GiB)
    margin = int(total * cfg.mem_margin_frac)
    rollout_b = lease_mem * rollout_pct // 100
    serving_b = min(max(0, total - lease_mem - margin + delta), total - rollout_b)  # free = margin - delta
    e = tel(3, 101.5, ttft_pct / 100, tpot_pct / 100, total_gib, serving_b / GiB, rollout_b / GiB)
    d = decide(ds[-1].view, e, cfg)
    h = min(1 - e.latency_ms.ttft_p99 / SLO.ttft_p99, 1 - e.latency_ms.tpot_p99 / SLO.tpot_p99)
    free = total - (e.mem_used_bytes - e.rollout_mem_bytes) - max(lease_mem, e.rollout_mem_bytes)
    if free < margin:
        assert [c.kind for c in d.commands] == ["revoke"]
    elif h < cfg.revoke_headroom:
        (c,) = d.commands
        if trend and c.kind == "revoke":  # memory outranks latency: KV growth heading to the margin
            assert "KV growth" in c.reason
        else:
            assert (c.kind, c.compute_share, c.lease_id, c.epoch) == (
                "throttle",
                0.0,
                ds[-1].view.lease_id,
                ds[-1].view.epoch,
            )
            assert d.view.cooldown_until == ds[-1].view.cooldown_until and d.view.paused_since == e.ts
    elif not trend:
        assert d.commands == () and d.explain.action == "hold"  # hysteresis: nothing to do


@settings(max_examples=40, deadline=None)
@given(sequences())
def test_deterministic_and_view_survives_json(events):
    a = command_bytes(run(events))
    assert a == command_bytes(run(events))
    assert a == command_bytes(run(events, roundtrip=True))


@settings(max_examples=60, deadline=None)
@given(
    sequences(),
    st.lists(
        st.tuples(
            st.integers(0, 119),
            st.integers(0, 6),
            st.sampled_from(["active", "revoking", "revoked", "expired", "rejected"]),
        ),
        max_size=10,
    ),
)
def test_lease_states_never_resurrect_and_raise_the_epoch_floor(events, states):
    """Folding executor lease states between events: epochs still strictly increase and
    no lease the view does not hold ever appears (no renew/revoke without a grant)."""
    by_index: dict[int, list] = {}
    for i, ep, st_ in states:
        by_index.setdefault(i, []).append((ep, st_))
    view, last_epoch, live = None, 0, None
    for i, e in enumerate(events):
        for ep, st_ in by_index.get(i, []):
            before = view
            ls = lease_state_example(gpu=e.gpu, lease_id=f"{e.gpu}#{ep}", epoch=ep, state=st_, ts=e.ts)
            view = observe_lease_state(view, ls, CFG)
            assert view.epoch == max(before.epoch if before else 0, ep)
            if before is None or before.lease_id is None:
                assert view.lease_id is None
            elif view.lease_id is not None:
                assert view.lease_id == before.lease_id
            if st_ != "active" and before is not None and before.lease_id == ls.lease_id:
                assert view.lease_id is None
            live = view.lease_id
        d = decide(view, e, CFG)
        for c in d.commands:
            if c.kind == "grant":
                assert c.epoch > max(last_epoch, view.epoch if view else 0)
                last_epoch = c.epoch
            else:
                assert live is not None and c.lease_id == live
        view = d.view
        live = view.lease_id


@settings(max_examples=150, deadline=None)
@given(
    low=st.integers(1, 70),
    high=st.integers(1, 89),
    metric=st.sampled_from(["ttft", "tpot"]),
    pattern=st.lists(st.booleans(), min_size=10, max_size=40),
)
def test_two_level_noise_below_the_revoke_line_never_revokes(low, high, metric, pattern):
    """A GPU's window p99 flipping between two levels (decode step / prefill-chunk stall), both
    with headroom ≥ 0.10, at any pattern: never three rising samples, so never a revoke, and the
    lease is renewed throughout."""
    view = run(steady(3, **{f"{metric}_frac": low / 100}))[-1].view  # granted at the low level
    for i, hi in enumerate(pattern):
        kw = {f"{metric}_frac": (high if hi else low) / 100}
        d = decide(view, tel(3 + i, 101.5 + 0.5 * i, **kw), CFG)
        assert d.explain.action in ("hold", "renew"), d.explain
        view = d.view
    assert view.lease_id == "n/0#1"


@settings(max_examples=150, deadline=None)
@given(base=st.integers(5, 70), step=st.integers(1, 40), metric=st.sampled_from(["ttft", "tpot"]))
def test_a_sustained_climb_pauses_before_the_slo_is_crossed(base, step, metric):
    """p99 climbs from a granted GPU's level by a constant step per event. If it takes at least
    three events to cross the SLO (two rising intervals are visible before), the pause comes on
    an event before the crossing, and never before the climb shows on two intervals or the
    headroom rule fires."""
    view = run(steady(4, **{f"{metric}_frac": base / 100}))[-1].view
    assert view.lease_id is not None
    fracs = [(base + step * k) / 100 for k in range(1, 200)]
    cross = next(k for k, f in enumerate(fracs) if f > 1.0)
    assume(cross >= 2)  # the third climbing sample or later crosses
    revoked_at = None
    for k, f in enumerate(fracs):
        d = decide(view, tel(4 + k, 102.0 + 0.5 * k, **{f"{metric}_frac": f}), CFG)
        view = d.view
        if d.explain.action == "throttle":
            assert d.commands[0].compute_share == 0.0
            revoked_at = k
            break
        assert view.lease_id is not None  # held (and renewed) until then
    assert revoked_at is not None and revoked_at < cross
    assert revoked_at >= 1 or 1 - fracs[revoked_at] < CFG.revoke_headroom


@settings(max_examples=80, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.floats(0.31, 3.0), st.floats(0.0, 3.0), st.integers(20, 70), st.floats(0.0, 1.0)),
        min_size=1,
        max_size=8,
    ),
    cooldown=st.floats(0.0, 50.0),
    revokes=st.integers(0, 4),
    epoch=st.integers(0, 5),
    prev=st.one_of(st.none(), st.tuples(st.floats(1.0, 900.0), st.floats(1.0, 90.0), st.integers(20, 70))),
    expired_lease=st.booleans(),
    folded_state=st.one_of(
        st.none(),
        st.tuples(
            st.integers(0, 8),
            st.sampled_from(["active", "revoking", "revoked", "expired", "rejected"]),
            st.integers(0, 7),
        ),
    ),
)
def test_deferred_calls_are_exact(events, cooldown, revokes, epoch, prev, expired_lease, folded_state):
    """rose.policy.deferral: for a GPU without a lease, a run of deferrable events leaves `decide`
    exactly where its last DEFERRED_KEPT events alone leave it, also when a lease state was folded
    in somewhere in the run (the holder folds it at once and hands the held-back events later)."""
    view = GpuView("sim/0", epoch=epoch, cooldown_until=cooldown, revokes_in_row=revokes)
    if prev is not None:
        view = GpuView(
            "sim/0",
            last_ts=1.0,
            last_event_id="x",
            streak=2,
            epoch=epoch,
            cooldown_until=cooldown,
            revokes_in_row=revokes,
            prev_ttft_p99=prev[0],
            prev_tpot_p99=prev[1],
            prev_serving_mem=prev[2] << 30,
            **(
                {"lease_id": f"sim/0#{epoch}", "lease_expires_at": 1.5, "lease_mem_bytes": 4 << 30}
                if expired_lease
                else {}
            ),
        )
    evs = []
    for i, (ratio, other, used_gib, util) in enumerate(events):  # ratio > 0.3: below grant headroom
        ttft = 1000.0 * min(ratio, 0.99) if i % 2 else 1000.0 * other / 3
        tpot = 100.0 * other / 3 if i % 2 else 100.0 * min(ratio, 0.99)
        if 1.0 - max(ttft / 1000.0, tpot / 100.0) >= CFG.grant_headroom:
            tpot = 100.0 * 0.8
        evs.append(
            Telemetry(
                f"e{i}",
                2.0 + 0.5 * i,
                "n",
                "sim/0",
                "serving",
                util,
                80 << 30,
                used_gib << 30,
                0,
                Latency(ttft, tpot),
                SLO,
                1.0,
                0,
            )
        )
    ls = None
    if folded_state is not None and view.lease_id is None:  # the holder defers only while no lease is held
        ep, state, at = folded_state
        ls = lease_state_example(gpu="sim/0", lease_id=f"sim/0#{ep}", epoch=ep, state=state, ts=2.0 + 0.5 * at)
        at = min(at, len(evs))
    folded = view
    for i, e in enumerate(evs):
        if ls is not None and i == at:
            folded = observe_lease_state(folded, ls, CFG)
        if folded.lease_id is None:
            h = min(1.0 - e.latency_ms.ttft_p99 / SLO.ttft_p99, 1.0 - e.latency_ms.tpot_p99 / SLO.tpot_p99)
            assert deferrable(False, h, CFG)
        d = decide(folded, e, CFG)
        assert d.commands == ()
        folded = d.view
    if ls is not None and at == len(evs):
        folded = observe_lease_state(folded, ls, CFG)
    held = view if ls is None else observe_lease_state(view, ls, CFG)
    for e in evs[-DEFERRED_KEPT:]:
        held = decide(held, e, CFG).view
    assert held == folded
    assert not deferrable(True, -1.0, CFG) and not deferrable(False, CFG.grant_headroom, CFG)


def _granted_mem(servings: list[tuple[float, float]]) -> list[int]:
    """The mem_bytes of each grant over calm events of (ts, serving GiB) on an 80 GiB GPU."""
    view, mems = GpuView("n/0"), []
    for i, (ts, serving) in enumerate(servings):
        d = decide(view, tel(i, ts, serving_gib=serving), CFG)
        view = d.view
        assert view.serving_mem_high >= view.prev_serving_mem
        mems += [c.mem_bytes for c in d.commands if c.kind == "grant"]
    return mems


@given(
    peak=st.integers(20, 60),
    after=st.integers(5, 19),
    gap=st.sampled_from([1.0, 30.0, 119.0, 121.0, 400.0]),
)
def test_a_grant_leaves_serving_room_to_its_recent_memory_peak(peak, after, gap):
    """Calm events whose serving memory reached `peak` GiB, then fell to `after`: a grant within
    `kv_peak_hold_s` of the peak is the one a GPU serving at its peak would get (serving keeps
    room to grow back to it), one after the hold the one a GPU that never peaked would get."""
    times = [0.0, 0.5] + [0.5 + gap + 0.5 * i for i in range(CFG.grant_streak + 1)]
    peaked = _granted_mem([(t, peak if i < 2 else after) for i, t in enumerate(times)])
    flat = _granted_mem([(t, peak if gap < CFG.kv_peak_hold_s else after) for t in times])
    assert len(peaked) == 1 and peaked == flat  # the peak's two events granted nothing: no streak yet
