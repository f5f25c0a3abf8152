"""The paper check's "held back by" column where the trainer, not rollout, sets the pace: a gain
row whose ROSE runs sit at the trainer's bound names the trainer's constants and the bound's
gain over static against the goal, not the harvest (docs/paper-check.md)."""

from __future__ import annotations

import numpy as np
import pytest

from rose.sim.ledger import Ledger
from rose.sim.models import EpisodeModel
from rose.sim.paper_plan import CheckConfig, Job
from rose.sim.paper_results import Results, at_trainer_bound, targets, trainer_bound
from rose.sim.sim_config import SimConfig
from tests.test_paper_check_profile import KEEP, MAIN, _run

DURATION_S = 3600.0
STEP_S = 100.0  # one step's training
EP = EpisodeModel()
STATIC = 8000.0  # static's episodes in the run
ROLLOUT = 16000  # ROSE's rollout completions


def _trained(seconds: float, dt: float = 1.0) -> float:
    """What the simulator's trainer consumes in `seconds` with far more completions than it takes."""
    led = Ledger(EP, train_step_s=STEP_S)
    w = np.zeros(1)
    led.progress(w, np.zeros(1), np.array([1e9]))
    for _ in range(int(seconds / dt)):
        led.train(dt)
    return led.trained


def _trainer_run(seed: int, rose_eps: float, buffered: float, train: dict) -> dict:
    """A crafted main run with the trainer's figures a `simulate` result carries."""
    r = _run(MAIN, seed, rose_eps, rose_eps, KEEP)
    r["policies"]["static"]["episodes"] = STATIC
    for p in ("rose", "share-all"):
        r["policies"][p].update(
            gain_vs_static=rose_eps / STATIC,
            rollout_episodes=ROLLOUT,
            work={"buffered": buffered},
        )
    r["config"].update(
        duration_s=DURATION_S,
        episode={"episodes_per_step": EP.episodes_per_step},
        costs={"train_step_s": STEP_S, "train_step_source": "6·N·tokens", **train},
    )
    return r


def _gain_row(buffered: float, train: dict | None = None) -> dict:
    cc = CheckConfig(traces=("t.csv",), models=("8B",), gpus=16, gm=8, seeds=3, alphas=(0.3,), gm_sweep=(8,))
    jobs = [Job("main", "t.csv", "8B", MAIN, s, SimConfig()) for s in range(3)]
    train = {"train_gpus": 2, "train_mfu": 0.4} if train is None else train
    runs = [_trainer_run(s, 8900.0 + 10 * s, buffered, train) for s in range(3)]
    res = Results(cc, jobs, runs)
    rows = [r for r in targets(res) if r["target"] == "ROSE ≥ 1.5× static"]
    assert len(rows) == 1 and not rows[0]["met"]
    return rows[0]


def test_the_bound_is_what_the_simulators_trainer_consumes_in_the_run_over_static():
    r = _trainer_run(0, 8900.0, 0.0, {"train_gpus": 2})
    assert trainer_bound(r) == pytest.approx(_trained(DURATION_S) / STATIC)
    r["config"]["costs"]["train_step_s"] = 0.0  # training free: no bound
    assert trainer_bound(r) is None
    del r["config"]["costs"]  # a record without the trainer's figures
    assert trainer_bound(r) is None


def test_a_gain_at_the_trainers_bound_names_the_trainer_and_the_bound_against_the_goal():
    bound = _trained(DURATION_S) / STATIC
    why = _gain_row(buffered=float(EP.episodes_per_step))["held_back_by"]
    assert why.startswith(
        "the trainer holds it back (its size and speed, SimConfig.train_gpus 2 and models.TRAIN_MFU 0.4): "
    ), why
    assert f"at most ×{bound:.3f} of static's episodes in the run against the goal ×1.5" in why
    assert f"(×{bound / 1.5:.2f} of it)" in why
    assert f"ROSE's rollout completed ×{ROLLOUT / STATIC:.3f} of static's" in why
    assert "not binding" in why and "missed at every measured profile" not in why


def test_a_set_training_time_is_the_constant_named():
    why = _gain_row(float(EP.episodes_per_step), {"train_gpus": 2, "train_step_source": "set (train_step_s)"})[
        "held_back_by"
    ]
    assert why.startswith(f"the trainer holds it back (SimConfig.train_step_s ({STEP_S:g} s a step)): "), why


def test_a_gain_below_the_trainers_bound_names_the_harvest():
    """Less than a step waiting for the trainer: rollout, not the trainer, set the pace."""
    row = _gain_row(buffered=EP.episodes_per_step - 1.0)
    assert row["held_back_by"].startswith("harvest 0.08"), row["held_back_by"]
    assert "train_gpus" not in row["held_back_by"]


def test_at_the_bound_reads_the_ledgers_buffered_episodes():
    r = _trainer_run(0, 8900.0, float(EP.episodes_per_step), {"train_gpus": 2})
    assert at_trainer_bound(r, "rose")
    r["policies"]["rose"]["work"]["buffered"] = EP.episodes_per_step - 0.5
    assert not at_trainer_bound(r, "rose")
    assert not at_trainer_bound({"policies": {"rose": {}}}, "rose")


def test_growth_with_both_cells_at_the_trainers_bound_names_the_trainer():
    models = ("8B", "70B")
    cc = CheckConfig(traces=("t.csv",), models=models, gpus=16, gm=8, seeds=3, alphas=(0.3,), gm_sweep=(8,))
    jobs = [Job("main", "t.csv", m, MAIN, s, SimConfig()) for m in models for s in range(3)]
    train = {"train_gpus": 2, "train_mfu": 0.4}
    runs = [_trainer_run(s, 8900.0 + 10 * s, float(EP.episodes_per_step), train) for _m in models for s in range(3)]
    rows = [r for r in targets(Results(cc, jobs, runs)) if r["target"] == "ROSE's gain grows with model size"]
    assert len(rows) == 1 and not rows[0]["met"]
    bound = _trained(DURATION_S) / STATIC
    why = rows[0]["held_back_by"]
    assert why.startswith("the trainer holds it back (its size and speed, SimConfig.train_gpus 2"), why
    assert f"at most ×{bound:.3f} of static's episodes at 8B, ×{bound:.3f} at 70B" in why
