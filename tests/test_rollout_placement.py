"""Elastic placement: the pure per-turn policy, and its effect measured on real workers."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rose.rollout.episode import Task, ToolLatency
from rose.rollout.placement import PlacementConfig, WorkerView, affinity_hit_rate, long_tail_on_dedicated, place

CFG = PlacementConfig(long_tail_tokens=100, straggler_frac=0.8, max_moves=2)
LEASED = WorkerView("L", dedicated=False, free_slots=4)
D1 = WorkerView("D1", dedicated=True, free_slots=2)
D2 = WorkerView("D2", dedicated=True, free_slots=5)


def test_short_turns_stay_on_the_leased_worker():
    assert not place(20, 0, LEASED, [D1, D2], 0.1, CFG).move


def test_long_tail_moves_to_the_dedicated_worker_with_most_room():
    d = place(150, 0, LEASED, [D1, D2], 0.1, CFG)
    assert d.move and d.to == "D2" and d.reason == "long-tail"


def test_stragglers_leave_revocable_workers_near_the_end_of_the_step():
    d = place(20, 0, LEASED, [D1], 0.85, CFG)
    assert d.move and d.to == "D1" and d.reason == "straggler"


def test_dedicated_workers_keep_their_work():
    assert not place(10_000, 0, D1, [D2], 0.99, CFG).move


def test_no_room_or_too_many_moves_means_stay():
    full = WorkerView("D3", True, 0)
    dead = WorkerView("D4", True, 8, alive=False)
    assert not place(500, 0, LEASED, [full, dead, LEASED], 0.9, CFG).move
    assert not place(500, 2, LEASED, [D2], 0.9, CFG).move


views = st.builds(
    WorkerView,
    worker_id=st.sampled_from(["a", "b", "c", "d"]),
    dedicated=st.booleans(),
    free_slots=st.integers(0, 4),
    alive=st.booleans(),
)


@given(
    here=views,
    others=st.lists(views, max_size=6),
    rem=st.integers(0, 1000),
    moves=st.integers(0, 3),
    frac=st.floats(0, 1),
)
def test_moves_only_to_a_live_dedicated_worker_with_room(here, others, rem, moves, frac):
    d = place(rem, moves, here, others, frac, CFG)
    if d.move:
        assert not here.dedicated and moves < CFG.max_moves and d.to != here.worker_id
        assert any(w.worker_id == d.to and w.dedicated and w.alive and w.free_slots > 0 for w in others)


def test_metrics():
    def turn(w, ded, n=10):
        return {"worker": w, "dedicated": ded, "action": [0] * n}

    trajs = [
        {"turns": [turn("a", False), turn("a", False), turn("b", True)]},
        {"turns": [turn("b", True, 50), turn("b", True, 50)]},
    ]
    assert affinity_hit_rate(trajs) == pytest.approx(2 / 3)
    assert long_tail_on_dedicated(trajs, min_tokens=100) == 1.0
    assert long_tail_on_dedicated(trajs, min_tokens=30) == pytest.approx(110 / 130)


@pytest.mark.stack
def test_long_tail_lands_on_dedicated_and_turns_keep_affinity(cfg, redis_client):
    """A dedicated and a leased worker share a mixed batch: long episodes (8 turns × 32
    tokens) and short ones (2 × 12). Placement should put the long tail's tokens on the
    dedicated worker and keep consecutive turns on one worker."""
    from rose.rollout.tasks import TaskQueue
    from tests.test_rollout_tasks import JOB, hb, spec, start, wait_for

    q = TaskQueue(redis_client, cfg.redis, JOB)
    q.ensure_group()
    d = start(spec(cfg, "ded", dedicated=True, max_batch=12, straggler_frac=0.95, long_tail_tokens=150))
    wait_for(lambda: hb(redis_client, cfg, "ded").get("state") == "running", what="dedicated worker up")
    leased = start(spec(cfg, "lease", max_batch=8, straggler_frac=0.95, long_tail_tokens=150))
    wait_for(lambda: hb(redis_client, cfg, "lease").get("state") == "running", what="leased worker up")
    n_long, n_short = 4, 12
    for i in range(n_long + n_short):
        long = i % 4 == 0
        q.submit(
            Task(
                task_id=f"e{i}",
                prompt=list(b"task %d" % i),
                max_turns=8 if long else 2,
                tokens_per_turn=32 if long else 12,
                obs_tokens=8,
                tool=ToolLatency(mu=math.log(0.03), sigma=0.3),
                seed=i,
            )
        )
    try:
        wait_for(lambda: q.progress(0)[1] == n_long + n_short, timeout=120, what="all episodes")
    finally:
        for p in (leased, d):
            p.terminate()
        for p in (leased, d):
            assert p.wait(30) == 0
    res = q.all_results()
    assert sorted(t["task_id"] for t in res) == sorted(f"e{i}" for i in range(n_long + n_short))
    on_ded = long_tail_on_dedicated(res, min_tokens=150)
    hit = affinity_hit_rate(res)
    short_on_leased = sum(t["worker"] == "lease" for t in res if len(t["turns"]) == 2)
    print(f"long_tail_on_dedicated={on_ded:.2f} affinity_hit_rate={hit:.2f} short_on_leased={short_on_leased}")
    assert on_ded >= 0.9, on_ded
    assert hit >= 0.9, hit
    assert short_on_leased > 0  # the leased worker did take short work
