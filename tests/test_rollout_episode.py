"""Episodes and tasks as pure data: validation, continuations, determinism."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rose.rollout.episode import DONE, GENERATE, TOOL, Episode, InvalidTask, Task, ToolLatency, tool_step

byte_lists = st.lists(st.integers(0, 255), min_size=1, max_size=50)


@given(
    prompt=byte_lists,
    turns=st.integers(1, 6),
    tpt=st.integers(1, 8),
    obs=st.integers(0, 12),
    seed=st.integers(0, 2**40),
    stop_after=st.integers(0, 60),
)
def test_continuation_round_trips_and_keeps_turns(prompt, turns, tpt, obs, seed, stop_after):
    t = Task(
        "t", prompt, max_turns=turns, tokens_per_turn=tpt, obs_tokens=obs, seed=seed, tool=ToolLatency(mu=-5, sigma=0.5)
    )
    ep = Episode(t, "w", "g", False, now=0.0)
    now = 0.0
    for i in range(stop_after):
        if ep.state == DONE:
            break
        if ep.state == TOOL:
            now = ep.tool_until
            assert ep.tool_ready(now)
            ep.finish_tool()
            continue
        ep.on_token(i % 256, version=3, now=now)
    cont = Task.from_dict(ep.continuation().to_dict())
    assert [x.action for x in cont.turns] == [x.action for x in ep.turns]
    assert all(len(x.action) == tpt and x.versions == [3] * tpt for x in cont.turns)
    assert cont.moves == 1
    resumed = Episode(cont, "w2", "g2", True, now=now)
    # no lost tokens: the action in progress travels with its per-token versions
    assert resumed.context() == ep.context()
    if ep.state == GENERATE:
        assert resumed.action == ep.action and resumed.action_versions == [3] * len(ep.action)
        assert resumed.resumed_tokens == len(ep.action)
        assert resumed.to_feed() == ep.context()  # re-prefill, then sample on
    if ep.state == TOOL:  # preempted during its tool call: the next worker runs it again
        assert resumed.state == TOOL
    elif ep.state == GENERATE:
        assert resumed.state == GENERATE


def test_tool_step_is_deterministic_and_sized():
    t = Task("t", [1], obs_tokens=20, seed=4, tool=ToolLatency(mu=-3, sigma=1.0, max_s=0.2))
    a, b = tool_step(t, 1), tool_step(t, 1)
    assert a == b and len(a[1]) == 20 and 0 < a[0] <= 0.2
    assert tool_step(t, 2) != a


def test_episode_runs_turns_then_finishes():
    t = Task("t", [65, 66], max_turns=2, tokens_per_turn=3, obs_tokens=4, tool=ToolLatency(mu=-4, sigma=0))
    ep = Episode(t, "w", "g", True, now=10.0)
    assert ep.to_feed() == [65, 66] and ep.sampler_seed() is not None and ep.sampler_seed() is None
    for tok in (1, 2, 3):
        ep.on_token(tok, version=7, now=10.0)
    assert ep.state == TOOL and not ep.tool_ready(10.0) and ep.tool_ready(ep.tool_until)
    ep.finish_tool()
    assert len(ep.to_feed()) == 4  # only the observation: the sampled tokens are in the engine
    for tok in (4, 5, 6):
        ep.on_token(tok, version=8, now=11.0)
    assert ep.state == DONE
    traj = ep.trajectory(now=1.0)
    assert traj["versions"] == [7, 8] and traj["dedicated"] is True
    assert traj["tokens"] == [65, 66, 1, 2, 3] + ep.turns[0].observation + [4, 5, 6]


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"prompt": [1]}, "task_id"),
        ({"task_id": "x"}, "prompt"),
        ({"task_id": "x", "prompt": []}, "prompt"),
        ({"task_id": "x", "prompt": [-3]}, "prompt"),
        ({"task_id": "x", "prompt": [1 << 31]}, "prompt"),
        ({"task_id": "x", "prompt": [True]}, "prompt"),
        ({"task_id": "x", "prompt": [1], "max_turns": 0}, "max_turns"),
        ({"task_id": "x", "prompt": [1], "tokens_per_turn": "9"}, "tokens_per_turn"),
        ({"task_id": "x", "prompt": [1], "tool": {"mu": "slow"}}, "tool"),
        ({"task_id": "x", "prompt": [1], "tool": {"sigma": -1}}, "tool"),
        ({"task_id": "x", "prompt": [1], "turns": [5]}, "turns[0]"),
        ({"task_id": "x", "prompt": [1], "turns": [{"action": [1]}]}, "turns[0].version"),
        ({"task_id": "x", "prompt": [1], "max_turns": 1, "turns": [{"action": [1], "version": 0}] * 2}, "turns"),
    ],
)
def test_invalid_tasks_name_the_field(bad, field):
    with pytest.raises(InvalidTask) as e:
        Task.from_dict(bad)
    assert e.value.field == field


def test_resumed_action_keeps_versions_per_token_in_the_trajectory():
    t = Task("t", [65], max_turns=1, tokens_per_turn=4, obs_tokens=0, tool=ToolLatency(mu=-5, sigma=0))
    ep = Episode(t, "w", "g", False, now=0.0)
    ep.on_token(1, version=5, now=0.0)
    ep.on_token(2, version=6, now=0.0)  # a new policy version arrived between decode steps
    seed_fresh = Episode(t, "x", "g", False, now=0.0).sampler_seed()
    resumed = Episode(Task.from_dict(ep.continuation().to_dict()), "w2", "g2", True, now=1.0)
    assert resumed.sampler_seed() != seed_fresh  # the resumed draw is not the turn's first draw again
    resumed.on_token(3, version=7, now=1.0)
    resumed.on_token(4, version=7, now=1.0)
    traj = resumed.trajectory(now=2.0)
    assert traj["turns"][0]["action"] == [1, 2, 3, 4]
    assert traj["token_versions"] == [[5, 6, 7, 7]] and traj["versions"] == [5]


def test_a_partial_action_must_fit_and_carry_one_version_per_token():
    base = {"task_id": "t", "prompt": [1], "tokens_per_turn": 4}
    with pytest.raises(InvalidTask, match="partial_versions"):
        Task.from_dict({**base, "partial": [1, 2], "partial_versions": [0]})
    with pytest.raises(InvalidTask, match="partial"):
        Task.from_dict({**base, "partial": [1, 2, 3, 4], "partial_versions": [0, 0, 0, 0]})
