"""The rollout side of each policy: the dedicated pool every policy has, whole external GPUs
(`elastic`), a fixed share of every serving GPU (`share-all`), and ROSE's leases (`rose`, in
`rose.sim.rose_run`), each with its tallies. What each policy does: docs/simulator.md "Policies"; how ROSE's side
runs the system's own scheduling core, lease machine and guard rule: docs/simulator.md
"ROSE's executors and guard in the simulator".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from rose.config import PolicyConfig
from rose.contract.events import Latency
from rose.policy.pool import PoolConfig
from rose.sim.interference import InterferenceProfile
from rose.sim.ledger import Ledger
from rose.sim.models import EpisodeModel, GpuSpec
from rose.sim.rollout_model import RolloutModel
from rose.sim.serving_model import ServingSim

SHARE_ALL_SHARE = 0.5  # = PolicyConfig.max_compute_share: the most ROSE would ever lend
SHARE_ALL_MEM_FRAC = 0.5  # of the memory serving does not hold at start
# request -> usable external GPU (VM or pod start, image, weights): an assumption with no
# measurement behind it; the paper check sweeps it (SimConfig.elastic_provision_s)
ELASTIC_PROVISION_S = 180.0

ELASTIC_CAP_FRAC = 0.25  # cost cap: external GPUs at once, as a fraction of the static pool
# elastic adds GPUs while a step would take longer than static's / (1 + cap frac): the step its cap allows


@dataclass
class RunContext:
    """What every policy run shares."""

    G: int  # serving GPUs
    M: int  # dedicated rollout GPUs
    ep: EpisodeModel
    policy: PolicyConfig
    gpu: GpuSpec
    rollout: RolloutModel
    slo: Latency
    dt: float  # window, s
    n_win: int
    decide_every: int
    wfull: int  # full policy weights per GPU, bytes
    ded_rate: float  # episodes/s of the dedicated pool
    ded_fill: float  # its pipeline fill, episode units
    step_static_s: float  # one RL step's rollout on the dedicated pool alone, s
    delta_ratio: float  # weight delta bytes / full, per RL step
    elastic_cap_frac: float = ELASTIC_CAP_FRAC  # elastic: external GPUs at once, × M
    profile: InterferenceProfile | None = None  # interference beside serving (rose.sim.interference)
    lease_start_s: float = 0.0  # a lease's (or a share's) worker from its start to decoding, s
    resume_s: float = 0.0  # a throttled or guard-paused worker from its resume to decoding, s
    elastic_provision_s: float = ELASTIC_PROVISION_S
    warm_workers: int = 0  # ready warm workers each node's executor keeps (0: every start is cold)
    cold_start_s: float = 0.0  # a lease's worker from its start to decoding with no warm worker, s
    warm_build_s: float = 0.0  # a new warm worker from its launch to ready, s (the pool's refill)
    train_step_s: float = 0.0  # one RL step's training, s (models.train_step_s)
    replica_capacity_rps: float = 0.0  # requests/s a serving replica is provisioned for (replica leases)
    replica_pool: PoolConfig = field(
        default_factory=PoolConfig
    )  # the pool decision's settings (SimConfig.replica_pool)

    def rollout_rate(self, mem_bytes, share) -> np.ndarray:
        """Episodes/s per GPU of rollout with `mem_bytes` at compute `share` beside serving: its
        solo rate × the profile's rollout fraction at that share (GPU time is conserved: what the
        profile says one GPU does at that share, not share × the solo rate)."""
        assert self.profile is not None  # simulate() always gives one
        return self.rollout.rate(mem_bytes) * self.profile.rollout_fraction(share)

    def share_all_ready(self, t1: float) -> float:
        """The part of the window ending at t1 in which share-all's workers (started with the run,
        at 0) decode: after their start."""
        return float(ready_fraction(t1, self.dt, np.float64(self.lease_start_s)))


class Run:
    """The rollout side and the tallies of one policy."""

    own_serving = False  # runs rollout on serving GPUs: needs a serving model of its own
    harvests = False  # reports its harvest, leased GPUs and unusable leases
    delta_weights = False  # syncs each RL step's weights as deltas (ROSE's workers), not full copies

    def __init__(self, name: str, ctx: RunContext, sim: ServingSim | None):
        self.name, self.ctx, self.sim = name, ctx, sim  # sim None: serving shared (no rollout on it)
        self.ledger = Ledger(ctx.ep, ctx.rollout.reprefill_units, ctx.train_step_s)
        self.ded_w = np.zeros(1)
        self.slo_ok_gpu_windows = self.gpu_windows = self.slo_ok_windows = self.windows = 0
        self.revokes = self.grants = self.expiries = self.guard_pauses = self.leases_unusable = 0
        self.throttles = 0  # v1.1: pauses and resumes of a live lease (memory and worker stay)
        self.decide_calls = 0
        self.weight_bytes = self.weight_bytes_full = 0.0
        self.lease_gpu_s = self.lease_share_s = self.ext_gpu_s = 0.0
        self.last_steps = 0
        self.lease_start_s: float | None = None  # when rollout first ran on a serving GPU
        self.harvested = 0.0  # rollout work done on serving GPUs (leases, shares), episodes
        self.min_free_bytes = 1 << 62
        self.series: dict[str, list] = {
            k: []
            for k in (
                "t",
                "ttft_p99_max_ratio",
                "tpot_p99_max_ratio",
                "slo_ok_frac",
                "leased",
                "running",
                "episodes",
                "external_gpus",
            )
        }
        self.load_weights(ctx.M)  # the dedicated pool loads the policy once

    def load_weights(self, n: int) -> None:
        self.weight_bytes += n * self.ctx.wfull
        self.weight_bytes_full += n * self.ctx.wfull

    # hooks
    def in_flight(self) -> float:
        return float(self.ded_w.sum())

    def rollout_gpus(self) -> int:
        return self.ctx.M

    def leased_counts(self) -> tuple[int, int]:
        return 0, 0

    def external(self) -> int:
        return 0

    def synced(self, steps: int) -> None:
        """Every rollout GPU now holds the weights of RL step `steps`."""

    def admitting(self) -> np.ndarray | None:
        """Per serving replica, whether the router sends it requests (None: every replica)."""
        return None

    def tallied(self) -> np.ndarray | None:
        """Per serving GPU, whether it counts in the SLO tally (None: every GPU): a GPU serves."""
        return None

    def policy_tallies(self) -> dict:
        """The policy's own figures for its result (rose.sim.report.result_of)."""
        return {}

    def step(self, w: int, t1: float, st) -> None:
        """One window: the dedicated pool (resuming parked continuations first), then the rest."""
        c = self.ctx
        if c.M > 0:
            self.ded_w[0] += self.ledger.unpark()
            self.ledger.progress(self.ded_w, np.array([c.ded_fill]), np.array([c.ded_rate * c.dt]))
        self.extra(w, t1, st)

    def extra(self, w: int, t1: float, st) -> None:
        pass


class ElasticRun(Run):
    """Static pool + whole external GPUs on backlog, after a provisioning delay, under a cost cap."""

    def __init__(self, name: str, ctx: RunContext, sim: ServingSim | None) -> None:
        super().__init__(name, ctx, sim)
        self.ext_w = np.zeros(0)
        self.requested: list[float] = []  # ready times of requested GPUs not yet arrived
        self.cap = max(1, math.floor(ctx.elastic_cap_frac * ctx.M))

    def in_flight(self) -> float:
        return float(self.ded_w.sum() + self.ext_w.sum())

    def rollout_gpus(self) -> int:
        return self.ctx.M + self.ext_w.size

    def external(self) -> int:
        return int(self.ext_w.size)

    def policy_tallies(self) -> dict:
        return {"external_gpu_hours": round(self.ext_gpu_s / 3600.0, 3), "external_gpu_cap": self.cap}

    def extra(self, w, t1, st):
        c, led = self.ctx, self.ledger
        arrived = sum(1 for t in self.requested if t <= t1)
        if arrived:
            self.requested = [t for t in self.requested if t > t1]
            fill = c.rollout.dedicated_batch / 2.0
            new = np.array([led.unpark(fill) for _ in range(arrived)])
            self.ext_w = np.concatenate([self.ext_w, new])
            self.load_weights(arrived)
        n = self.ext_w.size
        if n:
            led.progress(
                self.ext_w, np.full(n, c.rollout.dedicated_batch / 2.0), np.full(n, c.rollout.dedicated_rate * c.dt)
            )
            self.ext_gpu_s += n * c.dt
        backlog = c.ep.episodes_per_step - led.completed % c.ep.episodes_per_step
        per_gpu = c.rollout.dedicated_rate * c.step_static_s / (1.0 + c.elastic_cap_frac)
        want = min(self.cap, max(0, math.ceil(backlog / per_gpu) - c.M))
        more = want - n - len(self.requested)
        if more > 0:
            self.requested += [t1 + c.elastic_provision_s] * more


class ShareAllRun(Run):
    """Every serving GPU lends a fixed share and memory from the start; never revoked."""

    sim: ServingSim  # always given one: rollout shares the serving GPUs
    own_serving = harvests = True

    def __init__(self, name: str, ctx: RunContext, sim: ServingSim | None) -> None:
        assert sim is not None  # the serving GPUs it shares (simulate() gives one)
        super().__init__(name, ctx, sim)
        room = ctx.gpu.mem_bytes - sim.static_bytes
        self.mem = np.full(ctx.G, int(room * SHARE_ALL_MEM_FRAC), dtype=np.int64)
        self.batch = ctx.rollout.batch_for(self.mem)
        self.usable = self.batch > 0
        self.w = np.zeros(ctx.G)
        self.leases_unusable = int((~self.usable).sum())
        sim.set_rollout(slice(None), SHARE_ALL_SHARE, self.usable, self.mem)
        self.load_weights(int(self.usable.sum()))

    def in_flight(self):
        return float(self.ded_w.sum() + self.w.sum())

    def rollout_gpus(self):
        return self.ctx.M + int(self.usable.sum())

    def leased_counts(self):
        return self.ctx.G, int(self.usable.sum())

    def extra(self, w, t1, st):
        c = self.ctx
        ready = c.share_all_ready(t1)
        gain = c.rollout_rate(self.mem, SHARE_ALL_SHARE) * (c.dt * ready)
        self.ledger.progress(self.w, self.batch / 2.0, gain)
        self.harvested += float(gain.sum())
        if self.lease_start_s is None and ready > 0.0:
            self.lease_start_s = t1 - c.dt * ready
        self.lease_gpu_s += c.G * c.dt
        self.lease_share_s += float(self.usable.sum()) * SHARE_ALL_SHARE * c.dt


def fetch_bytes(version: np.ndarray, steps: int, full: float, delta_ratio: float) -> float:
    """Weight bytes GPUs fetch to start rollout at RL step `steps`: the node keeps the last
    weights it had in host memory, so a GPU that held rollout before (`version` ≥ 0) fetches only
    the deltas it missed (never more than a full copy); one that never did, a full copy."""
    missed = steps - version
    return float(np.where(version < 0, full, np.minimum(full, missed * delta_ratio * full)).sum())


def lease_hours(replica_gpu_s: float, coresident_gpu_s: float, reclaims_late: int) -> dict:
    """The lease figures every ROSE policy reports (docs/contract.md §7): GPU-hours under replica
    and co-resident leases, and reclaims whose replica served again after its pool needed it."""
    return {
        "replica_lease_hours": round(replica_gpu_s / 3600.0, 3),
        "coresident_lease_hours": round(coresident_gpu_s / 3600.0, 3),
        "reclaims_late": reclaims_late,
    }


def ready_fraction(t1: float, dt: float, ready_at: np.ndarray | np.float64) -> np.ndarray:
    """The part of the window (t1 - dt, t1] after `ready_at` (elementwise), in [0, 1]."""
    return np.clip((t1 - ready_at) / dt, 0.0, 1.0)
