"""The runs of `rose paper-check`: what it runs (`CheckConfig`: the main grid of traces, model
cells and seeds, and the sweeps of the interference profile, G/M and the elastic baseline's cap
and provisioning delay), `plan()` listing every run as a `Job`, and `run_all()` running them (in
worker processes when asked). docs/paper-check.md says what and why.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from rose.config import PolicyConfig
from rose.policy.pool import PoolConfig, forecast_rps, replicas_needed, window_bins
from rose.sim.engine import ALPHA_MEASURED, simulate
from rose.sim.interference import (
    REPO,
    SIM_PROFILE_PATH,
    InterferenceProfile,
    linear_profile,
    read_profile,
    simulation_profile,
)
from rose.sim.lease_kinds_run import configured_pool
from rose.sim.policies import POLICIES
from rose.sim.requests import RequestStream
from rose.sim.runs import ELASTIC_CAP_FRAC, ELASTIC_PROVISION_S
from rose.sim.sim_config import SimConfig
from rose.sim.traces import Trace

# the public traces `rose simulate --trace` reads as requests (rose.sim.traces: Azure LLM, BurstGPT, Mooncake)
TRACES = (
    "azure_llm2023_code.csv",
    "azure_llm2023_conv.csv",
    "burstgpt1_first400.csv",
    "mooncake_fast25_synthetic.jsonl",
)
# the main runs' policies: the default comparison and `rose-coresident`, which R1 and R2 compare
# `rose` and share-all with (docs/paper-check.md "Targets"); `rose-replica` is left out for its
# cost (a 64-GPU hour of it at 8B takes longer than one of `rose-coresident`: docs/paper-check.md)
MAIN_POLICIES = (*POLICIES, "rose-coresident")
LINEAR = "linear alpha "  # the sweep key of the linear model at an alpha: "linear alpha 0.3"


@dataclass(frozen=True)
class CheckConfig:
    """What `rose paper-check` runs: the main grid (traces × models × seeds, every policy) and
    the sweeps (`sweep_seeds` seeds each, only the policies a swept constant changes: share-all
    and ROSE for the profile and G/M, elastic for its cap)."""

    traces: tuple[str, ...] = TRACES
    # model cells: SIZE[@GPU][/tpN] (the GPU defaults to `gpu`, tp to the fewest GPUs that host
    # the model, models.serving_tp; rollout runs at serving's tp): 70B at tp 4 on both GPUs
    models: tuple[str, ...] = ("8B", "70B", "70B@H200/tp4")
    gpus: int = 64
    gm: int = 8  # serving GPUs per dedicated rollout GPU
    duration_s: float = 3600.0
    seeds: int = 3
    gpu: str = "H100"
    # the main runs' interference profile ("": rose.sim.interference.simulation_profile); the profile
    # sweep runs its mechanism, each other mechanism the file holds, and the linear model's alphas
    profile_file: str = ""
    alphas: tuple[float, ...] = (0.1, 0.3, 1.0)
    pessimistic_alpha: float = ALPHA_MEASURED  # the CPU bench's fit, one labelled linear row
    gpu_alpha: float | None = None  # a GPU bench's fit (--gpu-alpha-bench), one labelled linear row
    gpu_alpha_source: str = ""
    gm_sweep: tuple[int, ...] = (1, 2, 4, 8)
    elastic_caps: tuple[float, ...] = (ELASTIC_CAP_FRAC, 0.5, 1.0)
    # elastic's provisioning delay, an assumption (rose.sim.runs.ELASTIC_PROVISION_S): swept
    elastic_provision: tuple[float, ...] = (60.0, ELASTIC_PROVISION_S, 600.0)
    sweep_seeds: int = 1
    policy: PolicyConfig = field(default_factory=PolicyConfig)

    def __post_init__(self) -> None:
        if any(not p >= 0 for p in self.elastic_provision):
            raise ValueError(f"elastic_provision: every delay must be >= 0 s, got {self.elastic_provision}")
        if self.gpus < 1 or self.gm < 1 or self.seeds < 1 or self.sweep_seeds < 1:
            raise ValueError("gpus, gm, seeds and sweep_seeds must be >= 1")
        if self.gpus // self.gm < 1 or any(self.gpus // g < 1 for g in self.gm_sweep):
            raise ValueError(f"every G/M must leave at least one dedicated GPU of {self.gpus}")
        if self.sweep_seeds > self.seeds:
            raise ValueError("sweep_seeds must be <= seeds (the sweeps reuse the main runs' first seeds)")
        for m in self.models:
            model_cell(m, self.gpu)  # ValueError on a malformed label
        for a in sweep_alphas(self):
            linear_profile(a)  # ProfileError (a ValueError) on a negative alpha
        self.profile()  # ProfileError on a file that is not a profile

    def profile(self) -> InterferenceProfile:
        """The main runs' interference profile."""
        return read_profile(Path(self.profile_file)) if self.profile_file else simulation_profile()


def model_cell(label: str, gpu: str) -> dict:
    """SimConfig fields of a model cell label SIZE[@GPU][/tpN], e.g. `70B@H200/tp4`."""
    from rose.sim.models import check_tp, gpu_spec, model_size

    rest, _, tp = label.partition("/")
    size, _, on = rest.partition("@")
    out: dict = {"model": size, "gpu": on or gpu}
    if tp:
        if not tp.startswith("tp") or not tp[2:].isdigit():
            raise ValueError(f"model cell {label!r}: expected SIZE[@GPU][/tpN], e.g. 70B@H200/tp4")
        out["tp"] = int(tp[2:])
    try:
        m = model_size(size)
        gpu_spec(out["gpu"])
        if "tp" in out:
            check_tp(m, out["tp"])
    except ValueError as e:
        raise ValueError(f"model cell {label!r}: {e}") from None
    return out


@dataclass(frozen=True)
class Job:
    """One `simulate` run of the check: which table it feeds and its SimConfig."""

    kind: str  # main | profile | gm | cap | provision
    trace: str
    model: str
    # the swept value: a profile's key (`sweep_profiles`), G/M, the cap; the main profile's key for kind main
    value: float | str
    seed: int
    sim: SimConfig


def sweep_alphas(cc: CheckConfig) -> list[float]:
    return sorted({*cc.alphas, cc.pessimistic_alpha, *([cc.gpu_alpha] if cc.gpu_alpha is not None else [])})


def sweep_profiles(cc: CheckConfig) -> dict[str, InterferenceProfile]:
    """The profile sweep by key: the main profile's mechanism, each other mechanism its file
    holds (measured on the same device), then the linear model at each alpha (`LINEAR` + alpha)."""
    main = cc.profile()
    path = Path(cc.profile_file) if cc.profile_file else SIM_PROFILE_PATH
    where = path.relative_to(REPO) if path.resolve().is_relative_to(REPO) else path
    out = {main.mechanism: main}
    for name, points in main.others:
        device = f" ({main.device})" if main.device else ""
        out[name] = InterferenceProfile(name, f"{where}, mechanisms.{name}{device}", points, main.device)
    for a in sweep_alphas(cc):
        out[f"{LINEAR}{a:g}"] = linear_profile(a)
    return out


def plan(cc: CheckConfig) -> list[Job]:
    """Every run of the check, main grid first."""
    main = cc.profile()

    def sim(model: str, seed: int, **kw) -> SimConfig:
        base = SimConfig(
            n_gpus=cc.gpus,
            dedicated=cc.gpus // cc.gm,
            **model_cell(model, cc.gpu),
            duration_s=cc.duration_s,
            seed=seed,
            interference=main,
            policy=cc.policy,
            replica_pool=configured_pool(cc.policy),
            record_series=False,
            policies=MAIN_POLICIES,
        )
        return replace(base, **kw)

    versus = ("share-all", "rose")
    cells = [(t, m) for t in cc.traces for m in cc.models]
    jobs = [Job("main", t, m, main.mechanism, s, sim(m, s)) for t, m in cells for s in range(cc.seeds)]
    sweep = range(cc.sweep_seeds)
    for key, prof in sweep_profiles(cc).items():
        if key != main.mechanism:
            jobs += [
                Job("profile", t, m, key, s, sim(m, s, interference=prof, policies=versus))
                for t, m in cells
                for s in sweep
            ]
    for g in cc.gm_sweep:
        if g != cc.gm:
            jobs += [
                Job("gm", t, m, g, s, sim(m, s, dedicated=cc.gpus // g, policies=versus))
                for t, m in cells
                for s in sweep
            ]
    for cap in cc.elastic_caps:
        if cap != ELASTIC_CAP_FRAC:  # elastic's rollout does not depend on the seed
            jobs += [Job("cap", t, m, cap, 0, sim(m, 0, elastic_cap_frac=cap, policies=("elastic",))) for t, m in cells]
    for p in cc.elastic_provision:
        if p != ELASTIC_PROVISION_S:
            jobs += [
                Job("provision", t, m, p, 0, sim(m, 0, elastic_provision_s=p, policies=("elastic",))) for t, m in cells
            ]
    return jobs


_TRACE_CACHE: dict[str, Trace] = {}


def _run(args: tuple[str, Job]) -> dict:
    from rose.sim.traces import load_trace

    folder, job = args
    tr = _TRACE_CACHE.get(job.trace)
    if tr is None:
        tr = _TRACE_CACHE[job.trace] = load_trace(Path(folder) / job.trace)
    r = simulate(tr, job.sim)
    if job.kind == "main":
        r["trough"] = trough_of(tr, r, job.seed, job.sim.replica_pool)
    return r


def spare_replicas(
    stream: RequestStream, duration_s: float, capacity_rps: float, replicas: int, pool: PoolConfig
) -> dict:
    """Whether the run's load has a trough: the run's arrivals (`stream`, the trace's copies as the
    run plays them, thinned by their expected keep) per pool bin, through the pool's own forecast
    and `replicas_needed` (rose.policy.pool) at `capacity_rps` a replica (what the run provisions
    it for: its share of the busiest minute, rose.sim.engine's `replica_capacity_rps`), each bin's
    spare replicas counted as `decide_pool` would lend them (none before a window of history, never
    the last serving replica). The mean over the run's bins and the fraction of bins with a spare."""
    n_bins = max(1, math.ceil(duration_s / pool.bin_s - 1e-9))
    edges = np.arange(n_bins + 1) * pool.bin_s
    counts = np.zeros(n_bins)
    for off in stream.offsets:
        counts += np.histogram(stream.base_t + off, edges)[0]
    load = counts * stream.keep / pool.bin_s
    wb = window_bins(pool)
    spare = np.zeros(n_bins)
    for i in range(wb - 1, n_bins if capacity_rps > 0 else 0):
        f = forecast_rps(pool.forecast, tuple(load[i - wb + 1 : i + 1].tolist()), pool.bin_s, pool.horizon_s)
        spare[i] = max(0, min(replicas - replicas_needed(f, capacity_rps, pool.headroom), replicas - 1))
    return {
        "replicas": replicas,
        "mean_spare_replicas": round(float(spare.mean()), 3),
        "bins_with_spare": round(float((spare >= 1).mean()), 4),
    }


def trough_of(trace: Trace, r: dict, seed: int, pool: PoolConfig) -> dict:
    """`spare_replicas` of a `simulate` result `r` of `trace`: its request stream rebuilt from the
    load mapping it reports (rps per GPU, the busiest minute over the mean)."""
    c, fleet = r["config"], r["fleet"]
    tp, gpus = fleet["tensor_parallel"], fleet["serving_gpus"]
    stream = RequestStream(trace, c["rps_per_gpu"] * gpus, c["duration_s"], seed)
    return spare_replicas(stream, c["duration_s"], c["rps_per_gpu"] * c["peak_to_mean"] * tp, gpus // tp, pool)


def run_all(folder: Path, jobs: Sequence[Job], workers: int = 1, progress: Callable[[Job, dict], None] | None = None):
    """Each job's result, in the jobs' order; `workers` > 1 runs them in that many processes."""
    args = [(str(folder), j) for j in jobs]
    out: list[dict] = []
    if workers <= 1:
        for a in args:
            out.append(_run(a))
            if progress:
                progress(a[1], out[-1])
        return out
    import multiprocessing as mp

    with mp.get_context("fork").Pool(workers) as pool:
        for j, r in zip(jobs, pool.imap(_run, args)):
            out.append(r)
            if progress:
                progress(j, r)
    return out


# ---- results and targets -----------------------------------------------------------------
