"""The demo's capacity measurement and trace scaling (`rose.demo.capacity`): the pure parts as
properties, the closed loop against a server whose latency grows with its concurrency."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rose.demo.capacity import Level, capacity_rps, measure, peak_rps, replay_plan, replayed, scaled_load

SLO = (1000.0, 100.0)

levels_st = st.lists(
    st.builds(
        Level,
        clients=st.integers(1, 16),
        requests=st.integers(0, 50),
        seconds=st.just(10.0),
        rps=st.floats(0, 20, allow_nan=False),
        ttft_p99_ms=st.one_of(st.none(), st.floats(1, 3000, allow_nan=False)),
        tpot_p99_ms=st.one_of(st.none(), st.floats(1, 300, allow_nan=False)),
    ),
    max_size=6,
)


@given(levels_st)
def test_capacity_is_the_highest_rate_of_a_level_within_the_slo(levels):
    cap = capacity_rps(levels, *SLO)
    meeting = [lv for lv in levels if lv.meets(*SLO)]
    assert cap == (max(lv.rps for lv in meeting) if meeting else 0.0)
    for lv in meeting:
        assert lv.ttft_p99_ms <= SLO[0] and lv.tpot_p99_ms <= SLO[1] and lv.requests > 0


@given(st.lists(st.floats(0, 3600, allow_nan=False), min_size=1, max_size=300), st.sampled_from([1.0, 5.0, 60.0]))
def test_the_peak_bin_is_a_count_over_the_bin_and_at_least_the_mean(arrivals, bin_s):
    a = np.array(sorted(arrivals))
    peak = peak_rps(a, bin_s)
    assert peak * bin_s == pytest.approx(round(peak * bin_s)) and peak * bin_s >= 1
    bins = int((a[-1] - a[0]) // bin_s) + 1
    assert peak >= len(a) / (bins * bin_s) - 1e-9


@given(st.floats(0.01, 100), st.floats(0.01, 100), st.floats(0.01, 1.0), st.floats(0.01, 100))
def test_the_replay_puts_the_peak_at_the_fraction_of_capacity(cap, peak, fraction, compress):
    speed, keep = replay_plan(cap, peak, fraction, compress)
    assert peak * speed * keep == pytest.approx(fraction * cap)
    assert 0 < keep <= 1 and speed >= compress * (1 - 1e-12)
    assert keep == 1.0 or speed == compress  # thinned only where the compressed trace is too heavy


@pytest.mark.parametrize("cap, peak, fraction", [(0.0, 1.0, 0.5), (1.0, 0.0, 0.5), (1.0, 1.0, 0.0), (1.0, 1.0, 1.5)])
def test_the_replay_refuses_what_cannot_be_scaled(cap, peak, fraction):
    with pytest.raises(ValueError, match="capacity"):
        replay_plan(cap, peak, fraction, 1.0)


def test_the_thinning_is_seeded_and_keeps_about_its_share():
    a, b = replayed(20_000, 0.1, 7), replayed(20_000, 0.1, 7)
    assert (a == b).all() and 1800 < a.sum() < 2200  # 2000 ± 4.7 standard deviations


def test_a_replica_that_misses_the_slo_alone_is_loaded_at_one_clients_rate_and_says_why():
    solo = Level(1, 3, 10.0, 0.3, 555.0, 109.0)
    load = scaled_load([solo], np.array([0.0, 1.0]), np.array([10]), np.array([5]), SLO, 0.5, 5.0)
    assert not load.slo_met_alone and load.capacity_rps == 0.3
    assert load.held_back(SLO) == "one client alone misses the SLO: TPOT p99 109 ms against 100 ms (×1.09)"
    with pytest.raises(ValueError, match="no request"):
        scaled_load([Level(1, 0, 10.0, 0.0, None, None)], np.array([0.0]), np.array([10]), np.array([5]), SLO, 0.5, 5.0)


def test_the_closed_loop_measures_each_level_and_stops_after_the_first_miss():
    """A server that serves one request at a time: each request takes 10 ms once it holds the
    server, so TTFT grows with the clients waiting (about 70 ms behind 7 others, against an SLO of
    60 ms) and the rate stays about 100 requests/s."""
    lock = threading.Lock()
    seen: list[tuple[int, int]] = []

    def serve_one(prompt: list[int], n: int) -> tuple[float, float]:
        t0 = time.monotonic()
        with lock:
            time.sleep(0.01)
        seen.append((len(prompt), n))
        return (time.monotonic() - t0) * 1000.0, 1.0

    shown: list[Level] = []
    levels = measure(serve_one, [8, 16], [2, 3], (1, 2, 8, 16), 0.6, (60.0, 100.0), progress=shown.append)
    assert shown == levels
    assert [lv.clients for lv in levels][:2] == [1, 2] and len(levels) <= 4
    assert levels[0].meets(60.0, 100.0) and not levels[-1].meets(60.0, 100.0)
    for lv in levels:
        assert 0 < lv.requests and lv.rps == pytest.approx(lv.requests / 0.6, abs=1e-3)
    assert {p for p, _ in seen} == {8, 16} and {n for _, n in seen} == {2, 3}
    load = scaled_load(levels, np.arange(0.0, 10.0, 0.5), np.array([8, 16]), np.array([2, 3]), (60.0, 100.0), 0.5, 5.0)
    assert load.capacity_rps == capacity_rps(levels, 60.0, 100.0) > 0 and load.slo_met_alone
    assert load.held_back((60.0, 100.0)) is None
    # a trace too light for the capacity is played faster, every request kept
    assert load.trace_peak_rps == 2.0 and load.keep == 1.0
    assert load.speed == pytest.approx(0.5 * load.capacity_rps / 2.0, rel=1e-4)
