"""ROSE's rollout side in the simulator (`rose`, `rose-coresident`): apart from the other runs
because it alone drives the system's own scheduling core, lease machine and guard rule
(docs/simulator.md "ROSE's executors and guard in the simulator")."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import numpy as np

from rose.contract.events import Latency, LeaseState, Telemetry
from rose.executor import lease_machine as lm
from rose.executor.guard import tripped_next
from rose.obs.stats import percentile
from rose.policy.compute_share import predicted_ratio
from rose.policy.core import Applied, Batch, SchedulingCore
from rose.policy.deferral import DEFERRED_KEPT, deferrable
from rose.policy.lease_policy import free_memory, memory_margin, worker_started
from rose.policy.pool import PoolConfig
from rose.policy.pool_records import PoolIntent
from rose.sim.models import NODE_GPUS
from rose.sim.runs import SHARE_ALL_MEM_FRAC, SHARE_ALL_SHARE, Run, RunContext, fetch_bytes, lease_hours, ready_fraction
from rose.sim.serving_model import ServingSim
from rose.sim.warm_starts import WarmPools

# The guard's hysteresis rule over a whole fleet at once: tripped_next is elementwise over numpy
# arrays (its docstring says so); its annotation names the one-GPU case.
fleet_tripped_next = cast(Callable[[np.ndarray, np.ndarray, float, float], np.ndarray], tripped_next)

# Causes of the rollout work share-all does on a serving GPU-window that ROSE does not (one per
# GPU-window; docs/simulator.md "Where ROSE harvests less than share-all"), and why the policy's
# view held no lease (its last decision's reason)
GAP_CAUSES = ("no_lease", "lease_start", "paused", "share_cap", "above_share_all")
NO_LEASE_WHY = ("below_threshold", "cooldown", "memory", "other")


class RoseRun(Run):
    """Static pool + leases: each serving GPU's telemetry through the scheduling core, the
    commands through the executors' lease machine, the executors' guard on every window."""

    sim: ServingSim  # always given one: rollout shares the serving GPUs
    own_serving = harvests = delta_weights = True

    _PEND = ("ts", "util", "used", "rmem", "ttft", "tpot", "rps", "qd")

    def __init__(self, name: str, ctx: RunContext, sim: ServingSim | None) -> None:
        assert sim is not None  # the serving GPUs it shares (simulate() gives one)
        super().__init__(name, ctx, sim)
        G = ctx.G
        self.core = SchedulingCore(ctx.policy, pools=self.pools())
        self._intents: tuple[PoolIntent, ...] = ()  # the pool stage's, for the next core batch
        self._published: list[LeaseState] = []  # lease states, until the next window's core batch
        self.names = [f"sim/{g}" for g in range(G)]  # GPU ids as the policy and the executors know them
        self.nodes = [f"node-{g // NODE_GPUS}" for g in range(G)]
        # each GPU's serving replica and what it is doing, as telemetry says ("": the GPU itself)
        self.replica_of = [""] * G
        self.serving_state = ["serving"] * G
        self.machines = [lm.initial(name) for name in self.names]
        self.view_lease = np.zeros(G, dtype=bool)  # the policy's view holds a lease
        # the executors' leases, as their lease machines hold them
        self.leased = np.zeros(G, dtype=bool)
        self.mem = np.zeros(G, dtype=np.int64)
        self.share = np.zeros(G)
        self.exp = np.zeros(G)
        self.batch = np.zeros(G)  # episodes per GPU the lease holds (0: too small to run rollout)
        self.worker = np.zeros(G, dtype=bool)  # the lease's rollout worker, started by the machine
        self.worker_paused = np.zeros(G, dtype=bool)
        # when the worker decodes after its start (a wake-up) or resume, and whether that wait is a start's
        self.ready_at = np.zeros(G)
        self.starting = np.zeros(G, dtype=bool)
        self.tripped = np.zeros(G, dtype=bool)  # the executors' local guard, per serving GPU
        # each node's warm pool: when each of its warm workers is (or will be) ready
        self.warm = WarmPools(
            -(-G // NODE_GPUS), ctx.warm_workers, ctx.lease_start_s, ctx.cold_start_s, ctx.warm_build_s
        )
        self._gang_wait: dict[str, float] = {}  # a gang's one worker: its start cost, by group id
        self.w = np.zeros(G)
        # telemetry held back (rose.policy.deferral), newest first; `held` of them per GPU
        self.held = np.zeros(G, dtype=np.int64)
        self.pend = [{k: np.zeros(G) for k in self._PEND} for _ in range(DEFERRED_KEPT)]
        self.acc_ttft = np.zeros(G)
        self.acc_tpot = np.zeros(G)
        self.version = np.full(G, -1, dtype=np.int64)  # policy version held by the node, -1 none
        self.grant_room: dict[int, int] = {}  # GPU -> free memory after margin at its grant (checks)
        # the grant rule's prediction: serving's load under a lease at its grant, by GPU until its
        # worker starts, then (predicted, the load on the start event) (`grant_prediction`)
        self._predicted: dict[int, float] = {}
        self.predictions: list[tuple[float, float]] = []
        self._ended = np.zeros(G, dtype=bool)  # leases ended in the current apply
        self._granted: list[int] = []
        # beside share-all: its per-GPU rate (its memory, SHARE_ALL_SHARE, the same profile), the
        # work it would do that ROSE does not, by cause (episodes), and ROSE's own on serving GPUs
        sa_mem = np.full(G, int((ctx.gpu.mem_bytes - sim.static_bytes) * SHARE_ALL_MEM_FRAC), dtype=np.int64)
        self.share_all_rate = ctx.rollout_rate(sa_mem, SHARE_ALL_SHARE) if ctx.profile is not None else np.zeros(G)
        self.gap = dict.fromkeys(GAP_CAUSES, 0.0)
        self.no_lease_gap = dict.fromkeys(NO_LEASE_WHY, 0.0)
        self.paused_gap = {"guard": 0.0, "throttle": 0.0}
        self.why_none = np.full(G, NO_LEASE_WHY.index("other"), dtype=np.int64)  # index into NO_LEASE_WHY

    def pools(self) -> dict[str, PoolConfig]:
        """The pools whose replicas replica leases may take (none: co-resident leases only)."""
        return {}

    def pooled(self, applied: Applied, ts: float) -> None:
        """The pool samples of a core batch (none without pools)."""

    def synced(self, steps: int) -> None:
        self.version[self.leased & (self.batch > 0)] = steps

    def policy_tallies(self) -> dict:
        return {
            "grants": self.grants,
            "expiries": self.expiries,
            "guard_pauses": self.guard_pauses,
            "decide_calls": self.decide_calls,
            "warm_starts": self.warm.warm_starts,
            "cold_starts": self.warm.cold_starts,
            **lease_hours(0.0, self.lease_gpu_s, 0),
            "grant_prediction": grant_prediction(self.predictions, self.ctx.policy.grant_headroom),
        }

    def in_flight(self):
        return float(self.ded_w.sum() + self.w.sum())

    def rollout_gpus(self):
        return self.ctx.M + int((self.leased & (self.batch > 0)).sum())

    def leased_counts(self):
        return int(self.leased.sum()), int(self.running().sum())

    def running(self) -> np.ndarray:
        return self.worker & ~self.worker_paused & (self.batch > 0)

    def extra(self, w, t1, st):
        c, pc = self.ctx, self.ctx.policy
        run_mask = self.running()
        ready = ready_fraction(t1, c.dt, self.ready_at)  # 1 on GPUs whose worker is not waking or resuming
        rate = np.where(run_mask, c.rollout_rate(self.mem, self.share), 0.0) * ready
        self.ledger.progress(self.w, self.batch / 2.0, rate * c.dt)
        self.account_gap(rate * c.dt, self.share_all_rate * (c.dt * c.share_all_ready(t1)), ready)
        self.starting &= self.ready_at > t1
        self.lease_gpu_s += float(self.leased.sum()) * c.dt
        self.lease_share_s += float(self.share[run_mask].sum()) * c.dt
        if self.lease_start_s is None and (run_mask & (ready > 0.0)).any():
            self.lease_start_s = t1 - c.dt * float(ready[run_mask].max())
        # the executors' local guard, on the window's latency sample
        tripped = fleet_tripped_next(
            self.tripped, min_headroom(st.ttft_p99_ms, st.tpot_p99_ms, c.slo), pc.revoke_headroom, pc.grant_headroom
        )
        self.guard_pauses += int((tripped & ~self.tripped & self.leased).sum())
        for g in np.flatnonzero(tripped != self.tripped).tolist():
            self._step(g, lm.GuardTrip() if tripped[g] else lm.GuardClear(), t1)
        self.tripped = tripped
        # the scheduler, every `decide_every` windows, on the worst p99 of those windows
        np.maximum(self.acc_ttft, st.ttft_p99_ms, out=self.acc_ttft)
        np.maximum(self.acc_tpot, st.tpot_p99_ms, out=self.acc_tpot)
        if (w + 1) % c.decide_every and w != c.n_win - 1:
            return
        commands = self.decide_all(w, t1, st)
        self.acc_ttft[:] = 0.0
        self.acc_tpot[:] = 0.0
        self.apply(commands, t1)

    def account_gap(self, mine: np.ndarray, share_all: np.ndarray, ready: np.ndarray) -> None:
        """One window's rollout work on each serving GPU, ROSE's (`mine`) beside share-all's
        (`share_all`), episodes: what share-all does that ROSE does not, under one cause per GPU;
        a running worker's part of the window before it decodes (1 - `ready`) is its start's, or
        its pause's when it resumed."""
        self.harvested += float(mine.sum())
        gap, leased = self.gap, self.leased
        none = ~leased
        if none.any():
            per = np.bincount(self.why_none[none], weights=share_all[none], minlength=len(NO_LEASE_WHY))
            for k, v in zip(NO_LEASE_WHY, per.tolist()):
                self.no_lease_gap[k] += v
            gap["no_lease"] += float(per.sum())
        live = leased & self.worker
        paused = self.worker_paused | (self.share <= 0.0)
        waiting = np.where(live & ~paused, share_all * (1.0 - ready), 0.0)  # waking up or resuming
        gap["lease_start"] += float(share_all[leased & ~self.worker].sum()) + float(waiting[self.starting].sum())
        guard = float(share_all[live & self.worker_paused].sum())
        throttle = float(share_all[live & ~self.worker_paused & (self.share <= 0.0)].sum())  # to share 0
        resuming = float(waiting[~self.starting].sum())
        self.paused_gap["guard"] += guard
        self.paused_gap["throttle"] += throttle + resuming
        gap["paused"] += guard + throttle + resuming
        # a live worker (one too small for an episode runs nothing): share-all's rate minus its own
        diff = np.where(live & ~paused, share_all * ready - mine, 0.0)
        gap["share_cap"] += float(diff[diff > 0].sum())
        gap["above_share_all"] -= float(diff[diff < 0].sum())

    def decide_all(self, w: int, ts: float, st) -> list:
        c, pc, slo = self.ctx, self.ctx.policy, self.ctx.slo
        ttft, tpot = self.acc_ttft, self.acc_tpot
        defer = deferrable(self.view_lease, min_headroom(ttft, tpot, slo), pc)
        if pc.group_size > 1:  # a gang is formed from its members' latest word: hold nothing back
            defer[:] = False
        vals = {
            "ts": ts,
            "util": st.gpu_util,
            "used": st.mem_used_bytes,
            "rmem": st.rollout_mem_bytes,
            "ttft": ttft,
            "tpot": tpot,
            "rps": st.rps,
            "qd": st.queue_depth,
        }
        pend = self.pend
        if defer.any():  # (nothing to hold back on a fleet whose GPUs all hold leases)
            for k, v in vals.items():
                for i in range(DEFERRED_KEPT - 1, 0, -1):
                    pend[i][k][defer] = pend[i - 1][k][defer]
                pend[0][k][defer] = v[defer] if isinstance(v, np.ndarray) else v
            self.held[defer] = np.minimum(self.held[defer] + 1, DEFERRED_KEPT)
            self.why_none[defer] = 0  # held back: headroom below the grant threshold
        call = np.flatnonzero(~defer)
        held = self.held[call].tolist()
        self.held[call] = 0
        total = st.mem_total_bytes
        util, used, rmem = st.gpu_util.tolist(), st.mem_used_bytes.tolist(), st.rollout_mem_bytes.tolist()
        rps, qd, lt, lp = st.rps.tolist(), st.queue_depth.tolist(), ttft.tolist(), tpot.tolist()
        names, nodes, view_lease = self.names, self.nodes, self.view_lease
        events: list[Telemetry] = []
        gpus = call.tolist()
        for g, n in zip(gpus, held):
            for p in pend[n - 1 :: -1] if n else ():  # the held-back events first, oldest first
                events.append(
                    _telemetry(
                        g,
                        f"d{int(p['ts'][g] / c.dt)}",
                        float(p["ts"][g]),
                        float(p["util"][g]),
                        total,
                        int(p["used"][g]),
                        int(p["rmem"][g]),
                        float(p["ttft"][g]),
                        float(p["tpot"][g]),
                        slo,
                        float(p["rps"][g]),
                        int(p["qd"][g]),
                        self.replica_of[g],
                        self.serving_state[g],
                    )
                )
            # this window's event: _telemetry(g, w, ...) with the GPU's names built once
            u = util[g]
            name = names[g]
            events.append(
                Telemetry(
                    f"{name}@{w}",
                    ts,
                    nodes[g],
                    name,
                    "serving",
                    0.0 if u < 0.0 else 1.0 if u > 1.0 else u,
                    total,
                    used[g],
                    rmem[g],
                    Latency(lt[g], lp[g]),
                    slo,
                    rps[g],
                    qd[g],
                    replica=self.replica_of[g],
                    serving_state=self.serving_state[g],
                )
            )
        # with the lease states the executors published since the last window, as they reach a
        # scheduler, and the pool stage's intents since then (docs/scheduler.md "Pool decisions and partitioning")
        applied = self.core.apply(Batch(lease_states=self._published, intents=self._intents, telemetry=events))
        self._published, self._intents = [], ()
        self.pooled(applied, ts)
        decisions = applied.decisions
        out = [(_index(cmd.gpu), cmd) for cmd in applied.intent_commands]  # a co-resident revoke first
        i = -1
        for g, n in zip(gpus, held):
            i += 1 + n  # this window's event comes after its held-back ones
            d = decisions[i]
            view_lease[g] = d.view.lease_id is not None
            self._check_prediction(g, d, applied.met[i], events[i])
            if not view_lease[g]:
                self.why_none[g] = no_lease_why(d.explain.reason)
            for other in d.others:  # a gang's other members
                self.view_lease[_index(other.gpu)] = other.lease_id is not None
            for cmd in d.commands:
                m = g if cmd.gpu == d.view.gpu else _index(cmd.gpu)
                out.append((m, cmd))
                if cmd.kind == "grant":
                    self.grant_room[m] = free_memory(total, used[m] - rmem[m], 0, rmem[m]) - memory_margin(total, pc)
        self.decide_calls += len(events)
        return out

    def _check_prediction(self, g: int, d, met, event: Telemetry) -> None:
        """On a co-resident grant, the load it predicts under the lease: the one `profile_share`
        holds to the grant rule (`max(load now, base load)` × the larger of the profile's ratio and
        the GPU's own estimate at the share); on its worker's start, what serving showed there."""
        if not d.explain.headroom:  # a decision that read no latency (an ignored event)
            return
        load = 1.0 - min(d.explain.headroom.values())
        grant = next((c for c in d.commands if c.kind == "grant" and c.gpu == d.view.gpu), None)
        if grant is not None and grant.lease_kind == "coresident" and grant.compute_share > 0.0:
            ratio = predicted_ratio(grant.compute_share, d.view.slowdown_per_share, self.ctx.policy)
            self._predicted[g] = max(load, d.view.base_load) * ratio
        elif g in self._predicted and met is not None and worker_started(met, event) and d.view.lease_id is not None:
            self.predictions.append((self._predicted.pop(g), load))

    def apply(self, commands: list, t1: float) -> None:
        """The executors: expiry, then the commands, each through the GPU's lease machine;
        effective from the next window."""
        c = self.ctx
        self._ended[:] = False
        self._granted = []
        for g in np.flatnonzero(self.leased & (self.exp <= t1)).tolist():
            self._step(g, lm.Tick(), t1)
        for g, cmd in commands:
            if cmd.kind == "revoke":
                self.revokes += 1
            elif cmd.kind == "throttle":
                self.throttles += 1
            self._step(g, lm.Received(cmd), t1)
        ended = self._ended
        if ended.any():
            wv = self.w[ended]
            self.ledger.park(wv, self.batch[ended])
            self.w[ended] = wv
        self.batch[~self.leased] = 0
        if self._granted:
            new = np.array(self._granted, dtype=np.int64)
            self.batch[new] = c.rollout.batch_for(self.mem[new])
            ok = new[self.batch[new] > 0]
            self.leases_unusable += int(new.size - ok.size)
            self.weight_bytes += fetch_bytes(self.version[ok], self.ledger.steps(), float(c.wfull), c.delta_ratio)
            self.weight_bytes_full += float(c.wfull) * ok.size
            self.version[ok] = self.ledger.steps()
            for g in ok.tolist():  # resume parked continuations first
                self.w[g] = self.ledger.unpark(self.batch[g] / 2.0)
        # a worker too small for the policy's weights and one episode holds nothing
        self.sim.set_rollout(slice(None), self.share, self.running(), np.where(self.batch > 0, self.mem, 0))

    def _step(self, g: int, inp, now: float) -> None:
        """One input to GPU g's lease machine, and its actions carried out: the modelled worker
        decodes `lease_start_s` after its start and `resume_s` after a resume, pauses at once and
        exits as soon as it is stopped; every lease state published is folded into the scheduling
        core."""
        before = self.machines[g]
        s, actions = lm.step(before, inp, now)
        if actions:  # (a renewal has none)
            while any(type(a) is lm.Stop for a in actions):
                self._act(g, actions, now)
                s, actions = lm.step(s, lm.WorkerExited(), now)
            self._act(g, actions, now)
        self.machines[g] = s
        old, new = before.lease, s.lease
        if new is old:  # the arrays below hold this lease already
            return
        if old is not None and (new is None or new.lease_id != old.lease_id):
            self._ended[g] = True
            if type(inp) is lm.Tick:
                self.expiries += 1
        if new is not None and (old is None or new.lease_id != old.lease_id):
            self.grants += 1
            self._granted.append(g)
        self.leased[g] = new is not None
        self.mem[g], self.share[g], self.exp[g] = (
            (new.mem_bytes, new.compute_share, new.expires_at) if new is not None else (0, 0.0, 0.0)
        )

    def _act(self, g: int, actions, now: float) -> None:
        for a in actions:
            t = type(a)
            if t is lm.Start:
                self.worker[g], self.worker_paused[g] = True, a.paused
                self.ready_at[g], self.starting[g] = now + self.start_wait(g, a, now), True
            elif t is lm.Pause or t is lm.Resume:
                self.worker_paused[g] = t is lm.Pause
                if t is lm.Resume:
                    self.ready_at[g] = max(self.ready_at[g], now + self.ctx.resume_s)
            elif t is lm.Throttle and self.share[g] <= 0.0 < a.compute_share:  # resumed from share 0
                self.ready_at[g] = max(self.ready_at[g], now + self.ctx.resume_s)
            elif t is lm.Stop:
                self.worker[g] = self.worker_paused[g] = False
            elif t is lm.Publish:
                self._published.append(a.state(now))

    def start_wait(self, g: int, a, now: float) -> float:
        """Seconds from a Start on GPU g to its worker decoding: a ready warm worker of the node's
        pool wakes up (and a new one is launched to replace it, ready `warm_build_s` after the
        lease decodes), else the worker starts cold. A gang starts one worker for its members."""
        if a.group_id and a.group_id in self._gang_wait:
            return self._gang_wait[a.group_id]
        wait = self.warm.start(g // NODE_GPUS, now)
        if a.group_id:
            self._gang_wait[a.group_id] = wait
        return wait


def min_headroom(ttft_ms: np.ndarray, tpot_ms: np.ndarray, slo: Latency) -> np.ndarray:
    """Per GPU, the smallest headroom over the SLO metrics, `1 - p99 / slo`."""
    return np.minimum(1.0 - ttft_ms / slo.ttft_p99, 1.0 - tpot_ms / slo.tpot_p99)


def no_lease_why(reason: str) -> int:
    """The index in NO_LEASE_WHY of a decision's reason for holding no lease: the grant rule's
    latency conditions (headroom, its streak, a rising trend, a load that leaves no share), the
    cooldown after a revoke, memory (free memory, KV growth), or anything else."""
    if "cooldown until" in reason:
        return 1
    if "_p99" in reason or "headroom" in reason or "serving load" in reason:
        return 0
    if "memory" in reason or "KV growth" in reason:
        return 2
    return 3


def _index(gpu: str) -> int:
    """The index of simulated GPU `sim/<i>`."""
    return int(gpu[4:])


def _telemetry(
    g: int,
    w,
    ts: float,
    util: float,
    total: int,
    used: int,
    rollout: int,
    ttft: float,
    tpot: float,
    slo: Latency,
    rps: float,
    qd: int,
    replica: str,
    serving_state: str,
) -> Telemetry:
    return Telemetry(
        f"sim/{g}@{w}",
        ts,
        f"node-{g // 8}",
        f"sim/{g}",
        "serving",
        0.0 if util < 0.0 else 1.0 if util > 1.0 else util,
        total,
        used,
        rollout,
        Latency(ttft, tpot),
        slo,
        rps,
        qd,
        replica=replica,
        serving_state=serving_state,
    )


def grant_prediction(pairs: list[tuple[float, float]], grant_headroom: float) -> dict:
    """How far serving's load on a co-resident lease's first window (its worker's start) fell from
    what the grant rule predicted at the grant, in fractions of the SLO: realized - predicted,
    over every start and over the starts predicted within 0.3 of the grant limit (`1 -
    grant_headroom`), where an error can cross the SLO. Quantiles by nearest rank."""

    def q(errs: list[float]) -> dict:
        return {
            "n": len(errs),
            **{k: percentile(errs, p, 4) for k, p in (("q50", 0.5), ("q90", 0.9), ("q99", 0.99), ("max", 1.0))},
        }

    near = 1.0 - grant_headroom - 0.3
    return {
        "all": q([r - p for p, r in pairs]),
        "near_limit": q([r - p for p, r in pairs if p >= near]),
    }
