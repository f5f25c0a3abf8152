"""The audit every full-system fault test ends with: nothing lost, nothing duplicated, no
lease held too long, every weight follower exact. Each check reads what the system left in
Kafka, Redis and on disk (never a process's own account of itself), raises AssertionError
naming what is wrong, and returns what it counted.

- commands: read with read_committed, every command_id once, each caused by telemetry in the
  topic. Per GPU, the commands must equal the scheduling core's (rose.policy.core) over the
  GPU's admitted telemetry with its executor's lease states folded in (`admissible_replay`):
  at their record time, or where the scheduler may have seen them instead (after every
  decision it committed before the state was written, before every event written more than
  `LEASE_LAG_S` after it), or, in a window where the fault may have made the scheduler rebuild
  its views, only the newest of them as a rebuild does. Every GPU must match, however many
  leases its executor ended (`expired`, `rejected`) or faults it went through; each also gets
  the structural rules (unique ids, epochs strictly increasing from grant to grant,
  renew/throttle/revoke carrying the epoch of their lease, nothing after a revoke).
- replica commands (a run with `policy.pools`, `audit_replica_commands`): read with
  read_committed, hop by hop (tests/faults/replica_audit.py): every replica command id and pool
  intent once; per pool, each committed sample's intents exactly the pool stage's decision over
  the committed samples (or, in a `rebuilds` window, a takeover's); no lend of the pool's last
  serving replica; per GPU, each intent's replica grant or revoke given once and only where
  the GPU held no replica lease (grant) or held one (revoke), no lease granted again while
  lent or revoked twice, epochs increasing (the structural rules of `commands`).
- transactions: what read_uncommitted sees beyond read_committed in `commands` and
  `scheduler-state` is output of aborted transactions (`audit_aborted`); every record of a
  transaction open when the scheduler was killed must be one of them.
- leases: every lease that went `active` ends `revoked`/`expired` no later than its last
  deadline (record time of its last grant/renew/throttle + that command's TTL, which is how
  the executor counts it) + revoke deadline + slack, is never `active` again after it ended,
  and is either ended or still renewed. A lease whose executor was SIGKILLed counts as ended
  at the kill (its worker dies with the executor; the caller checks that) — the `expired`
  the restarted executor publishes comes later by construction.
- tasks: every submitted task_id exactly once in the results stream, each trajectory
  complete, nothing pending, nothing dead-lettered; the queue's per-step counters agree with
  the results; episodes completed a second time (`duplicates:{step}`, counted by the queue's
  completion script, not by the workers) at most `max_duplicates`.
- weights: the trainer's versions recomputed from its seed (`trainer_states`), not taken from
  the run; the stream's per-version shard checksums (commit entries, carried forward over
  deltas) equal the recomputed versions'; the follower's state file is the last version bit
  for bit, at the seq and epoch of the stream's last commit (and its own record of versions
  applied lists each once, in order).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np
import orjson

from rose.config import Config, PolicyConfig
from rose.contract.events import LEASE_SETTING_KINDS, InvalidEvent, LeaseState, Telemetry
from rose.contract.wire import decode
from rose.kafka.admin import partitions_of
from rose.kafka.consumer import KafkaException, TopicPartition, make_consumer, message_record, read_all
from rose.policy.core import Batch, SchedulingCore, check_admission
from rose.policy.pool_records import PoolIntent, PoolSample
from rose.scheduler.service import SCHEDULER_GROUP
from tests.faults.replica_audit import check_replicas
from tests.kafka_checks import duplicate_ids

LEASE_ENDS = ("revoked", "expired")
EXECUTOR_ENDS = ("expired", "rejected")  # a lease ended by the executor, not by a command
# How long after its record time a lease state may still be unseen by the scheduler deciding a
# GPU's telemetry: the lease consumer's lag, which a broker outage or a client replacement
# stretches to seconds.
LEASE_LAG_S = 10.0
SEARCH_BUDGET = 50_000  # nodes of the placement search per GPU
T = TypeVar("T")


def _records(cfg: Config, topic: str, isolation: str = "read_committed") -> list[tuple[dict, float]]:
    return [
        (orjson.loads(m.value()), m.timestamp()[1] / 1000.0)
        for m in read_all(cfg.kafka, [topic], isolation=isolation)
        if m.value() is not None
    ]


def dump_records(cfg: Config, path: Path) -> int:
    """Telemetry, commands and lease states as `rose record` writes them (`rose replay --diff
    PATH` re-runs the policy over them): for reading a failed audit."""
    k = cfg.kafka
    msgs = read_all(k, [k.telemetry_topic, k.commands_topic, k.lease_state_topic])
    msgs.sort(key=lambda m: m.timestamp()[1])
    path.write_bytes(b"".join(orjson.dumps(message_record(m)) + b"\n" for m in msgs))
    return len(msgs)


def admitted_telemetry(cfg: Config) -> list[tuple[Telemetry, float]]:
    """The telemetry the scheduler decides on: what is in the topic and passes admission, with
    its record time."""
    out = []
    for m in read_all(cfg.kafka, [cfg.kafka.telemetry_topic]):
        try:
            ev = decode(m.value(), Telemetry)
            check_admission(ev, m.timestamp()[1], m.key(), cfg.policy)
        except InvalidEvent:
            continue
        out.append((ev, m.timestamp()[1] / 1000.0))
    return out


def admissible_replay(  # noqa: C901 - the search over admissible fold orders, one function so its budget holds
    events: list[tuple[Telemetry, float]],
    states: list[tuple[LeaseState, float]],
    recorded: list[tuple[dict, float]],
    policy: PolicyConfig,
    rebuilds: list[tuple[float, float]] = (),
    lag_s: float = LEASE_LAG_S,
    budget: int = SEARCH_BUDGET,
) -> tuple[bool, dict]:
    """Whether one GPU's recorded commands are exactly what the scheduling core decides over its
    telemetry (`events`, offset order) with its lease states (`states`, offset order: the
    order the scheduler reads them in) folded in at admissible points. State i may be folded
    before event k only if no command recorded before the state was written came from event k
    or later (that decision was taken without it), and must be folded before every event
    recorded more than `lag_s` after it, or, for a state recorded inside a `rebuilds` window,
    more than `lag_s` after the window's end (its record time is when it was produced, and a
    broker away holds it back until it returns). Within a `rebuilds` window (wall-clock intervals in
    which the fault may have made a scheduler rebuild its views: a restart, a client
    replacement) the scheduler may instead rebuild, as `SchedulingCore.restore` does: fold only
    the newest state recorded by then (all a compacted topic promises to keep), the ones before
    it unseen. Depth-first, the record-time placement first (as `rose replay` places states),
    rebuilds last; a mismatching command prunes a branch.

    Returns (matched, info): `displaced` counts states folded away from their record time and
    `rebuilt` the rebuilds that folded a state; without a match, `at` is the index of the
    deepest command no placement explained, with the `recorded` and `replayed` commands there."""
    n, m = len(events), len(states)
    pos = {ev.event_id: k for k, (ev, _) in enumerate(events)}

    def decided_before(t: float) -> int:  # events whose decision was committed before `t`
        return max((pos.get(c["cause_event_id"], -1) + 1 for c, tc in recorded if tc < t), default=0)

    lo, hi, at_time = [], [], []
    for _ls, t in states:
        lo.append(decided_before(t))
        # a record stamped inside a fault window may have waited in its producer's buffer (a
        # broker away) and become readable only when the window closed: its deadline counts from then
        seen_by = max([t, *(b for a, b in rebuilds if a <= t <= b)])
        hi.append(next((k for k, (_, te) in enumerate(events) if te > seen_by + lag_s), n))
        at_time.append(next((k for k, (_, te) in enumerate(events) if te >= t), n))
    for i in range(m - 2, -1, -1):  # a state is folded before the ones after it
        hi[i] = min(hi[i], hi[i + 1])
    # per window: the events decided before it, and how many states a rebuild in it can have read
    windows = [(decided_before(a), sum(t <= a for _, t in states), sum(t <= b for _, t in states)) for a, b in rebuilds]
    gpu = events[0][0].gpu if events else ""
    best: dict = {"at": -1}
    seen: set = set()
    # node: (next event, next state, next recorded command, view, last folded state, placements)
    stack: list[tuple] = [(0, 0, 0, None, None, ())]
    while stack and len(seen) < budget:
        k, i, j, view, floor, placed = stack.pop()
        if (k, i, j, view) in seen:
            continue
        seen.add((k, i, j, view))
        if k == n:
            if j == len(recorded):
                return True, {
                    "displaced": sum(p != at_time[s] for s, p, _ in placed),
                    "rebuilt": sum(r for _, _, r in placed),
                    "nodes": len(seen),
                }
            if j > best["at"]:
                best = {"at": j, "recorded": recorded[j][0], "replayed": None}
            continue
        views = {gpu: view} if view is not None else {}
        children = []  # explored last to first
        for after, first, last in windows:  # a rebuild now, having read states up to i2 - 1
            for i2 in range(max(i + 2, first), last + 1) if after <= k else ():
                if lo[i2 - 1] <= k:
                    core = SchedulingCore(policy, dict(views), {})
                    core.restore(list(views.values()), [ls for ls, _ in states[:i2]])
                    children.append((k, i2, j, core.views.get(gpu), states[i2 - 1][0], placed + ((i2 - 1, k, 1),)))
        fold = decided = None
        if i < m and lo[i] <= k:  # state i may be seen before event k is decided
            core = SchedulingCore(policy, dict(views), {})
            core.apply(Batch(lease_states=(states[i][0],)))
            fold = (k, i + 1, j, core.views.get(gpu), states[i][0], placed + ((i, k, 0),))
        if i == m or k < hi[i]:  # event k may be decided before state i is seen
            core = SchedulingCore(policy, dict(views), {gpu: floor} if floor else {})
            got = [c.to_dict() for c in core.apply(Batch(telemetry=(events[k][0],))).commands]
            want = [c for c, _ in recorded[j : j + len(got)]]
            if got == want:
                decided = (k + 1, i, j + len(got), core.views[gpu], floor, placed)
            elif j > best["at"]:
                best = {"at": j, "recorded": recorded[j][0] if j < len(recorded) else None, "replayed": got[0]}
        in_time = fold is not None and at_time[i] <= k  # the state's record time has come: fold first
        children += [c for c in ((decided, fold) if in_time else (fold, decided)) if c is not None]
        stack.extend(children)
    best["nodes"] = len(seen)
    return False, best


def audit_commands(cfg: Config, rebuilds: list[tuple[float, float]] = ()) -> dict:
    """`rebuilds`: wall-clock windows in which the fault may have made the scheduler rebuild its
    views (`admissible_replay`)."""
    assert cfg.policy.group_size <= 1, "the audit replays each GPU alone: gang leases (group_size > 1) join them"
    events = admitted_telemetry(cfg)
    cmds = _records(cfg, cfg.kafka.commands_topic)
    states = _records(cfg, cfg.kafka.lease_state_topic)
    dups = duplicate_ids([c for c, _ in cmds])
    assert not dups, f"duplicated commands: {dups}"
    causes = {e.event_id for e, _ in events}
    unknown = [c["command_id"] for c, _ in cmds if c["cause_event_id"] not in causes]
    assert not unknown, f"commands caused by no telemetry in the topic: {unknown[:5]}"
    by_gpu: dict[str, list[tuple[dict, float]]] = {}
    for c, ts in cmds:  # per GPU in offset order: a GPU's commands share a partition
        by_gpu.setdefault(c["gpu"], []).append((c, ts))
    ev_by_gpu: dict[str, list[tuple[Telemetry, float]]] = {}
    for ev, ts in events:
        ev_by_gpu.setdefault(ev.gpu, []).append((ev, ts))
    st_by_gpu: dict[str, list[tuple[LeaseState, float]]] = {}
    exec_ends = 0  # leases the executor ended on its own (drained, failed)
    for s, ts in states:
        try:
            ls = LeaseState.from_dict(s)
        except InvalidEvent:
            continue  # the scheduler skips it too
        st_by_gpu.setdefault(ls.gpu, []).append((ls, ts))
        exec_ends += ls.state in EXECUTOR_ENDS
    exact, displaced, rebuilt = [], 0, 0
    for gpu in sorted(set(by_gpu) | set(ev_by_gpu)):
        got = by_gpu.get(gpu, [])
        _structure(gpu, [c for c, _ in got])
        ok, info = admissible_replay(ev_by_gpu.get(gpu, []), st_by_gpu.get(gpu, []), got, cfg.policy, list(rebuilds))
        assert ok, (
            f"{gpu}: command {info['at']} is not the scheduling core's under any admissible placement of its "
            f"lease states (GPUs exact before it: {exact}): got {info.get('recorded')}, want {info.get('replayed')}"
        )
        exact.append(gpu)
        displaced += info["displaced"]
        rebuilt += info["rebuilt"]
    kinds = Counter(c["kind"] for c, _ in cmds)
    return {
        "telemetry": len(events),
        "commands": len(cmds),
        "duplicates": 0,
        **kinds,
        "gpus_exact": len(exact),
        "lease_states_folded_off_record_time": displaced,
        "lease_states_folded_by_a_rebuild": rebuilt,
        "executor_ended_leases": exec_ends,
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


def _decoded(cfg: Config, topic: str, parse: Callable[[bytes], T]) -> list[tuple[T, float]]:
    """A derived topic's committed records that parse, with their record times (one that does not
    went to the dlq when it was consumed)."""
    out = []
    for m in read_all(cfg.kafka, [topic]):
        try:
            out.append((parse(m.value() or b""), m.timestamp()[1] / 1000.0))
        except InvalidEvent:
            continue
    return out


def pool_backlog(cfg: Config) -> int | None:
    """Committed pool samples the pool stage has not decided yet and pool intents the GPU stage
    has not applied yet: records past their group's committed offset (None: the group coordinator
    did not answer). The replica audit needs 0: a drained run."""
    k = cfg.kafka
    n = 0
    for topic, group in ((k.pool_samples_topic, f"{SCHEDULER_GROUP}-pools"), (k.pool_intents_topic, SCHEDULER_GROUP)):
        c = make_consumer(k, f"{k.topic_prefix}{group}")
        try:
            tps = c.committed([TopicPartition(topic, p) for p in partitions_of(k, topic)], timeout=10)
        except KafkaException:
            return None
        finally:
            c.close()
        done = {tp.partition: max(tp.offset, 0) for tp in tps}
        n += sum(m.offset() >= done.get(m.partition(), 0) for m in read_all(k, [topic]))
    return n


def audit_replica_commands(cfg: Config, rebuilds: list[tuple[float, float]] = ()) -> dict:
    """Replica leases, hop by hop from the topics (`tests.faults.replica_audit.check_replicas`):
    pool samples -> the pool stage's intents -> the GPU stage's replica commands, on a drained run
    (`pool_backlog`). `rebuilds`: wall-clock windows in which the fault may have made the pool
    stage take over."""
    k = cfg.kafka
    left = pool_backlog(cfg)
    assert left == 0, f"{left} pool samples or intents not yet decided or applied: drain the run first (pool_backlog)"
    cmds = _records(cfg, k.commands_topic)
    by_gpu: dict[str, list[dict]] = {}
    for c, _ in cmds:
        by_gpu.setdefault(c["gpu"], []).append(c)
    for gpu, mine in sorted(by_gpu.items()):
        if any(c.get("lease_kind") == "replica" for c in mine):
            _structure(gpu, mine)
    return check_replicas(
        cfg.policy.pools,
        _decoded(cfg, k.pool_samples_topic, PoolSample.from_bytes),
        _decoded(cfg, k.pool_intents_topic, PoolIntent.from_bytes),
        cmds,
        _records(cfg, k.lease_state_topic),
        rebuilds,
        cfg.policy.max_ts_skew_s,
        LEASE_LAG_S,
    )


def audit_aborted(cfg: Config, open_at_kills: list[dict] = ()) -> dict:
    """Records of aborted transactions in the scheduler's output topics: what a
    read_uncommitted reader sees there and a read_committed one does not (transaction markers
    take offsets but are no records, so the difference is exactly the aborted records).
    `open_at_kills`: per scheduler kill, the offsets [LSO, HWM) of its open transaction per
    (topic, partition) at the kill: each of them must be such an aborted record."""
    k = cfg.kafka
    aborted: dict[tuple[str, int], set[int]] = {}
    commands = 0
    for topic in (k.commands_topic, k.topic("scheduler-state")):
        committed = {(m.partition(), m.offset()) for m in read_all(k, [topic])}
        for m in read_all(k, [topic], isolation="read_uncommitted"):
            if (m.partition(), m.offset()) not in committed:
                aborted.setdefault((topic, m.partition()), set()).add(m.offset())
                commands += topic == k.commands_topic
    in_kills = []
    for open_tx in open_at_kills:
        n = 0
        for (topic, p), (lso, hwm) in open_tx.items():
            missing = sorted(set(range(lso, hwm)) - aborted.get((topic, p), set()))
            assert not missing, (
                f"{topic}[{p}] offsets {missing[:5]} were in the transaction the scheduler was killed in, "
                "and are not aborted records (committed, or gone)"
            )
            n += hwm - lso
        in_kills.append(n)
    return {
        "aborted_records": sum(map(len, aborted.values())),
        "aborted_commands": commands,
        "records_of_transactions_open_at_kills": in_kills,
    }


def audit_leases(cfg: Config, revoke_deadline_s: float, executor_kills: list[float] = (), slack_s: float = 2.0) -> dict:
    cmds = _records(cfg, cfg.kafka.commands_topic)
    states = _records(cfg, cfg.kafka.lease_state_topic)
    deadlines: dict[str, list[tuple[float, float]]] = {}  # lease -> (record time, executor deadline)
    for c, ts in cmds:
        if c["kind"] in LEASE_SETTING_KINDS:  # a throttle renews too
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


def audit_tasks(queue, submitted: dict[str, int], max_duplicates: int = 0, resubmits: int = 0) -> dict:
    """`submitted`: task_id -> max_turns. `max_duplicates`: how many episodes the fault may let
    two workers complete (one whose holder stalled past `min_idle_ms` while alive, so another
    reclaimed it: a Redis outage); `resubmits`: submissions the trainer retried without knowing
    whether the first one landed (each may have queued its task twice)."""
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
    counters = Counter()
    for field, value in r.hgetall(queue.stats_key).items():
        counters[field.decode().split(":", 1)[0]] += int(value)
    assert counters["completed"] == len(results), (
        f"the queue counted {counters['completed']} completions, the results stream holds {len(results)}"
    )
    assert len(submitted) <= counters["submitted"] <= len(submitted) + resubmits, (
        f"the queue counted {counters['submitted']} submissions of {len(submitted)} tasks ({resubmits} retried)"
    )
    assert counters["duplicates"] <= max_duplicates, (
        f"{counters['duplicates']} episodes completed a second time (at most {max_duplicates} allowed)"
    )
    moved = sum(len({x["worker"] for x in t["turns"]}) > 1 for t in results)
    return {
        "tasks": len(submitted),
        "results": len(results),
        "duplicates": 0,
        "executed_twice": counters["duplicates"],
        "handed_over": moved,
        "workers": len({x["worker"] for t in results for x in t["turns"]}),
    }


def _shard_sums(state: dict, shard_bytes: int) -> tuple[np.ndarray, dict[int, str]]:
    """A version's bytes as the weight stream lays them out, and the checksum of each shard."""
    from rose.weights.checkpoint import from_state_dict
    from rose.weights.codec import checksum
    from rose.weights.layout import flatten, make_layout

    specs, arrays = from_state_dict(state)
    layout = make_layout(specs, shard_bytes)
    flat = flatten(layout, arrays)
    return flat, {i: checksum(flat[slice(*layout.shard_range(i))]) for i in range(layout.num_shards)}


def _commits(r, stream: str) -> Iterator[tuple[int, int, str, dict[int, str], bool]]:
    """(version, seq, epoch, shard -> checksum, keyframe) of each commit entry, in stream order."""
    from rose.weights.entries import from_fields

    for _id, fields in r.xrange(stream):
        e = from_fields(fields)
        if e.kind == "commit":
            body = orjson.loads(e.payload)
            yield e.version, e.seq, e.epoch, {int(i): c for i, c in body["shards"]}, bool(body["keyframe"])


def audit_weights(r, stream: str, out_dir: Path, versions: list[dict], shard_bytes: int) -> dict:
    """`versions`: the trainer's states 1..n, recomputed (not the run's arrays). The weight
    stream must carry each of them (its commits' checksums, carried forward over delta
    versions, equal the recomputed shards'), and the follower's state file must be the last,
    at the stream's last commit."""
    from rose.weights.follower import FileStateStore

    want = [_shard_sums(v, shard_bytes) for v in versions]
    carried: dict[int, str] | None = None
    commits = []  # (version, seq, epoch, every shard's checksum as of that version)
    for version, seq, epoch, shards, keyframe in _commits(r, stream):
        if keyframe:
            carried = dict(shards)
        elif carried is None:
            continue  # trimmed: its base is no longer in the stream
        else:
            carried.update(shards)
        commits.append((version, seq, epoch, dict(carried)))
    versions = [c[0] for c in commits]
    # exactly the trainer's last versions, each once and in order (trimming may drop the first ones)
    assert versions == list(range(len(want) - len(versions) + 1, len(want) + 1)) and versions, (
        f"the stream holds versions {versions}; the trainer made 1..{len(want)}"
    )
    for version, _, _, sums in commits:
        assert sums == want[version - 1][1], f"version {version} in the stream is not the trainer's"
    checked, last = len(commits), commits[-1][:3]
    loaded = FileStateStore(out_dir).load()
    assert loaded is not None, f"the follower wrote no state in {out_dir}"
    snap, applied = loaded
    assert (snap.version, snap.seq, snap.epoch) == last, (
        f"follower at version, seq, epoch {(snap.version, snap.seq, snap.epoch)}; the stream's last commit {last}"
    )
    assert np.array_equal(snap.flat, want[-1][0]), "follower state differs from the trainer's last version"
    assert applied == list(range(1, len(want) + 1)), f"versions applied: {applied}"
    return {"versions": len(want), "checked_in_stream": checked, "applied": len(applied), "bit_identical": True}
