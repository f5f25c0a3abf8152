"""The audit every full-system fault test ends with: nothing lost, nothing duplicated, no
lease held too long, every weight follower exact. Each check reads what the system left in
Kafka, Redis and on disk (never a process's own account of itself), raises AssertionError
naming what is wrong, and returns what it counted.

- commands: read with read_committed, every command_id once; per GPU the commands equal the
  pure policy (rose.telemetry_workload.expected_commands) over the telemetry actually in the
  topic — up to the first point where an executor ended a lease on its own (`expired`,
  `rejected`), which the scheduler folds into its view (a partition, a kill, an outage);
  from there on the structural rules: unique ids, epochs strictly increasing from grant to
  grant, renew/revoke carry the epoch of the lease they belong to, no renew after a revoke.
- leases: every lease that went `active` ends `revoked`/`expired` no later than its last
  deadline (record time of its last grant/renew + that command's TTL, which is how the
  executor counts it) + revoke deadline + slack, is never `active` again after it ended,
  and is either ended or still renewed. A lease whose executor was SIGKILLed counts as ended
  at the kill (its worker dies with the executor; the caller checks that) — the `expired`
  the restarted executor publishes comes later by construction.
- tasks: every submitted task_id exactly once in the results stream, each trajectory
  complete, nothing pending, nothing dead-lettered.
- weights: the follower's state file bit-identical to the trainer's last version, and every
  version applied exactly once, in order.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import numpy as np
import orjson

from rose.config import Config
from rose.contract.events import InvalidEvent, Telemetry
from rose.contract.wire import decode
from rose.kafka.consumer import read_all
from rose.policy.core import check_admission
from rose.sim.telemetry_workload import expected_commands

LEASE_ENDS = ("revoked", "expired")
EXECUTOR_ENDS = ("expired", "rejected")  # a lease ended by the executor, not by a command


def _records(cfg: Config, topic: str) -> list[tuple[dict, float]]:
    return [
        (orjson.loads(m.value()), m.timestamp()[1] / 1000.0)
        for m in read_all(cfg.kafka, [topic])
        if m.value() is not None
    ]


def admitted_telemetry(cfg: Config) -> list[Telemetry]:
    """The telemetry the scheduler decides on: what is in the topic and passes admission."""
    out = []
    for m in read_all(cfg.kafka, [cfg.kafka.telemetry_topic]):
        try:
            ev = decode(m.value(), Telemetry)
            check_admission(ev, m.timestamp()[1], m.key(), cfg.policy)
        except InvalidEvent:
            continue
        out.append(ev)
    return out


def audit_commands(cfg: Config) -> dict:
    events = admitted_telemetry(cfg)
    want = expected_commands(events, cfg.policy)
    cmds = _records(cfg, cfg.kafka.commands_topic)
    states = _records(cfg, cfg.kafka.lease_state_topic)
    ids = Counter(c["command_id"] for c, _ in cmds)
    dups = {i: n for i, n in ids.items() if n > 1}
    assert not dups, f"duplicated commands: {dups}"
    causes = {e.event_id for e in events}
    unknown = [c["command_id"] for c, _ in cmds if c["cause_event_id"] not in causes]
    assert not unknown, f"commands caused by no telemetry in the topic: {unknown[:5]}"
    by_gpu: dict[str, list[tuple[dict, float]]] = {}
    for c, ts in cmds:  # per GPU in offset order: a GPU's commands share a partition
        by_gpu.setdefault(c["gpu"], []).append((c, ts))
    exec_ends: dict[str, list[float]] = {}
    for s, ts in states:
        if s["state"] in EXECUTOR_ENDS:
            exec_ends.setdefault(s["gpu"], []).append(ts)
    exact = diverged = 0
    for gpu in sorted(set(by_gpu) | set(want)):
        got = by_gpu.get(gpu, [])
        w = want.get(gpu, [])
        i = next((j for j, ((c, _), wc) in enumerate(zip(got, w)) if c != wc), min(len(got), len(w)))
        if i == len(got) == len(w):
            exact += 1
        else:
            at = got[i][1] if i < len(got) else float("inf")
            assert any(t <= at for t in exec_ends.get(gpu, [])), (
                f"{gpu}: command {i} differs from the pure policy with no lease ended by its executor before it: "
                f"got {got[i][0] if i < len(got) else None}, want {w[i] if i < len(w) else None}"
            )
            diverged += 1
        _structure(gpu, [c for c, _ in got])
    kinds = Counter(c["kind"] for c, _ in cmds)
    return {
        "telemetry": len(events),
        "commands": len(cmds),
        "duplicates": 0,
        **kinds,
        "gpus_exact": exact,
        "gpus_after_executor_end": diverged,
    }


def _structure(gpu: str, cmds: list[dict]) -> None:
    last_epoch, current, ended = -1, None, False
    for c in cmds:
        assert c["lease_id"] == f"{gpu}#{c['epoch']}", f"{gpu}: lease_id {c['lease_id']} at epoch {c['epoch']}"
        if c["kind"] == "grant":
            assert c["epoch"] > last_epoch, f"{gpu}: grant at epoch {c['epoch']} after epoch {last_epoch}"
            last_epoch, current, ended = c["epoch"], c["epoch"], False
        else:
            assert c["epoch"] == current, f"{gpu}: {c['kind']} of epoch {c['epoch']}, current lease {current}"
            assert not ended, f"{gpu}: {c['kind']} of lease {c['lease_id']} after its revoke"
            ended = c["kind"] == "revoke"


def audit_leases(cfg: Config, revoke_deadline_s: float, executor_kills: list[float] = (), slack_s: float = 2.0) -> dict:
    cmds = _records(cfg, cfg.kafka.commands_topic)
    states = _records(cfg, cfg.kafka.lease_state_topic)
    deadlines: dict[str, list[tuple[float, float]]] = {}  # lease -> (record time, executor deadline)
    for c, ts in cmds:
        if c["kind"] in ("grant", "renew"):
            deadlines.setdefault(c["lease_id"], []).append((ts, ts + (c["expires_at"] - c["ts"])))
    by_lease: dict[str, list[tuple[str, float]]] = {}
    for s, ts in states:
        by_lease.setdefault(s["lease_id"], []).append((s["state"], ts))
    now = time.time()
    leases = ended = by_kill = 0
    worst = -float("inf")
    for lease, recs in by_lease.items():
        first_active = next((ts for st, ts in recs if st == "active"), None)
        if first_active is None:
            continue
        leases += 1
        end_i = next((i for i, (st, ts) in enumerate(recs) if st in LEASE_ENDS and ts >= first_active), None)
        end = recs[end_i][1] if end_i is not None else None
        if end_i is not None:
            back = [st for st, _ in recs[end_i + 1 :] if st == "active"]
            assert not back, f"{lease}: active again after it ended ({[st for st, _ in recs]})"
        kill = next((k for k in sorted(executor_kills) if first_active <= k and (end is None or k < end)), None)
        held_until = min(x for x in (end, kill) if x is not None) if (end or kill) else None
        known = [d for ts, d in deadlines.get(lease, []) if held_until is None or ts <= held_until]
        assert known, f"{lease}: active without a grant in the commands topic"
        bound = max(known) + revoke_deadline_s + slack_s
        if held_until is None:
            assert bound >= now, f"{lease}: still active {now - bound + slack_s:.1f}s past its deadline"
            continue
        ended += 1
        by_kill += held_until == kill
        worst = max(worst, held_until - (bound - slack_s))
        assert held_until <= bound, (
            f"{lease}: held {held_until - bound + slack_s:.2f}s past its expiry + revoke "
            f"deadline ({[st for st, _ in recs]})"
        )
    return {
        "leases": leases,
        "ended": ended,
        "ended_by_executor_kill": by_kill,
        "latest_end_vs_deadline_s": round(worst, 2) if ended else None,
    }


def audit_tasks(queue, submitted: dict[str, int]) -> dict:
    """`submitted`: task_id -> max_turns."""
    results = queue.all_results()
    n = Counter(t["task_id"] for t in results)
    dups = {i: k for i, k in n.items() if k > 1}
    assert not dups, f"trajectories duplicated: {dups}"
    lost = sorted(set(submitted) - set(n))
    assert not lost, f"{len(lost)} tasks lost: {lost[:10]}"
    extra = sorted(set(n) - set(submitted))
    assert not extra, f"results for tasks never submitted: {extra[:10]}"
    short = [t["task_id"] for t in results if len(t["turns"]) != submitted[t["task_id"]]]
    assert not short, f"incomplete trajectories: {short[:10]}"
    r = queue.r
    assert r.xlen(queue.dead_stream) == 0, f"dead-lettered tasks: {r.xrange(queue.dead_stream, count=3)}"
    streams = [queue.stream] + [queue.directed(w.decode()) for w in r.smembers(queue.workers_key)]
    pending = sum(r.xpending(s, queue.group)["pending"] for s in streams if r.exists(s))
    assert pending == 0, f"{pending} task entries still pending"
    moved = sum(len({x["worker"] for x in t["turns"]}) > 1 for t in results)
    return {
        "tasks": len(submitted),
        "results": len(results),
        "duplicates": 0,
        "handed_over": moved,
        "workers": len({x["worker"] for t in results for x in t["turns"]}),
    }


def audit_weights(out_dir: Path, want_flat: np.ndarray, versions: int) -> dict:
    from rose.weights.follower import FileStateStore

    loaded = FileStateStore(out_dir).load()
    assert loaded is not None, f"the follower wrote no state in {out_dir}"
    snap, applied = loaded
    assert snap.version == versions, f"follower at version {snap.version}, trainer published {versions}"
    assert np.array_equal(snap.flat, want_flat), "follower state differs from the trainer's"
    assert applied == list(range(1, versions + 1)), f"versions applied: {applied}"
    return {"versions": versions, "applied": len(applied), "bit_identical": True}
