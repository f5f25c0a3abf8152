"""`rose bench trl`: its reading of the example's step lines (the pattern itself is checked
against the example's real output in tests/test_example_trl.py); its and `rose bench decode`'s
bad arguments."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rose.bench.trl import STEP_LINE, _report


def line(step: int, reward: float, seconds: float = 10.0, rollout: float = 4.0) -> str:
    return (
        f"step {step}  reward {reward:.3f}  answers 8  versions [{step + 1}]  workers [w0, w1]"
        f"  {seconds:.2f}s (rollout {rollout:.2f}s)  published {step + 2}"
    )


def report(rewards: list[float]) -> dict:
    lines = [line(i, r, seconds=10 + i, rollout=4) for i, r in enumerate(rewards)]
    steps = [m for m in map(STEP_LINE.match, lines) if m]
    assert len(steps) == len(rewards)
    return _report(steps, 60.0, 1.0, "m", [*lines, "done: ..."])


def test_thirds_their_intervals_and_whether_they_overlap():
    r = report([0.1, 0.2, 0.1, 0.5, 0.5, 0.5, 0.9, 0.8, 0.9])
    assert r["optimizer_steps"] == 9 and r["reward_per_step"][0] == 0.1
    assert r["reward_first_third"]["n"] == 3 and r["reward_first_third"]["mean"] == pytest.approx(0.1333, abs=1e-4)
    assert r["reward_last_third"]["mean"] == pytest.approx(0.8667, abs=1e-4)
    assert r["reward_intervals_overlap"] is False
    assert r["reward_first_third"]["ci95"][0] < 0.1333 < r["reward_first_third"]["ci95"][1]
    assert r["versions_published"] == [1, 10] and r["done_line"] == "done: ..."
    assert r["seconds_per_step"]["mean"] == 14.0 and r["rollout_share_of_step"] == round(36 / 126, 4)
    flat = report([0.5, 0.4, 0.6, 0.5, 0.6, 0.4])
    assert flat["reward_intervals_overlap"] is True


def test_a_single_step_per_third_has_no_interval():
    r = report([0.25, 0.5, 0.875])
    assert r["reward_first_third"]["ci95"] is None and r["reward_intervals_overlap"] is None


@pytest.mark.parametrize(
    "args,says",
    [
        (["trl", "--engine", "vllm"], "--engine 'vllm'"),
        (["trl", "--model", "/nowhere"], "--model '/nowhere'"),
        (["trl", "--plot", "curve.svg"], "--plot 'curve.svg'"),
        (["revoke", "--plot", "curve.png"], "--plot: bench 'revoke'"),
        (["decode", "--engine", "hf"], "--engine 'hf'"),
        (["decode", "--model", "/nowhere"], "--model '/nowhere'"),
    ],
)
def test_bad_arguments_get_one_line_and_exit_2(args, says):
    p = subprocess.run(
        [sys.executable, "-m", "rose", "bench", *args, "--json"], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and says in p.stderr
