"""What one `rose simulate` run is set to (`SimConfig`): fleet, model, trace load, interference,
policies and the RL job, with the defaults and where each comes from. Shared by the time loop
(rose.sim.engine) and the report (rose.sim.report)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rose.config import ExecutorConfig, PolicyConfig
from rose.policy.pool import PoolConfig
from rose.sim.interference import InterferenceProfile, linear_profile, simulation_profile
from rose.sim.models import RESUME_S, TRAIN_MFU, EngineConfig, EpisodeModel
from rose.sim.policies import POLICIES
from rose.sim.runs import ELASTIC_CAP_FRAC, ELASTIC_PROVISION_S

PERIOD_S = 0.5  # telemetry period (TelemetryConfig.period_s), one serving window
DEFAULT_LOAD = 0.7  # fraction of a GPU's roofline capacity the trace's busiest minute uses
# Interference: by default the measured profile (rose.sim.interference.simulation_profile: serving
# beside rollout in a separate process on an H200, both sides from the same runs). The linear model, serving's slowdown
# 1 + alpha × share (capped at the time-slicing bound), is a labelled sweep option (`alpha`). Its
# reference value is an assumption inside the range published GPU
# co-location measurements span (docs/simulator.md "Interference: where alpha comes from"):
# preemptive schedulers keep a high-priority job's p99 within 2-7 % of running alone beside a
# best-effort job (REEF, OSDI '22; Tally, ASPLOS '25: alpha 0.02-0.07), plain time-slicing
# costs 1/(1 - share), about 1 + share (alpha 1). CUDA stream priorities without kernel
# preemption (what ROSE's workers use) lie in between; 0.3 is about the geometric middle of
# 0.07 and 1. Replace it with a measurement: `rose bench interference --json` on a GPU, passed
# as `rose simulate --interference-bench FILE`.
ALPHA_DEFAULT = 0.3
ALPHA_DEFAULT_SOURCE = (
    "assumption inside the published range 0.07 (preemptive GPU co-location, Tally ASPLOS '25) "
    "to 1.0 (time-slicing); docs/simulator.md"
)
# `rose bench weights --full` in the GPU check (docs/measured/h200/weights.json, codec): lossless
# zdelta bytes per RL step (Adam, lr 1e-6, 100M params) / full bf16 = 0.00664. Bytes, not time:
# the same on any machine.
WEIGHT_DELTA_RATIO = 0.00664


@dataclass(frozen=True)
class SimConfig:
    n_gpus: int = 64
    dedicated: int = 0  # 0: n_gpus // 8 (at least 1)
    model: str = "7B"
    gpu: str = "H100"
    tp: int = 0  # serving tensor parallel (0: the fewest GPUs that host the model, models.serving_tp)
    rollout_tp: int = 0  # the RL policy's tensor parallel in rollout (0: serving's); > 1: gang leases
    duration_s: float = 0.0  # 0: the trace's span, at most an hour
    seed: int = 0
    load: float = DEFAULT_LOAD
    period_s: float = PERIOD_S
    decide_every: int = 0  # 0: auto (every window up to DECIDE_CALLS_BUDGET calls, then coarser)
    # interference: a profile (rose.sim.interference); None: the linear profile of `alpha` when
    # that is set (a sweep), else the default measured profile
    interference: InterferenceProfile | None = None
    alpha: float | None = None
    alpha_source: str = ALPHA_DEFAULT_SOURCE
    weight_delta_ratio: float = WEIGHT_DELTA_RATIO
    weight_ratio_source: str = "rose bench weights --full (docs/measured/h200/weights.json)"
    check_invariants: bool = False  # assert the simulator's invariants every window (tests)
    policies: tuple[str, ...] = POLICIES
    episode: EpisodeModel = field(default_factory=EpisodeModel)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    # replica leases (rose-replica): the pool decision's settings (policy.pools.<pool>); the run
    # sets the capacity, the wake-up, the stop bound and the decision latency (replica_run.sim_pool_config)
    replica_pool: PoolConfig = field(default_factory=PoolConfig)
    record_series: bool = True  # per-window series for plots
    elastic_cap_frac: float = ELASTIC_CAP_FRAC  # the elastic baseline's GPUs at once, × the static pool
    # what starting rollout costs (rose.sim.models): a lease's or a share's worker waking up (None:
    # the sourced model of the run's weights and GPU, models.wake_s), a throttled lease resuming,
    # an external GPU being provisioned (elastic; an assumption, swept in the paper check)
    lease_start_s: float | None = None
    resume_s: float = RESUME_S
    elastic_provision_s: float = ELASTIC_PROVISION_S
    # warm workers each node's executor keeps (ExecutorConfig.warm_workers): a lease that finds
    # none ready starts cold (models.cold_start_s; None: the sourced model, a number overrides it)
    warm_workers: int = ExecutorConfig.warm_workers
    cold_start_s: float | None = None
    # training (models.train_step_s): the trainer's GPUs (0: as many as the dedicated pool, an
    # assumption) at train_mfu; train_step_s set: that many seconds a step (0: training is free)
    train_gpus: int = 0
    train_mfu: float = TRAIN_MFU
    train_step_s: float | None = None
    # processes: 1 runs every policy in this one; 2 runs ROSE in a forked child beside the others
    # (the same results: the policies share nothing but the request stream, which each process
    # draws from the same seed); 0: 2 for large runs where that is possible (`auto_workers`)
    workers: int = 0

    def profile(self) -> InterferenceProfile:
        """The interference profile the run uses."""
        if self.interference is not None:
            return self.interference
        if self.alpha is not None:
            return linear_profile(self.alpha)
        return simulation_profile()

    @property
    def pool(self) -> int:
        return self.dedicated if self.dedicated > 0 else max(1, self.n_gpus // 8)
