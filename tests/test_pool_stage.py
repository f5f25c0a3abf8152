"""The pool stage (rose.policy.pool_stage): its records' codecs, and properties of the fold and
the decision over generated pools: capacity kept, the last serving replica never lent, the same
samples give byte-identical intents, and a takeover gives the intents of the uninterrupted run."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rose.contract.events import InvalidEvent
from rose.policy.pool import PoolConfig, decide_pool, replicas_needed
from rose.policy.pool_records import ACTIONS, LEND, PoolIntent, PoolSample, intent_id
from rose.policy.pool_stage import (
    PoolState,
    decide_sample,
    effective_view,
    run_stage,
)

T0 = 1_700_000_000.0
CFG = PoolConfig(replica_capacity_rps=10.0, window_s=20.0, bin_s=5.0)
text = st.text(min_size=0, max_size=12)
num = st.floats(min_value=0, max_value=1e6, allow_nan=False)
count = st.integers(min_value=0, max_value=2**40)

samples_st = st.builds(
    PoolSample, text, num, text, text, text, st.sampled_from(("serving", "draining", "lent", "reclaiming")),
    num, st.booleans(), count, count, text, count,
)  # fmt: skip
intents_st = st.builds(
    PoolIntent, text, num, text, text, text, st.sampled_from(ACTIONS), text, count, count, count, text, text
)


@given(samples_st)
def test_sample_bytes_round_trip(s):
    assert PoolSample.from_bytes(s.to_bytes()) == s


@given(intents_st)
def test_intent_bytes_round_trip(i):
    assert PoolIntent.from_bytes(i.to_bytes()) == i


@pytest.mark.parametrize(
    "raw, field",
    [(b"[1]", "$"), (b"not json", "$"), (b'{"event_id": 3}', "event_id")],
)
def test_bad_sample_names_its_field(raw, field):
    with pytest.raises(InvalidEvent) as e:
        PoolSample.from_bytes(raw)
    assert e.value.field == field


def test_bad_intent_action_is_refused():
    good = PoolIntent("i", T0, "p", "c", "r", LEND, "g", 1, 1, 1, "", "why")
    raw = good.to_bytes().replace(b'"lend"', b'"borrow"')
    with pytest.raises(InvalidEvent) as e:
        PoolIntent.from_bytes(raw)
    assert e.value.field == "action"


# ---------------------------------------------------------------- generated pools


@st.composite
def pool_logs(draw):
    """A pool's samples in log order: 1-4 replicas of 1-2 GPUs, each GPU a sample per tick of
    0.5 s, the replica's rps a drawn walk, its state following the intents the run writes is not
    modelled (a lent replica stays as drawn): the stage must hold its properties on any log."""
    nrep = draw(st.integers(1, 4))
    reps = [(f"r{k}", draw(st.integers(1, 2))) for k in range(nrep)]
    ticks = draw(st.integers(1, 40))
    out = []
    for t in range(ticks):
        for rid, ngpu in reps:
            rps = draw(st.floats(0, 25, allow_nan=False))
            state = draw(st.sampled_from(("serving", "serving", "serving", "draining", "lent", "reclaiming")))
            for g in range(ngpu):
                lease = (f"{rid}g{g}#3", 3) if state in ("draining", "lent") else ("", 0)
                out.append(
                    PoolSample(
                        f"{rid}g{g}-{t}", T0 + 0.5 * t, "p", f"{rid}g{g}", rid, state, rps, rps < 10.0,
                        80 << 30, 2, *lease,
                    )
                )  # fmt: skip
    return out


@given(pool_logs())
@settings(max_examples=150, deadline=None)
def test_keeps_what_the_forecast_needs_and_never_lends_the_last_serving_replica(log):
    state = PoolState()
    for s in log:
        state, intents = decide_sample(state, s, CFG)
        view = effective_view(state, CFG)
        assert view is not None
        d = decide_pool(view, CFG)
        serving = [r for r in view.replicas if r.serving_state == "serving"]
        up = [r for r in view.replicas if r.serving_state in ("serving", "reclaiming")]
        needed = replicas_needed(d.forecast_rps, CFG.replica_capacity_rps, CFG.headroom)
        assert len(up) >= min(needed, len(view.replicas))
        lent_now = {i.replica for i in intents if i.action == LEND}
        if lent_now:
            assert serving, "a lend left no replica serving"
        for i in intents:  # a gang's intents come together, one per GPU of its replica
            assert sum(1 for j in intents if j.intent_id == i.intent_id) == i.group_size
            assert i.intent_id == intent_id(i.cause_event_id, i.replica, i.action)


@given(pool_logs())
@settings(max_examples=100, deadline=None)
def test_same_samples_give_byte_identical_intents(log):
    a = run_stage(log, CFG)[1]
    b = run_stage([PoolSample.from_bytes(s.to_bytes()) for s in log], CFG)[1]
    assert [i.to_bytes() for i in a] == [i.to_bytes() for i in b]


@given(pool_logs(), st.data())
@settings(max_examples=150, deadline=None)
def test_takeover_gives_the_intents_of_the_uninterrupted_run(log, data):
    whole = run_stage(log, CFG)[1]
    k = data.draw(st.integers(0, len(log)))
    before = {s.event_id for s in log[:k]}
    written = [i for i in whole if i.cause_event_id in before]
    state, after = run_stage(log, CFG, decide_from=k, written=written)
    assert [i.to_bytes() for i in written + list(after)] == [i.to_bytes() for i in whole]
    assert state == run_stage(log, CFG)[0]


def test_a_trough_lends_once_and_a_rise_reclaims():
    """Three idle replicas: nothing is lent until their samples cover the window (20 s: four 5 s
    bins), then one sample lends the surplus, the next (no telemetry change yet) lends nothing
    more; once the lent replica reports lent and the load rises, it is reclaimed."""

    def tick(t, rps, states):
        return [
            PoolSample(f"{r}-{t}", T0 + t, "p", f"{r}g", r, states.get(r, "serving"), rps, True, 80 << 30, 1,
                       "" if states.get(r, "serving") == "serving" else f"{r}g#2", 2 if states.get(r) else 0)
            for r in ("r0", "r1", "r2")
        ]  # fmt: skip

    state, lent = PoolState(), []
    for s in tick(0, 1.0, {}) + tick(5, 1.0, {}) + tick(10, 1.0, {}):
        state, new = decide_sample(state, s, CFG)
        assert new == ()  # less than a window of history: no forecast to lend on
    for s in tick(15, 1.0, {}) + tick(16, 1.0, {}):
        state, new = decide_sample(state, s, CFG)
        lent.extend(new)
    assert sorted({i.replica for i in lent}) == ["r1", "r2"]  # one replica keeps serving 3 rps
    assert {i.action for i in lent} == {LEND} and len(lent) == 2
    reclaimed = []
    for s in tick(17, 9.0, {"r1": "lent", "r2": "lent"}):
        state, new = decide_sample(state, s, CFG)
        reclaimed.extend(new)
    assert reclaimed and {i.action for i in reclaimed} == {"reclaim"}
    assert {i.replica for i in reclaimed} <= {"r1", "r2"}
