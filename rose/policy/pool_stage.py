"""The pool stage (docs/scheduler.md "Pool decisions and partitioning"): a sample of an event
(`sample_of`, written by the GPU stage), the fold of samples into a pool's
window and its pending intents (`PoolState`), and the decision of each sample into intents.

Pure: no I/O, no clock. An intent's id is a hash of its cause (the sample's `event_id`), its
replica and its action, so a takeover that re-decides the same samples writes the same intents,
and the GPU stage applies each intent id once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from rose.contract.events import Telemetry
from rose.contract.immutable import immutable
from rose.policy.pool import PoolConfig, PoolDecision, PoolView, decide_pool, has_headroom, pool_view
from rose.policy.pool_records import LEND, RECLAIM, PoolIntent, PoolSample, intent_id


def sample_of(event: Telemetry, epoch: int, lease: tuple[str, int] | None, headroom: float) -> PoolSample:
    """The sample of one admitted event: `epoch` its GPU's floor, `lease` its live replica lease
    (id, epoch), `headroom` the pool's grant headroom."""
    ok = event.serving_state == "serving" and has_headroom(event, headroom)
    lid, lep = lease if lease is not None else ("", 0)
    return PoolSample(
        event.event_id, event.ts, event.pool, event.gpu, event.replica_id, event.serving_state, event.rps,
        ok, event.mem_total_bytes, epoch, lid, lep,
    )  # fmt: skip


# ---------------------------------------------------------------- the fold


@immutable
class PoolState:
    """A pool's whole state in the pool stage: its samples over the window (log order) and its intents not yet seen in telemetry, per replica.
    Everything in it is rebuilt by a takeover from the two topics' last `window_s`."""

    samples: tuple[PoolSample, ...] = ()
    pending: tuple[PoolIntent, ...] = ()  # one per replica (its first GPU's record)


def fold_sample(state: PoolState, s: PoolSample, cfg: PoolConfig) -> PoolState:
    """Add a sample: samples older than the window before it leave, and a pending intent leaves
    once a sample of its replica shows it taken up (a lent replica no longer `serving`, a
    reclaimed one `reclaiming` or `serving` without the lease) or once it is older than the
    window (a takeover could not know it any longer, so neither may the uninterrupted run)."""
    newest = max(s.ts, state.samples[-1].ts) if state.samples else s.ts
    start = newest - cfg.window_s
    kept = tuple(x for x in state.samples if x.ts > start) + (s,)
    pending = tuple(p for p in state.pending if p.ts > start and not _taken_up(p, s))
    return PoolState(kept, pending)


def fold_intent(state: PoolState, i: PoolIntent) -> PoolState:
    """Add an intent the stage wrote (or, on takeover, read back): it replaces its replica's."""
    return PoolState(state.samples, tuple(p for p in state.pending if p.replica != i.replica) + (i,))


def _taken_up(p: PoolIntent, s: PoolSample) -> bool:
    if s.replica != p.replica or s.ts < p.ts:
        return False
    if p.action == LEND:
        return s.serving_state != "serving"
    return s.serving_state == "reclaiming" or (s.serving_state == "serving" and not s.lease_id)


# ---------------------------------------------------------------- the decision


def decide_sample(state: PoolState, s: PoolSample, cfg: PoolConfig) -> tuple[PoolState, tuple[PoolIntent, ...]]:
    """Fold a sample and decide on it: the pool's view with pending lends counted as draining and
    pending reclaims as reclaiming, `decide_pool` on it, and one intent per GPU of each replica the
    decision moves that no pending intent moves already. The state with the new intents folded."""
    state = fold_sample(state, s, cfg)
    decision, view_samples = decision_of(state, cfg)
    if decision is None:
        return state, ()
    moving = {p.replica: p.action for p in state.pending}
    out: list[PoolIntent] = []
    for action, replicas in ((LEND, decision.lend), (RECLAIM, decision.reclaim)):
        for rid in replicas:
            if moving.get(rid) != action:
                out.extend(_intents(s, decision, rid, action, view_samples[rid]))
    for i in out:
        state = fold_intent(state, i)
    return state, tuple(out)


def decision_of(state: PoolState, cfg: PoolConfig) -> tuple[PoolDecision | None, dict[str, list[PoolSample]]]:
    """The pool decision on the state, and each replica's newest sample per GPU (sorted by GPU)."""
    view = effective_view(state, cfg)
    if view is None:
        return None, {}
    newest: dict[tuple[str, str], PoolSample] = {}
    for x in state.samples:
        newest[(x.replica, x.gpu)] = x
    per: dict[str, list[PoolSample]] = {}
    for (rid, _), x in sorted(newest.items()):
        per.setdefault(rid, []).append(x)
    return decide_pool(view, cfg), per


def effective_view(state: PoolState, cfg: PoolConfig) -> PoolView | None:
    """The pool's view with each pending lend counted as draining, each pending reclaim as
    reclaiming: what the replicas will be doing once the intents are taken up."""
    pending = {p.replica: p.action for p in state.pending}
    return pool_view([_as_pending(x, pending.get(x.replica)) for x in state.samples], cfg)


def _as_pending(x: PoolSample, action: str | None) -> PoolSample:
    if action == LEND and x.serving_state == "serving":
        return replace(x, serving_state="draining")
    if action == RECLAIM and x.serving_state in ("draining", "lent"):
        return replace(x, serving_state="reclaiming")
    return x


def _intents(cause: PoolSample, d: PoolDecision, rid: str, action: str, gpus: list[PoolSample]) -> list[PoolIntent]:
    iid = intent_id(cause.event_id, rid, action)
    gang_epoch = max(g.epoch for g in gpus) + 1
    reason = d.explain()
    return [
        PoolIntent(
            iid, cause.ts, cause.pool, cause.event_id, rid, action, g.gpu, len(gpus), g.mem_total_bytes,
            gang_epoch if action == LEND else g.lease_epoch, "" if action == LEND else g.lease_id, reason,
        )
        for g in gpus
    ]  # fmt: skip


def run_stage(
    samples: Iterable[PoolSample],
    cfg: PoolConfig,
    decide_from: int = 0,
    written: Iterable[PoolIntent] = (),
) -> tuple[PoolState, tuple[PoolIntent, ...]]:
    """The stage over a pool's samples in log order, the first `decide_from` only folded: a
    takeover's catch-up, each intent read back from `written` folded after the sample it names as
    its cause. The intents decided from there."""
    by_cause: dict[str, list[PoolIntent]] = {}
    for i in written:
        by_cause.setdefault(i.cause_event_id, []).append(i)
    st = PoolState()
    out: list[PoolIntent] = []
    for n, s in enumerate(samples):
        if n < decide_from:
            st = fold_sample(st, s, cfg)
            for i in by_cause.get(s.event_id, ()):
                st = fold_intent(st, i)
        else:
            st, new = decide_sample(st, s, cfg)
            out.extend(new)
    return st, tuple(out)
