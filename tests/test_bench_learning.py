"""`rose bench learning`: the thirds its verdict compares and the verdict itself, on rewards with a
known answer. The run (vLLM and a training step per step) is not run here."""

from __future__ import annotations

from rose.bench import learning


def test_thirds_are_the_first_and_last_n_over_3_steps():
    assert learning.thirds(9) == (range(0, 3), range(6, 9))
    assert learning.thirds(10) == (range(0, 3), range(7, 10))  # the middle keeps the rest
    assert learning.thirds(2) == (range(0, 0), range(2, 2))


def test_separated_only_when_the_last_interval_lies_wholly_above_the_first():
    assert learning.separated([0.1, 0.3], [0.31, 0.5])
    assert not learning.separated([0.1, 0.3], [0.3, 0.5])  # touching is overlapping
    assert not learning.separated([0.4, 0.6], [0.1, 0.3])  # a fall is not learning
    assert not learning.separated(None, [0.1, 0.3])


def test_summary_compares_the_thirds_over_their_groups():
    low, high = [0.0, 0.125], [0.875, 1.0]
    out = learning.summary([low, low, low, [0.5, 0.5], high, high, high])
    assert out["first_third"]["steps"] == [0, 2] and out["last_third"]["steps"] == [5, 7]
    assert out["first_third"]["groups"] == 4 and out["first_third"]["mean_reward"] == 0.0625
    assert out["last_third"]["mean_reward"] == 0.9375
    assert out["separated"] and not out["start_in_band"]  # 0.0625 starts below the band
    assert out["reward_by_step"][3] == {"step": 3, "mean": 0.5, "n": 2 * learning.GROUP}


def test_a_flat_run_is_not_separated():
    out = learning.summary([[0.25, 0.5], [0.5, 0.25]] * 3)
    assert not out["separated"] and out["start_in_band"]
