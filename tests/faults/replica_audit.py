"""The audit of replica leases (docs/scheduler.md "Pool decisions and partitioning"), pure: what
`audit.audit_replica_commands` read with read_committed from the pool-samples, pool-intents,
commands and lease-state topics, checked hop by hop. Each check raises AssertionError naming what
is wrong.

- ids: every replica command id once; every pool intent once per GPU; every intent caused by a
  committed sample of its pool.
- never the last serving replica: with each sample's committed intents folded into the pool's
  state as the stage folds them, no decision that lends leaves the pool without a `serving`
  replica (`effective_view`).
- the decision: per pool, each sample's committed intents are exactly the pool stage's
  (`decide_sample`) over the committed samples in offset order, or, inside a `rebuilds` window
  (a kill, a restart), the decision of a stage that took over there as `PoolStage._take_over`
  does: the samples and intents since the newest committed sample's time less the window and
  the skew, folded without deciding (`run_stage(decide_from=...)`).
- the GPU stage: per GPU, its intents in partition order (the order it applies them) against its
  replica commands: a lend gives one replica grant (at an epoch at or above the intent's, in the
  gang `{replica}#{intent epoch}`, after at most a revoke of a co-resident lease) unless the GPU
  holds a replica lease, never a grant while it does; a reclaim gives one revoke of the held
  lease and none without one; each lease revoked at most once; no replica grant or revoke
  caused by anything else. A held lease the executor ended (`lease-state`) or whose last
  deadline passed by the intent's record time + `lag_s` may have left the GPU stage's view
  without a revoke: either outcome is admissible there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from rose.policy.pool import PoolConfig
from rose.policy.pool_records import LEND, PoolIntent, PoolSample
from rose.policy.pool_stage import PoolState, decide_sample, effective_view, fold_intent, fold_sample, run_stage
from tests.kafka_checks import duplicate_ids

EXECUTOR_ENDS = ("expired", "rejected", "revoked")


def _replica_kind(c: dict, kind: str) -> bool:
    return c["kind"] == kind and c.get("lease_kind") == "replica"


def check_replicas(
    pools: Mapping[str, PoolConfig],
    samples: Sequence[tuple[PoolSample, float]],
    intents: Sequence[tuple[PoolIntent, float]],
    commands: Sequence[tuple[dict, float]],
    lease_states: Sequence[tuple[dict, float]] = (),
    rebuilds: Sequence[tuple[float, float]] = (),
    max_ts_skew_s: float = 0.0,
    lag_s: float = 10.0,
) -> dict:
    """`samples` and `intents` in offset order per partition, `commands` per GPU in offset order,
    each with its record time; `rebuilds`: wall-clock windows in which the pool stage may have
    been taken over. Returns what it counted."""
    replica = [c for c, _ in commands if c.get("lease_kind") == "replica"]
    dups = duplicate_ids(replica)
    assert not dups, f"duplicated replica commands: {dups[:5]}"
    twice = [k for k, n in Counter((i.intent_id, i.gpu) for i, _ in intents).items() if n > 1]
    assert not twice, f"pool intents committed twice (intent id, gpu): {twice[:5]}"
    ids = {s.event_id for s, _ in samples}
    orphans = [i.intent_id for i, _ in intents if i.cause_event_id not in ids]
    assert not orphans, f"pool intents caused by no committed pool sample: {orphans[:5]}"
    rebuilt = 0
    for pool, cfg in sorted(pools.items()):
        ss = [(s, t) for s, t in samples if s.pool == pool]
        ii = [(i, t) for i, t in intents if i.pool == pool]
        never_lends_the_last(pool, [s for s, _ in ss], [i for i, _ in ii], cfg)
        window = max(c.window_s for c in pools.values()) + max_ts_skew_s
        ok, info = pool_replay(ss, ii, cfg, rebuilds, window, lag_s)
        assert ok, (
            f"pool {pool}: the intents of sample {info['at']} ({info['event_id']}) are not the pool stage's "
            f"decision over the committed samples: committed {info['committed']}, decided {info['decided']}"
        )
        rebuilt += info["rebuilt"]
    ends: dict[str, float] = {}
    for s, t in lease_states:
        if s.get("state") in EXECUTOR_ENDS:
            ends[s["lease_id"]] = min(t, ends.get(s["lease_id"], t))
    held_lends = 0
    for gpu in sorted({c["gpu"] for c in replica} | {i.gpu for i, _ in intents}):
        mine = [(i, t) for i, t in intents if i.gpu == gpu]
        held_lends += gpu_stage_walk(gpu, mine, [x for x in commands if x[0]["gpu"] == gpu], ends, lag_s)
    kinds = Counter(c["kind"] for c in replica)
    actions = Counter(i.action for i, _ in intents)
    return {
        "pool_samples": len(samples),
        "pool_intents": len(intents),
        **{f"intents_{a}": n for a, n in sorted(actions.items())},
        **{f"replica_{k}": n for k, n in sorted(kinds.items())},
        "lends_on_a_held_lease": held_lends,
        "pool_takeovers_that_changed_the_state": rebuilt,
    }


def never_lends_the_last(
    pool: str, samples: Sequence[PoolSample], intents: Sequence[PoolIntent], cfg: PoolConfig
) -> None:
    """The pool's state with the committed intents folded after their cause, as the stage holds
    it: after every sample whose decision lends, some replica is still `serving`."""
    by_cause: dict[str, list[PoolIntent]] = {}
    for i in intents:
        by_cause.setdefault(i.cause_event_id, []).append(i)
    st = PoolState()
    for s in samples:
        st = fold_sample(st, s, cfg)
        mine = by_cause.get(s.event_id, [])
        for i in mine:
            st = fold_intent(st, i)
        lent = sorted({i.replica for i in mine if i.action == LEND})
        if lent:
            view = effective_view(st, cfg)
            serving = [r.replica for r in view.replicas if r.serving_state == "serving"] if view else []
            assert serving, f"pool {pool}: sample {s.event_id} lends {lent}, the pool's last serving replica"


def _key(intents: Sequence[PoolIntent]) -> list[bytes]:
    return sorted(i.to_bytes() for i in intents)


def _takeover_state(
    samples: Sequence[tuple[PoolSample, float]],
    intents: Sequence[tuple[PoolIntent, float]],
    k: int,
    cfg: PoolConfig,
    window_s: float,
) -> PoolState:
    """The state a stage taking over at committed offset `k` folds (`PoolStage._take_over`): the
    samples before `k` from the first recorded at or after the newest one's event time less
    `window_s` (the longest window and the skew), the intents recorded since then of those
    samples."""
    since = samples[k - 1][0].ts - window_s
    first = next(j for j, (_, t) in enumerate(samples[:k]) if t >= since or j == k - 1)
    before = {s.event_id for s, _ in samples[:k]}
    written = [i for i, t in intents if t >= since and i.cause_event_id in before]
    return run_stage([s for s, _ in samples[first:k]], cfg, decide_from=k - first, written=written)[0]


def pool_replay(
    samples: Sequence[tuple[PoolSample, float]],
    intents: Sequence[tuple[PoolIntent, float]],
    cfg: PoolConfig,
    rebuilds: Sequence[tuple[float, float]] = (),
    window_s: float = 0.0,
    lag_s: float = 10.0,
    budget: int = 50_000,
) -> tuple[bool, dict]:
    """Whether each sample's committed intents are the stage's decision of it, the stage's state
    carried from sample to sample or, before a sample `k` a stage inside a `rebuilds` window (a,
    b) may have taken over at, rebuilt as a takeover does: sample k-1 recorded by b, nothing from
    k on decided before a (no intent of it recorded before a, and sample k recorded no more than
    `lag_s`, how far the stage may lag, before a). Depth-first, carried state first; a rebuild that gives the same
    state as the carried one is no branch. (matched, info): `rebuilt` counts takeovers whose
    state differed; without a match, the deepest sample no state explained."""
    n = len(samples)
    by_cause: dict[str, list[PoolIntent]] = {}
    first_written = [float("inf")] * (n + 1)  # earliest record time of an intent of samples k..
    pos = {s.event_id: k for k, (s, _) in enumerate(samples)}
    for i, t in intents:
        by_cause.setdefault(i.cause_event_id, []).append(i)
        first_written[pos[i.cause_event_id]] = min(first_written[pos[i.cause_event_id]], t)
    for k in range(n - 1, -1, -1):
        first_written[k] = min(first_written[k], first_written[k + 1])
    points = {
        k
        for k in range(1, n)
        for a, b in rebuilds
        if samples[k - 1][1] <= b and min(first_written[k], samples[k][1] + lag_s) >= a
    }
    best: dict = {"at": -1}
    seen: set = set()
    stack: list[tuple[int, PoolState, int]] = [(0, PoolState(), 0)]
    while stack and len(seen) < budget:
        k, st, rebuilt = stack.pop()
        if (k, st) in seen:
            continue
        seen.add((k, st))
        if k == n:
            return True, {"rebuilt": rebuilt, "nodes": len(seen)}
        starts = [(st, rebuilt)]
        if k in points:
            other = _takeover_state(samples, intents, k, cfg, window_s)
            if other != st:
                starts.insert(0, (other, rebuilt + 1))  # explored after the carried state
        s = samples[k][0]
        want = _key(by_cause.get(s.event_id, []))
        for start, r in starts:
            nxt, got = decide_sample(start, s, cfg)
            if _key(got) == want:
                stack.append((k + 1, nxt, r))
            elif k > best["at"]:
                best = {"at": k, "event_id": s.event_id, "committed": want, "decided": _key(got)}
    best["nodes"] = len(seen)
    return False, best


def gpu_stage_walk(
    gpu: str,
    intents: Sequence[tuple[PoolIntent, float]],
    commands: Sequence[tuple[dict, float]],
    ends: Mapping[str, float],
    lag_s: float,
) -> int:
    """One GPU's intents in the order its GPU stage applies them against its replica commands
    (module docstring). Returns how many lends met a held replica lease (no grant, rightly)."""
    ids = {i.intent_id for i, _ in intents}
    stray = [
        c["command_id"]
        for c, _ in commands
        if (_replica_kind(c, "grant") or _replica_kind(c, "revoke")) and c["cause_event_id"] not in ids
    ]
    assert not stray, f"{gpu}: replica commands caused by no committed pool intent of the GPU: {stray[:5]}"
    twice = [
        lid for lid, n in Counter(c["lease_id"] for c, _ in commands if _replica_kind(c, "revoke")).items() if n > 1
    ]
    assert not twice, f"{gpu}: replica leases revoked more than once: {twice}"
    caused: dict[str, list[dict]] = {}
    for c, _ in commands:
        caused.setdefault(c["cause_event_id"], []).append(c)
    held: str | None = None
    on_held = 0
    for i, t in intents:
        mine = caused.get(i.intent_id, [])
        grants = [c for c in mine if _replica_kind(c, "grant")]
        revokes = [c for c in mine if _replica_kind(c, "revoke")]
        other = [c for c in mine if c.get("lease_kind") != "replica"]
        deadline = max(
            (c["expires_at"] for c, tc in commands if c["lease_id"] == held and c["kind"] != "revoke" and tc <= t),
            default=0.0,
        )
        gone = held is not None and min(ends.get(held, float("inf")), deadline) <= t + lag_s
        what = f"{gpu}: {i.action} intent {i.intent_id} of {i.replica}"
        if i.action == LEND:
            assert not revokes, f"{what} gave {[(c['kind'], c['lease_id']) for c in revokes]}"
            again = grants[1:] if not held or gone else grants
            assert not again, (
                f"{what}: replica lease granted again while lent: {[c['lease_id'] for c in again]} "
                f"while {held or grants[0]['lease_id']} was held"
            )
            assert grants or held, f"{what} lost: no replica grant, and the GPU held no replica lease"
            assert all(c["kind"] == "revoke" for c in other) and len(other) <= 1 and (grants or not other), (
                f"{what} gave {[(c['kind'], c['lease_id']) for c in other]} beside its grant"
            )
            if grants:
                g = grants[0]
                assert g["epoch"] >= i.epoch and g.get("group_id") == f"{i.replica}#{i.epoch}", (
                    f"{what}: grant {g['lease_id']} in gang {g.get('group_id')} at epoch {g['epoch']}, intent epoch {i.epoch}"
                )
                held = g["lease_id"]
            else:
                on_held += 1
        else:
            assert not grants and not other and len(revokes) <= 1, (
                f"{what} gave {[(c['kind'], c['lease_id']) for c in mine]}"
            )
            assert not revokes or revokes[0]["lease_id"] == held, (
                f"{what} revoked {revokes[0]['lease_id']}, the GPU held {held}"
            )
            assert revokes or not held or gone, f"{what} lost: no revoke of the held replica lease {held}"
            held = None
    return on_held
