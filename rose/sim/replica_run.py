"""Replica leases in the simulator (docs/contract.md §7): whole serving replicas lent to rollout
in the trough and reclaimed before the pool's load needs them. `ReplicaLeases` models the
executor's replica path for a fleet's replicas: drain (the router sends the replica nothing new
and its in-flight requests finish in the serving model), lend (rollout on the whole replica at
its solo rate, started from the node's warm pool), reclaim (stop rollout, its partial work handed
on; wake the serving engine; readmit). `ReplicaRun` (`rose-replica`) drives it by the live
scheduler's pool stage (`rose.policy.pool_stage`, around `rose.policy.pool.decide_pool`) on its
replicas' telemetry every bin; `rose` by the same stage on the scheduling core's samples and the
core's commands (`rose.sim.lease_kinds_run`). The model and its constants:
docs/simulator.md "Replica leases".
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import replace

import numpy as np

from rose.config import ExecutorConfig
from rose.contract.events import Latency, Telemetry
from rose.policy.pool import PoolConfig, check_pool_config
from rose.policy.pool_records import LEND, PoolIntent, PoolSample
from rose.policy.pool_stage import PoolState, decide_sample, fold_sample, sample_of
from rose.sim.models import NODE_GPUS, wake_s
from rose.sim.runs import Run, RunContext, fetch_bytes, lease_hours, ready_fraction
from rose.sim.serving_model import ServingSim
from rose.sim.warm_starts import WarmPools

# Reclaim: rollout is gone by the executor's revoke deadline (SIGKILL then: ExecutorConfig), the
# serving engine wakes (models.wake_s of its own weights per GPU: vLLM level-1 wake-up), and
# it is readmitted (PoolConfig.readmit_s: an assumption until `rose bench replica`).
STOP_ROLLOUT_S = ExecutorConfig.revoke_deadline_s
# Drain: a replica whose serving model holds fewer requests (running and queued, a fluid) than
# this has drained; one that has not within DRAIN_TIMEOUT_S is readmitted and its grant
# rejected (executor.drain_timeout_s, docs/contract.md §7; the value is an assumption).
DRAINED_REQUESTS = 0.5
DRAIN_TIMEOUT_S = 30.0
SERVING, DRAINING, LENT, RECLAIMING = range(4)
STATES = ("serving", "draining", "lent", "reclaiming")  # serving_state in telemetry, by index


def sim_pool_config(ctx: RunContext, serving_wake_s: float) -> PoolConfig:
    """The pool decision's settings in the simulator: the run's (`SimConfig.replica_pool`, by default
    the product's: forecast, window, bin, headroom, readmission), the capacity a replica is provisioned for
    (`RunContext.replica_capacity_rps`), the serving engine's own wake-up, the executor's stop
    bound, and the decision's latency: one bin (it decides at each bin's end) and the window
    before its commands act."""
    base = ctx.replica_pool
    return replace(
        base,
        replica_capacity_rps=ctx.replica_capacity_rps,
        wake_s=serving_wake_s,
        stop_rollout_s=STOP_ROLLOUT_S,
        decision_latency_s=base.bin_s + ctx.dt,
    )


def replica_pool_config(ctx: RunContext, sim: ServingSim) -> PoolConfig:
    """`sim_pool_config` with the wake-up of `sim`'s serving engine."""
    return sim_pool_config(ctx, wake_s(sim.model.weight_bytes_per_gpu, ctx.gpu))


def rollout_gpus_of_replica(ctx: RunContext, sim: ServingSim) -> int:
    """The GPUs of a lent replica that form whole rollout groups: all of them when the rollout's
    TP divides serving's, none otherwise."""
    return (sim.tp // ctx.rollout.tp) * ctx.rollout.tp


class ReplicaLeases:
    """The executors' replica path over one fleet's serving replicas, and its figures. It adds
    its rollout work, lease time and weight fetches to `run`'s ledger and tallies; the caller says
    which replicas to drain and which to reclaim."""

    def __init__(self, run: Run, sim: ServingSim, warm: WarmPools) -> None:
        ctx = run.ctx
        self.run, self.ctx, self.sim, self.warm = run, ctx, sim, warm
        R, self.tp = sim.replicas, sim.tp
        self.cfg = replica_pool_config(ctx, sim)
        check_pool_config("sim", self.cfg)
        self.back_s = self.cfg.stop_rollout_s + self.cfg.wake_s + self.cfg.readmit_s  # lent -> serving
        self.state = np.zeros(R, dtype=np.int8)
        self.since = np.zeros(R)  # when the replica entered its state
        self.back_at = np.zeros(R)  # reclaiming: when it serves again
        self.late = np.zeros(R, dtype=bool)  # reclaiming: the pool's load needed it already
        self.w = np.zeros(R)  # in-flight rollout work of each lent replica
        self.ready_at = np.zeros(R)  # when its rollout worker decodes
        self.version = np.full(R, -1, dtype=np.int64)  # policy version its node holds, -1 none
        # a lent replica: its GPUs that form whole rollout groups, at the rate of a GPU whose
        # serving engine sleeps (it keeps its runtime reserve), no interference
        mem = ctx.gpu.mem_bytes - sim.engine.runtime_reserve_bytes
        self.usable = rollout_gpus_of_replica(ctx, sim)
        self.rate = self.usable * float(ctx.rollout.rate(mem))
        self.batch = self.usable * float(ctx.rollout.batch_for(mem))
        self.recent: deque[float] = deque(maxlen=max(1, round(self.cfg.bin_s / ctx.dt)))  # pool load, one bin
        self.lends = self.drained = self.drain_timeouts = self.reclaims_late = 0
        self.drain_s = 0.0  # summed over the drains that finished
        self.replica_gpu_s = 0.0
        self.was_out = np.zeros(R, dtype=bool)  # the last window's replicas out of the router
        self.gain = np.zeros(R)  # and their rollout work in it

    def serving_gpus(self) -> np.ndarray:
        """Per GPU, whether its replica serves (serving or draining: it counts in the SLO tally)."""
        return np.repeat((self.state == SERVING) | (self.state == DRAINING), self.tp)

    def out_gpus(self) -> int:
        return self.tp * int((self.state != SERVING).sum())

    def lent_gpus(self) -> int:
        return self.usable * int((self.state == LENT).sum())

    def tallies(self) -> dict:
        return {
            "drain_timeouts": self.drain_timeouts,
            "mean_drain_s": round(self.drain_s / self.drained, 3) if self.drained else None,
            "reclaim_to_serving_s": round(self.back_s, 3),
        }

    def step(self, t1: float, st) -> list[int]:
        """One window: the lent replicas' rollout, the lease time, the late reclaims, then the
        executors at the window's end (`advance`). The replicas whose drain timed out."""
        c, run = self.ctx, self.run
        lent = self.state == LENT
        self.was_out = self.state != SERVING  # this window's, for the share-all gap (lease_kinds_run)
        gain = np.where(lent, self.rate * c.dt, 0.0) * ready_fraction(t1, c.dt, self.ready_at)
        self.gain = gain
        run.ledger.progress(self.w, np.full(self.w.size, self.batch / 2.0), gain)
        run.harvested += float(gain.sum())
        if run.lease_start_s is None and gain.any():
            run.lease_start_s = t1 - c.dt * float(ready_fraction(t1, c.dt, self.ready_at)[gain > 0].max())
        out = self.out_gpus()
        self.replica_gpu_s += out * c.dt
        run.lease_gpu_s += out * c.dt
        run.lease_share_s += self.usable * int(lent.sum()) * c.dt
        self.account_need(st)
        return self.advance(t1)

    def account_need(self, st) -> None:
        """A reclaim is late when, before its replica serves again, the pool's load (arrivals over
        the last bin) exceeds what its serving replicas carry at the provisioned capacity."""
        self.recent.append(float(st.rps[:: self.tp].sum()))
        load = sum(self.recent) / len(self.recent)
        if load > int((self.state == SERVING).sum()) * self.cfg.replica_capacity_rps:
            newly = (self.state == RECLAIMING) & ~self.late
            self.reclaims_late += int(newly.sum())
            self.late |= newly

    def advance(self, t1: float) -> list[int]:
        """The executors at the window's end: drained replicas are lent (their rollout starts from
        the node's warm pool), a drain past its timeout is readmitted, reclaimed replicas whose
        wake-up and readmission are done serve again (from the next window, as the router's).
        The replicas whose drain timed out."""
        sim = self.sim
        timed_out = []
        for r in np.flatnonzero(self.state == DRAINING).tolist():
            if sim.N[r] + sim.qn[r] < DRAINED_REQUESTS:
                self.drain_s += t1 - float(self.since[r])
                self.drained += 1
                self.state[r], self.since[r] = LENT, t1
                self.lend(r, t1)
            elif t1 - self.since[r] >= DRAIN_TIMEOUT_S:
                self.drain_timeouts += 1
                self.state[r], self.since[r], self.back_at[r] = RECLAIMING, t1, t1 + self.cfg.readmit_s
                timed_out.append(r)
        back = (self.state == RECLAIMING) & (self.back_at <= t1)
        self.state[back] = SERVING
        self.since[back] = t1
        self.late[back] = False
        return timed_out

    def lend(self, r: int, t1: float) -> None:
        """Rollout starts on drained replica r: its worker from the node's warm pool (one for the
        replica's GPUs), the parked continuations first, the weights it missed."""
        c, run = self.ctx, self.run
        if self.usable == 0:
            run.leases_unusable += 1
            self.ready_at[r] = math.inf
            return
        self.ready_at[r] = t1 + self.warm.start(r * self.tp // NODE_GPUS, t1)
        steps = run.ledger.steps()
        run.weight_bytes += fetch_bytes(np.full(self.usable, self.version[r]), steps, float(c.wfull), c.delta_ratio)
        run.weight_bytes_full += float(c.wfull) * self.usable
        self.version[r] = steps
        self.w[r] = run.ledger.unpark(self.batch / 2.0)

    def drain(self, r: int, t1: float) -> None:
        """A lend: replica r leaves the router and drains (from the next window)."""
        self.state[r], self.since[r] = DRAINING, t1
        self.lends += 1

    def reclaim(self, replicas: Iterable[int], t1: float) -> None:
        """Reclaims: a lent replica's rollout stops (its episodes handed on as continuations) and
        it serves again after the stop, the wake-up and the readmission; a draining one is
        readmitted."""
        stopped = np.zeros(self.w.size, dtype=bool)
        for r in replicas:
            stopped[r] = self.state[r] == LENT
            self.back_at[r] = t1 + (self.back_s if stopped[r] else self.cfg.readmit_s)
            self.state[r], self.since[r], self.late[r] = RECLAIMING, t1, False
            self.run.revokes += 1
        if stopped.any():
            wv = self.w[stopped]
            self.run.ledger.park(wv, np.full(wv.size, self.batch))
            self.w[stopped] = wv

    def synced(self, steps: int) -> None:
        self.version[self.state == LENT] = steps


def stage_bin(stage: PoolState, samples: list[PoolSample], cfg: PoolConfig) -> tuple[PoolState, tuple[PoolIntent, ...]]:
    """The pool stage on one bin's samples (one per GPU): all folded, the newest decided (the
    live stage decides every sample; the simulator once a bin, a latency its horizon counts)."""
    samples = sorted(samples, key=lambda s: (s.ts, s.event_id))
    for s in samples[:-1]:
        stage = fold_sample(stage, s, cfg)
    return decide_sample(stage, samples[-1], cfg)


class ReplicaRun(Run):
    """Static pool + replica leases (`rose-replica`): the pool stage on the replicas' telemetry
    every bin, its intents carried out by the executors' drain -> lend -> reclaim per replica
    (no co-resident leases, so no GPU stage between), the router's traffic to serving replicas
    only."""

    sim: ServingSim  # always given one: its replicas are lent
    own_serving = harvests = delta_weights = True

    def __init__(self, name: str, ctx: RunContext, sim: ServingSim | None) -> None:
        assert sim is not None  # the serving replicas it lends (simulate() gives one)
        super().__init__(name, ctx, sim)
        warm = WarmPools(
            -(-sim.n // NODE_GPUS), ctx.warm_workers, ctx.lease_start_s, ctx.cold_start_s, ctx.warm_build_s
        )
        self.rep = ReplicaLeases(self, sim, warm)
        self.cfg, self.tp = self.rep.cfg, sim.tp
        self.per_bin = max(1, round(self.cfg.bin_s / ctx.dt))
        self.stage = PoolState()  # the pool stage's window and pending intents
        self.bin_max = {k: np.zeros(sim.n) for k in ("ttft", "tpot")}
        self.bin_rps = np.zeros(sim.n)  # summed over the bin's windows
        self.decisions = 0

    # hooks
    def admitting(self) -> np.ndarray:
        return self.rep.state == SERVING

    def tallied(self) -> np.ndarray:
        return self.rep.serving_gpus()

    def in_flight(self) -> float:
        return float(self.ded_w.sum() + self.rep.w.sum())

    def rollout_gpus(self) -> int:
        return self.ctx.M + self.rep.lent_gpus()

    def leased_counts(self) -> tuple[int, int]:
        return self.rep.out_gpus(), self.rep.lent_gpus()

    def synced(self, steps: int) -> None:
        self.rep.synced(steps)

    def policy_tallies(self) -> dict:
        rep = self.rep
        return {
            "grants": rep.lends,
            **rep.tallies(),
            "pool_decisions": self.decisions,
            "warm_starts": rep.warm.warm_starts,
            "cold_starts": rep.warm.cold_starts,
            **lease_hours(rep.replica_gpu_s, 0.0, rep.reclaims_late),
        }

    def extra(self, w: int, t1: float, st) -> None:
        self.rep.step(t1, st)
        for k, v in (("ttft", st.ttft_p99_ms), ("tpot", st.tpot_p99_ms)):
            np.maximum(self.bin_max[k], v, out=self.bin_max[k])
        self.bin_rps += st.rps
        if (w + 1) % self.per_bin == 0:
            self.decide(w, t1, st)

    def decide(self, w: int, t1: float, st) -> None:
        """The pool stage on this bin's telemetry (with the window's before it), its intents
        carried out: each replica's once (an intent names each of its GPUs)."""
        samples = [sample_of(e, 0, None, self.cfg.headroom) for e in self.bin_events(w, t1, st)]
        self.stage, intents = stage_bin(self.stage, samples, self.cfg)
        self.decisions += 1
        moves = {i.replica: i.action for i in intents}
        for rid, action in moves.items():
            if action == LEND:
                self.rep.drain(int(rid[1:]), t1)
        self.rep.reclaim((int(rid[1:]) for rid, action in moves.items() if action != LEND), t1)

    def bin_events(self, w: int, t1: float, st) -> list[Telemetry]:
        """One telemetry event per GPU summarising the bin that ends at t1: its mean rps and
        worst p99s over the bin's windows (what `pool_view` keeps of a bin's events), the
        replica's state now. Then the bin's figures start again."""
        slo, total, tp = self.ctx.slo, st.mem_total_bytes, self.tp
        rps = (self.bin_rps / self.per_bin).tolist()
        ttft, tpot = (self.bin_max[k].tolist() for k in ("ttft", "tpot"))
        util, used, rmem = (
            np.clip(st.gpu_util, 0.0, 1.0).tolist(),
            st.mem_used_bytes.tolist(),
            st.rollout_mem_bytes.tolist(),
        )
        qd = st.queue_depth.tolist()
        state = self.rep.state
        out = [
            Telemetry(
                f"sim/{g}@{w}", t1, f"node-{g // NODE_GPUS}", f"sim/{g}", "sim", util[g], total, used[g], rmem[g],
                Latency(ttft[g], tpot[g]), slo, rps[g], qd[g], replica=replica_name(g // tp),
                serving_state=STATES[state[g // tp]],
            )
            for g in range(len(rps))
        ]  # fmt: skip
        for v in self.bin_max.values():
            v[:] = 0.0
        self.bin_rps[:] = 0.0
        return out


def replica_name(r: int) -> str:
    """Simulated replica r's id in telemetry (sorted by id = by index, as the pool decision chooses)."""
    return f"r{r:05d}"
