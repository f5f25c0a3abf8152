"""`rose` in the simulator: both lease kinds, chosen per replica (docs/contract.md §7), through
the live scheduler's own path. Every telemetry window goes through the scheduling core given the
fleet's pool (`SchedulingCore(pools=...)`); the pool samples it returns are folded and decided
by the pool stage (`rose.policy.pool_stage`) at each bin's end; the intents it decides go back
into the core's next batch (`Batch.intents`), which turns them into the GPU's commands
(`rose.policy.replica_intents`: a co-resident lease revoked first, then the replica grant; a GPU
holding a replica lease skips `decide()`). Co-resident commands go through the executors' lease
machine as in `rose-coresident` (`rose.sim.rose_run`); replica commands through the executors'
replica path (`rose.sim.replica_run.ReplicaLeases`). docs/simulator.md "Both lease kinds".
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from rose.config import PolicyConfig
from rose.contract.events import Command, LeaseState
from rose.policy.core import Applied
from rose.policy.pool import LEASE_REPLICA, PoolConfig
from rose.policy.pool_records import PoolSample
from rose.policy.pool_stage import PoolState
from rose.sim.replica_run import (
    DRAINING,
    LENT,
    SERVING,
    STATES,
    ReplicaLeases,
    replica_name,
    replica_pool_config,
    rollout_gpus_of_replica,
    stage_bin,
)
from rose.sim.rose_run import RoseRun
from rose.sim.runs import RunContext, lease_hours
from rose.sim.serving_model import ServingSim

POOL = "serving"  # the pool every simulated GPU's telemetry names (rose_run)


def configured_pool(policy: PolicyConfig) -> PoolConfig:
    """The simulated pool's decision settings: the configuration's `[policy.pools.serving]` table
    where it has one (so `rose --config-file` plays an operator's forecast, window and headroom),
    else the product's defaults."""
    return policy.pools.get(POOL, PoolConfig())


class LeaseKindsRun(RoseRun):
    """Static pool + co-resident and replica leases: the scheduling core with the fleet's pool,
    the pool stage on its samples every bin, its intents in the core's next batch."""

    def __init__(self, name: str, ctx: RunContext, sim: ServingSim | None) -> None:
        super().__init__(name, ctx, sim)
        self.rep = ReplicaLeases(self, self.sim, self.warm)  # one warm pool per node for both kinds
        self.tp = self.sim.tp
        self.replica_of = [replica_name(g // self.tp) for g in range(ctx.G)]
        self.per_bin = max(1, round(self.rep.cfg.bin_s / ctx.dt))
        self.stage = PoolState()  # the pool stage's window and pending intents
        self.bin_samples: dict[str, list[PoolSample]] = {}  # the core's samples this bin, per GPU
        self.replica_lease: dict[int, Command] = {}  # GPU -> its replica lease's last grant or renew
        self.pool_decisions = self.replica_expiries = self.replica_rejected = 0

    def pools(self) -> dict[str, PoolConfig]:
        """The fleet's pool, where a lent replica can run rollout (a rollout TP that does not
        divide serving's leaves it nothing to run: an operator would not enable replica leases)."""
        if rollout_gpus_of_replica(self.ctx, self.sim) == 0:
            return {}
        return {POOL: replica_pool_config(self.ctx, self.sim)}

    # hooks
    def admitting(self) -> np.ndarray:
        return self.rep.state == SERVING

    def tallied(self) -> np.ndarray:
        return self.rep.serving_gpus()

    def in_flight(self) -> float:
        return super().in_flight() + float(self.rep.w.sum())

    def rollout_gpus(self) -> int:
        return super().rollout_gpus() + self.rep.lent_gpus()

    def leased_counts(self) -> tuple[int, int]:
        leased, running = super().leased_counts()
        return leased + self.rep.out_gpus(), running + self.rep.lent_gpus()

    def synced(self, steps: int) -> None:
        super().synced(steps)
        self.rep.synced(steps)

    def policy_tallies(self) -> dict:
        rep = self.rep
        return {
            **super().policy_tallies(),
            "grants": self.grants + rep.lends * self.tp,  # GPU grants of both kinds
            "replica_grants": rep.lends,
            "replica_expiries": self.replica_expiries,
            "replica_grants_rejected": self.replica_rejected,
            **rep.tallies(),
            "pool_decisions": self.pool_decisions,
            **lease_hours(rep.replica_gpu_s, self.lease_gpu_s - rep.replica_gpu_s, rep.reclaims_late),
        }

    def extra(self, w: int, t1: float, st) -> None:
        """The replicas' executors, then the co-resident side and the core (`RoseRun.extra`) on
        telemetry that says what each replica is doing, then the pool stage at a bin's end."""
        for r in self.rep.step(t1, st):  # a drain past its timeout: the grant is rejected
            self.reject(r, t1, "drain timeout")
        self.serving_state = [STATES[s] for s in np.repeat(self.rep.state, self.tp).tolist()]
        super().extra(w, t1, st)
        if (w + 1) % self.per_bin == 0:
            self.decide_pool()

    def account_gap(self, mine: np.ndarray, share_all: np.ndarray, ready: np.ndarray) -> None:
        """The share-all gap (`RoseRun.account_gap`) with the GPUs of replicas out of the router
        apart: there share-all's work beyond the replica's counts as its lease's start (drain,
        wake-up, reclaim), the replica's beyond share-all's as above it."""
        rep = self.rep
        out = np.repeat(rep.was_out, self.tp)
        if out.any():
            diff = np.where(out, share_all, 0.0) - np.repeat(rep.gain / self.tp, self.tp)
            self.gap["lease_start"] += float(diff[diff > 0].sum())
            self.gap["above_share_all"] -= float(diff[diff < 0].sum())
            share_all = np.where(out, 0.0, share_all)
        super().account_gap(mine, share_all, ready)

    def pooled(self, applied: Applied, ts: float) -> None:
        for s in applied.samples:
            self.bin_samples.setdefault(s.gpu, []).append(s)

    def decide_pool(self) -> None:
        """The pool stage on the bin's samples: each GPU's folded as one (its mean rps, headroom
        on all of them: what `pool_view` keeps of a bin), the last decided; its intents wait for
        the core's next batch."""
        merged = [bin_sample(v) for v in self.bin_samples.values()]
        self.bin_samples = {}
        if not merged:
            return
        self.stage, intents = stage_bin(self.stage, merged, self.rep.cfg)
        self.pool_decisions += 1
        self._intents = self._intents + intents

    def apply(self, commands: list, t1: float) -> None:
        """Replica commands to the replica path, the rest to the lease machines (`RoseRun.apply`)."""
        self.replica_commands([(g, c) for g, c in commands if c.lease_kind == LEASE_REPLICA], t1)
        super().apply([(g, c) for g, c in commands if c.lease_kind != LEASE_REPLICA], t1)

    def replica_commands(self, commands: list[tuple[int, Command]], t1: float) -> None:
        """The executors' replica path: an expired lease reclaims as a revoke does (the fail-safe);
        a grant drains its replica (the first of its gang's grants; one for a replica that is
        not serving is rejected), a renew extends the lease, a revoke reclaims."""
        leases, state, tp = self.replica_lease, self.rep.state, self.tp
        back = set()
        for g in [g for g, c in leases.items() if c.expires_at <= t1]:
            del leases[g]
            self.replica_expiries += 1
            back.add(g // tp)
        for g, cmd in commands:
            r, held = g // tp, leases.get(g)
            if cmd.kind == "grant":
                gang = any(c.group_id == cmd.group_id for h, c in leases.items() if h // tp == r)
                if state[r] != SERVING and not gang:
                    self.publish(g, cmd, t1, "rejected", "the replica is not serving")
                    continue
                leases[g] = cmd
                if state[r] == SERVING:
                    self.rep.drain(r, t1)
            elif held is not None and held.lease_id == cmd.lease_id:
                if cmd.kind == "renew":
                    leases[g] = cmd
                elif cmd.kind == "revoke":
                    del leases[g]
                    back.add(r)
        self.rep.reclaim(sorted(r for r in back if state[r] in (DRAINING, LENT)), t1)

    def reject(self, r: int, t1: float, why: str) -> None:
        """Replica r's grants rejected (it is readmitted already): each GPU's lease ends."""
        for g in range(r * self.tp, (r + 1) * self.tp):
            cmd = self.replica_lease.pop(g, None)
            if cmd is not None:
                self.publish(g, cmd, t1, "rejected", why)

    def publish(self, g: int, cmd: Command, t1: float, state: str, why: str) -> None:
        """A lease state that ends a replica lease in the core's view (the executor's word; the
        draining, active and reclaiming states change nothing there and are not published)."""
        self.replica_rejected += state == "rejected"
        self._published.append(LeaseState(cmd.gpu, cmd.lease_id, cmd.epoch, state, t1, 0, cmd.command_id, why))


def bin_sample(samples: list[PoolSample]) -> PoolSample:
    """A GPU's samples of one bin as one: the last, with their mean rps and headroom on all."""
    rps = sum(s.rps for s in samples) / len(samples)
    return replace(samples[-1], rps=rps, headroom_ok=all(s.headroom_ok for s in samples))
