"""Gang leases (docs/contract.md §2 `group_id`, `group_size`; docs/policy.md "Gang leases"): with
`policy.group_size` k > 1, a lease spans k GPUs of one node, granted all or none in one step,
paused and revoked together, resumed only when every member would resume. Property tests over
interleaved telemetry of one node's GPUs, through the scheduling core the scheduler, replay and
the simulator share; then readable examples."""

from __future__ import annotations

import dataclasses
from collections import Counter

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rose.config import PolicyConfig
from rose.contract.events import LeaseState
from rose.policy.core import Batch, SchedulingCore
from rose.policy.lease_policy import GpuView
from tests.policy_examples import core_decide, tel

K = 2
CFG = PolicyConfig(group_size=K)
GPUS = ("n/0", "n/1", "n/2")

# per event: which GPU, the time step, and latency / serving memory as % of SLO / total
EVENT = st.tuples(
    st.sampled_from(GPUS),
    st.sampled_from([0.2] * 8 + [0.5, 1.0, 6.0]),
    st.sampled_from([20] * 10 + [50, 75, 95]),
    st.sampled_from([30] * 12 + [60, 92]),
)


def events_of(steps):
    ts, out = 1_000.0, []
    for i, (gpu, dt, lat, mem) in enumerate(steps):
        ts += dt
        out.append(tel(i, ts, lat / 100, lat / 200, 80, 80 * mem / 100, gpu=gpu))
    return out


def run_core(events, cfg=CFG):
    core = SchedulingCore(cfg)
    return core, [core_decide(core, e) for e in events]


def live_groups(views) -> dict[str, list[GpuView]]:
    groups: dict[str, list[GpuView]] = {}
    for v in views.values():
        if v.lease_id is not None:
            assert v.group_id, f"{v.gpu} holds a lease outside a gang"
            groups.setdefault(v.group_id, []).append(v)
    return groups


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(EVENT, min_size=20, max_size=150))
def test_groups_are_all_or_none(steps):
    core = SchedulingCore(CFG)
    for e in events_of(steps):
        d = core_decide(core, e)
        by_kind = Counter(c.kind for c in d.commands)
        for c in d.commands:
            assert c.group_size == K and c.group_id, c
        grants = [c for c in d.commands if c.kind == "grant"]
        # granted all or none: k grants of distinct GPUs of one node, one group, in one step
        assert len(grants) in (0, K)
        if grants:
            assert len({c.gpu for c in grants}) == K and len({c.group_id for c in grants}) == 1
            assert {c.gpu.split("/")[0] for c in grants} == {e.node}
            assert len({c.compute_share for c in grants}) == 1
        # revoked together: a revoke in a step revokes every member the group still had
        for c in d.commands:
            if c.kind == "revoke":
                assert all(v.group_id != c.group_id for v in core.views.values() if v.lease_id is not None)
        # every live group has all k members, all at one compute share (paused or resumed together)
        for gid, members in live_groups(core.views).items():
            assert len(members) == K, (gid, [m.gpu for m in members])
            assert len({m.lease_compute_share for m in members}) == 1, (gid, members)
        assert by_kind["grant"] + by_kind["revoke"] + by_kind["throttle"] + by_kind["renew"] == len(d.commands)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(EVENT, min_size=20, max_size=120))
def test_gang_decisions_are_deterministic_and_views_survive_json(steps):
    events = events_of(steps)
    (_, a), (_, b) = run_core(events), run_core(events)
    assert [orjson.dumps(c.to_dict()) for d in a for c in d.commands] == [
        orjson.dumps(c.to_dict()) for d in b for c in d.commands
    ]
    core, _ = run_core(events)
    for v in core.views.values():
        assert GpuView.from_dict(orjson.loads(orjson.dumps(v.to_dict()))) == v


def calm(core, gpus, i0, ts0, n=4, lat=0.2, mem=30):
    """n calm events per GPU, interleaved; returns every command, the next index and time."""
    cmds, i, ts = [], i0, ts0
    for _ in range(n):
        for g in gpus:
            ts += 0.25
            cmds += core_decide(core, tel(i, ts, lat, lat / 2, 80, 80 * mem / 100, gpu=g)).commands
            i += 1
    return cmds, i, ts


def test_one_gpu_alone_never_gets_a_lease():
    core = SchedulingCore(CFG)
    cmds, _, _ = calm(core, ["n/0"], 0, 1000.0, n=10)
    assert cmds == []
    assert core.views["n/0"].ready_mem_bytes > 0 and core.views["n/0"].lease_id is None


def test_gang_granted_paused_resumed_and_revoked_together():
    core = SchedulingCore(CFG)
    cmds, i, ts = calm(core, ["n/0", "n/1"], 0, 1000.0)
    grants = [c for c in cmds if c.kind == "grant"]
    assert sorted(c.gpu for c in grants) == ["n/0", "n/1"]
    gid = grants[0].group_id
    assert all(c.group_id == gid and c.group_size == K for c in grants)
    assert grants[0].cause_event_id == grants[1].cause_event_id  # one step: one transaction

    # a spike on one member pauses both on that very event
    d = core_decide(core, tel(i, ts + 0.25, 0.95, 0.1, 80, 24, gpu="n/1"))
    assert sorted((c.gpu, c.kind, c.compute_share) for c in d.commands) == [
        ("n/0", "throttle", 0.0),
        ("n/1", "throttle", 0.0),
    ]
    i, ts = i + 1, ts + 0.25
    # calm on n/0 alone resumes nothing
    cmds, i, ts = calm(core, ["n/0"], i, ts, n=5)
    assert not any(c.kind == "throttle" and c.compute_share > 0 for c in cmds)
    # once both would resume, both resume at one share
    cmds, i, ts = calm(core, ["n/0", "n/1"], i, ts, n=4)
    resumes = [c for c in cmds if c.kind == "throttle" and c.compute_share > 0]
    assert sorted(c.gpu for c in resumes) == ["n/0", "n/1"] and len({c.compute_share for c in resumes}) == 1
    # memory pressure on one member revokes both in one step
    d = core_decide(core, tel(i, ts + 0.25, 0.2, 0.1, 80, 78, gpu="n/0"))
    assert sorted((c.gpu, c.kind) for c in d.commands) == [("n/0", "revoke"), ("n/1", "revoke")]
    assert all(v.lease_id is None for v in core.views.values())


def test_group_size_one_keeps_v1_commands():
    """Without gangs the core's commands are decide()'s, with no gang fields on the wire."""
    core = SchedulingCore(dataclasses.replace(CFG, group_size=1))
    cmds, _, _ = calm(core, ["n/0"], 0, 1000.0)
    assert [c.kind for c in cmds] == ["grant"]
    assert "group_id" not in orjson.loads(orjson.dumps(cmds[0].to_dict()))


def test_a_held_batch_leaves_the_views_as_they_were_until_committed():
    """A held batch is decided over an overlay: the same decisions as one event after another,
    and the core's views change only once its views come back as `committed` (a held batch
    never committed is simply dropped)."""
    events = events_of([(g, 0.25, 20, 30) for _ in range(5) for g in GPUS] + [("n/1", 0.25, 95, 30)])
    one_by_one, decided = run_core(events)
    core = SchedulingCore(CFG)
    first = core.apply(Batch(telemetry=events[:7], hold=True))
    assert core.views == {} and first.views
    core.apply(Batch(committed=first.views))
    rest = core.apply(Batch(telemetry=events[7:], hold=True))
    kept = dict(core.views)
    dropped = core.apply(Batch(telemetry=events[7:], hold=True))
    assert core.views == kept and dropped == rest
    core.apply(Batch(committed=rest.views))
    assert core.views == one_by_one.views
    assert first.decisions + rest.decisions == tuple(decided)
    assert any(c.kind == "grant" for d in decided for c in d.commands)
    assert any(c.kind == "throttle" for d in decided for c in d.commands)


def test_a_member_rejected_by_its_executor_ends_the_gang_on_the_next_event_of_another():
    core = SchedulingCore(CFG)
    cmds, i, ts = calm(core, ["n/0", "n/1"], 0, 1000.0)
    grants = {c.gpu: c for c in cmds if c.kind == "grant"}
    g = grants["n/1"]
    core.apply(Batch(lease_states=(LeaseState("n/1", g.lease_id, g.epoch, "rejected", ts, 0, g.command_id),)))
    assert core.views["n/1"].lease_id is None and core.views["n/0"].lease_id == grants["n/0"].lease_id
    d = core_decide(core, tel(i, ts + 0.25, 0.2, 0.1, 80, 24, gpu="n/0"))
    assert [(c.gpu, c.kind, c.lease_id, c.group_id) for c in d.commands] == [
        ("n/0", "revoke", grants["n/0"].lease_id, g.group_id)
    ]
    assert "1 member(s) lost their lease" in d.explain.reason and d.explain.action == "revoke"
    assert all(v.lease_id is None for v in core.views.values())
    # the gang forms again once both qualify
    cmds, _, _ = calm(core, ["n/0", "n/1"], i + 1, ts + 0.25)
    assert sorted(c.gpu for c in cmds if c.kind == "grant") == ["n/0", "n/1"]
