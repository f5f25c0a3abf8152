"""`rose simulate`: a serving cluster driven by a real request trace, plus an agentic RL job,
under four rollout policies (the paper's baselines and ROSE). `simulate(trace, SimConfig)`
runs every policy over the same windows and the same requests and returns the JSON-ready
result (`rose.sim.report.result_of`). Pure apart from reading the trace (and the default
interference profile, docs/measured/h200/interference-profile.json). A large run takes
ROSE's side (its policy calls and lease machines, most of the work) to a forked second process
(`SimConfig.workers`); the policies share nothing but the request stream, so the result is the
same byte for byte.

The model behind every figure: docs/simulator.md. This module holds the time loop, the
invariants checked every window (tests), and calibration from benchmark results.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import pickle
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Generic, TypeVar

import numpy as np

from rose.config import PolicyConfig
from rose.sim.interference import ProfileError, from_bench
from rose.sim.ledger import Ledger
from rose.sim.models import GpuSpec, cold_start_s, deployed, gpu_spec, model_size, train_step_s, wake_s, warm_build_s
from rose.sim.policies import ALL_POLICIES, ALL_RUNS, FORKED
from rose.sim.policies import POLICIES as POLICIES  # the default comparison, re-exported
from rose.sim.replica_run import LENT, SERVING
from rose.sim.report import across_seeds, result_of
from rose.sim.requests import (
    LONG_TRACE_S,
    RequestStream,
    balance,
    capacity_bound,
    peak_to_mean,
    request_costs_s,
    slo_for,
    trace_compression,
    two_choices,
)
from rose.sim.rollout_model import RolloutModel
from rose.sim.rose_run import RoseRun
from rose.sim.runs import Run, RunContext, ShareAllRun
from rose.sim.serving_model import ServingSim
from rose.sim.sim_config import SimConfig
from rose.sim.traces import Trace

# The pessimistic row of the paper check: `rose bench interference --quick --json` on this
# project's 2-core CPU box, a serving step's p99 beside an unprotected rollout worker is 4.157×
# its p99 alone -> alpha = 3.157 (see `calibration`; docs/paper-check/interference.json).
ALPHA_MEASURED = 3.157
ALPHA_MEASURED_SOURCE = "rose bench interference --quick on 2 CPU cores (docs/paper-check/interference.json)"
DECIDE_CALLS_BUDGET = 2_000_000  # decide() costs ~12 µs a call in CPython: ~25 s of a run
_T = TypeVar("_T")
# A run of at least this many GPU-windows with ROSE and another policy runs ROSE in a second
# process (`SimConfig.workers` 0): below it the fork costs more than it saves.
PARALLEL_MIN_GPU_WINDOWS = 1_000_000


def simulate(trace: Trace, cfg: SimConfig) -> dict:
    """Run every policy of `cfg.policies` on `trace`; the JSON-ready result (rose.sim.report.result_of)."""
    t_wall = time.perf_counter()
    check_config(cfg)
    gpu = gpu_spec(cfg.gpu)
    model = deployed(model_size(cfg.model), gpu, cfg.tp, cfg.engine.runtime_reserve_bytes)
    G, M, ep = cfg.n_gpus, cfg.pool, cfg.episode
    profile = cfg.profile()
    probe = ServingSim(gpu, model, model.tp, engine=cfg.engine)  # one replica
    rollout = RolloutModel(probe, ep, cfg.engine.runtime_reserve_bytes, tp=cfg.rollout_tp)
    if rollout.dedicated_batch <= 0:
        raise ValueError(f"model {model.name} leaves no room for one episode on {gpu.name}")
    slo = slo_for(probe, trace)
    costs = request_costs_s(probe, trace.prompt_tokens, trace.output_tokens)
    cost = float(costs.mean())
    duration = cfg.duration_s if cfg.duration_s > 0 else min(LONG_TRACE_S, max(trace.duration_s, cfg.period_s))
    n_win = max(1, math.ceil(duration / cfg.period_s - 1e-9))
    compress = trace_compression(trace)
    peak = peak_to_mean(trace, costs, n_win * cfg.period_s, compress)
    rps_gpu = cfg.load / cost / peak
    stream = RequestStream(trace, rps_gpu * G, n_win * cfg.period_s, cfg.seed)
    ded_rate = M * rollout.dedicated_rate
    every = cfg.decide_every or auto_decide_every(G, n_win, cfg.period_s, cfg.policy)
    # a policy model split over tp GPUs runs rollout on gang leases of tp GPUs of one node
    policy = replace(cfg.policy, group_size=rollout.tp) if rollout.tp > 1 and cfg.policy.group_size == 1 else cfg.policy
    # the smallest grant is what the rollout worker needs (its weight shard, the runtime reserve and one
    # episode at its end): a smaller lease could not run rollout and would only shrink serving's KV cache
    policy = replace(policy, min_lease_bytes=max(policy.min_lease_bytes, rollout.min_lease_bytes))
    # the policy's prior is the run's interference profile (unless its configuration names one)
    if not policy.interference_profile:
        policy = replace(policy, interference_profile=profile.policy_points())
    ctx = RunContext(
        G,
        M,
        ep,
        policy,
        gpu,
        rollout,
        slo,
        cfg.period_s,
        n_win,
        every,
        model.weight_bytes_per_gpu,
        ded_rate,
        M * rollout.dedicated_batch / 2.0,
        ep.episodes_per_step / ded_rate,
        cfg.weight_delta_ratio,
        cfg.elastic_cap_frac,
        profile,
        lease_start_s=start_cost_s(cfg, rollout, gpu),
        resume_s=cfg.resume_s,
        elastic_provision_s=cfg.elastic_provision_s,
        warm_workers=cfg.warm_workers,
        cold_start_s=cfg.cold_start_s if cfg.cold_start_s is not None else cold_start_s(rollout.weights, gpu),
        warm_build_s=warm_build_s(rollout.weights),
        train_step_s=cfg.train_step_s
        if cfg.train_step_s is not None
        else train_step_s(model, ep, gpu, cfg.train_gpus or M, cfg.train_mfu),
        # a replica carries the trace's busiest minute at the run's load (the static fleet's
        # provisioning, at which it meets its SLO): the pool decision's capacity per replica
        replica_capacity_rps=cfg.load * model.tp / cost,
        replica_pool=cfg.replica_pool,
    )

    want = [p for p in ALL_POLICIES if p in cfg.policies]
    model_replicas = G // model.tp
    series_every = max(1, n_win // 720)

    def run_policies(names: list[str]) -> dict[str, Run]:
        """The window loop for the policies `names` (each with the serving model it needs)."""
        sims: dict[str, ServingSim] = {}
        if {"static", "elastic"} & set(names):
            sims["base"] = ServingSim(gpu, model, G, engine=cfg.engine, profile=profile)
        for p in names:
            if ALL_RUNS[p].own_serving:
                sims[p] = ServingSim(gpu, model, G, engine=cfg.engine, profile=profile)
        runs = {p: ALL_RUNS[p](p, ctx, sims.get(p)) for p in names}
        for w in range(n_win):
            t1 = (w + 1) * cfg.period_s
            arr, P, O = stream.window(w, w * cfg.period_s, t1)
            choices = two_choices(w, arr.size, model_replicas, cfg.seed)  # the same draws for every fleet
            stats = {
                k: sim.advance(
                    t1, balance(w, arr.size, sim.N + sim.qn, cfg.seed, choices, _admitting(runs, k)), arr, P, O
                )
                for k, sim in sims.items()
            }
            for p, run in runs.items():
                st = stats.get(p, stats.get("base"))
                ok_frac = _tally_slo(run, st, slo)
                run.step(w, t1, st)
                run.ledger.train(cfg.period_s)
                if cfg.check_invariants:
                    check_invariants(run, st)
                steps = run.ledger.steps()
                if steps > run.last_steps:  # weight sync to every GPU running rollout
                    full = (steps - run.last_steps) * run.rollout_gpus() * ctx.wfull
                    run.last_steps = steps
                    run.weight_bytes_full += full
                    run.weight_bytes += full * (cfg.weight_delta_ratio if run.delta_weights else 1.0)
                    run.synced(steps)
                if cfg.record_series and (w % series_every == 0 or w == n_win - 1):
                    _record_series(run, t1, st, slo, ok_frac)
        return runs

    parallel = (cfg.workers or auto_workers(G, n_win, want)) > 1 and hasattr(os, "fork")
    forked = [p for p in want if p in FORKED]
    if parallel and forked and len(forked) < len(want):
        # ROSE's co-resident leases (the policy calls and the lease machines: most of a large
        # run) in a child process
        child = _Forked(lambda: {p: _tallies(r) for p, r in run_policies(forked).items()})
        try:
            runs = run_policies([p for p in want if p not in FORKED])
        except BaseException:
            child.stop()
            raise
        for p, r in child.result().items():
            r.ctx = ctx
            runs[p] = r
        runs = {p: runs[p] for p in want}
    else:
        runs = run_policies(want)

    load = {
        "request_cost_s": round(cost, 6),
        "capacity_bound": capacity_bound(probe, trace.prompt_tokens, trace.output_tokens),
        "peak_to_mean": round(peak, 4),
        "rps_per_gpu": round(rps_gpu, 4),
        "trace_compress": round(stream.compress, 4),
        "trace_copies": stream.copies,
        "trace_keep": round(stream.keep, 5),
    }
    # gain over the static pool: measured when static ran, else its (deterministic) rate
    static = runs["static"].ledger.trained if "static" in runs else _static_episodes(ctx)
    out = result_of(trace, cfg, ctx, model, load, runs, static)
    out["wall_s"] = round(time.perf_counter() - t_wall, 3)
    return out


def start_cost_s(cfg: SimConfig, rollout: RolloutModel, gpu: GpuSpec) -> float:
    """A lease's (or a share's) start, s: the configured one, else a warm worker's wake-up with the
    rollout's weight shard on `gpu` (rose.sim.models.wake_s)."""
    return cfg.lease_start_s if cfg.lease_start_s is not None else wake_s(rollout.weights, gpu)


def check_config(cfg: SimConfig) -> None:
    """ValueError naming the first setting of `cfg` that no run can use."""
    for p in cfg.policies:
        if p not in ALL_POLICIES:
            raise ValueError(f"unknown policy {p!r} (known: {', '.join(ALL_POLICIES)})")
    if cfg.n_gpus < 1:
        raise ValueError(f"n_gpus must be >= 1, got {cfg.n_gpus}")
    if cfg.decide_every < 0:
        raise ValueError(f"decide_every must be >= 0, got {cfg.decide_every}")
    if not cfg.elastic_cap_frac >= 0:
        raise ValueError(f"elastic_cap_frac must be >= 0, got {cfg.elastic_cap_frac}")
    if cfg.warm_workers < 0:
        raise ValueError(f"warm_workers must be >= 0, got {cfg.warm_workers}")
    if cfg.train_gpus < 0 or not 0 < cfg.train_mfu <= 1:
        raise ValueError(f"train_gpus must be >= 0 and train_mfu in (0, 1], got {cfg.train_gpus}, {cfg.train_mfu}")
    for name in ("lease_start_s", "resume_s", "elastic_provision_s", "cold_start_s", "train_step_s"):
        v = getattr(cfg, name)
        if v is not None and not v >= 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    if cfg.workers < 0:
        raise ValueError(f"workers must be >= 0, got {cfg.workers}")


def _admitting(runs: dict[str, Run], sim_key: str):
    """The replicas the router of serving model `sim_key` sends requests to (None: all)."""
    run = runs.get(sim_key)
    return None if run is None else run.admitting()


def _tally_slo(run: Run, st, slo) -> float:
    """Count the window's SLO attainment and free memory into the run; the fraction of its
    tallied GPUs (those serving: `Run.tallied`) within the SLO."""
    ok = (st.ttft_p99_ms <= slo.ttft_p99) & (st.tpot_p99_ms <= slo.tpot_p99)
    serving = run.tallied()
    if serving is not None:
        ok = ok[serving]
    n_ok = int(ok.sum())
    run.slo_ok_gpu_windows += n_ok
    run.gpu_windows += ok.size
    run.windows += 1
    run.slo_ok_windows += int(n_ok == ok.size)
    run.min_free_bytes = min(run.min_free_bytes, int((st.mem_total_bytes - st.mem_used_bytes).min()))
    return n_ok / ok.size


def _record_series(run: Run, t1: float, st, slo, ok_frac: float) -> None:
    s = run.series
    leased, running = run.leased_counts()
    s["t"].append(round(t1, 3))
    s["ttft_p99_max_ratio"].append(round(float(st.ttft_p99_ms.max()) / slo.ttft_p99, 4))
    s["tpot_p99_max_ratio"].append(round(float(st.tpot_p99_ms.max()) / slo.tpot_p99, 4))
    s["slo_ok_frac"].append(round(ok_frac, 4))
    s["leased"].append(leased)
    s["running"].append(running)
    s["episodes"].append(run.ledger.completed)
    s["external_gpus"].append(run.external())


def check_invariants(run: Run, st) -> None:
    """What must hold after every window (AssertionError naming the broken one)."""
    c, led = run.ctx, run.ledger
    assert (st.mem_used_bytes <= st.mem_total_bytes).all(), "memory used exceeds the GPU"
    assert (st.mem_used_bytes >= st.rollout_mem_bytes).all(), "rollout memory exceeds memory used"
    assert (st.ttft_p99_ms >= 0).all() and (st.tpot_p99_ms >= 0).all(), "negative latency"
    if run.sim is not None:
        s = run.sim
        assert (s.qn >= -1e-9).all() and (s.N >= -1e-9).all() and (s.C >= -1e-6).all(), "negative serving state"
    w = [run.ded_w] + [getattr(run, k) for k in ("w", "ext_w") if hasattr(run, k)]
    assert all((x >= -1e-9).all() for x in w), "negative in-flight work"
    assert led.parked >= -1e-9 and led.recomputed >= -1e-9, "negative parked or recomputed work"
    total = led.completed + run.in_flight() + led.parked + led.recomputed
    assert abs(led.produced - total) <= 1e-6 * max(1.0, led.produced), (
        f"work ledger: produced {led.produced} != completed+in flight+parked+recomputed {total}"
    )
    assert led.steps() * c.ep.episodes_per_step <= led.trained <= led.completed + 1e-9, (
        "trainer consumed more than completed"
    )
    if isinstance(run, RoseRun):
        pc = c.policy
        assert (run.share <= pc.max_compute_share + 1e-9).all() and (run.share >= 0).all(), "share out of bounds"
        for g, room in run.grant_room.items():  # a grant never lends memory serving holds or the margin
            assert not run.leased[g] or run.mem[g] <= room, f"lease of {run.mem[g]} B > free {room} B on GPU {g}"
        run.grant_room.clear()
        assert (run.mem[run.leased] <= st.mem_total_bytes - run.sim.static_bytes).all(), "lease beyond the GPU"
        assert (run.mem[~run.leased] == 0).all() and (run.share[~run.leased] == 0).all(), "lease left behind"
        assert (run.worker == run.leased).all(), "a lease without its worker, or a worker without a lease"
        assert not (run.running() & run.tripped).any(), "rollout running while the guard is tripped"
        if pc.group_size > 1:  # gang leases: every live group holds all its GPUs, or none
            groups = Counter(m.lease.group_id for m in run.machines if m.lease is not None)
            assert "" not in groups, "a lease outside a gang"
            assert all(n == pc.group_size for n in groups.values()), f"a gang lease not all-or-none: {groups}"
    rep = getattr(run, "rep", None)  # replica leases (rose-replica, rose)
    if rep is not None:
        assert (rep.state == SERVING).any(), "a pool left without a serving replica"
        assert (rep.w >= -1e-9).all(), "negative in-flight work"
        assert (rep.w[rep.state != LENT] == 0).all(), "rollout work on a replica that is not lent"
    if isinstance(run, ShareAllRun):
        assert (run.mem <= st.mem_total_bytes - run.sim.static_bytes).all(), "share-all lends beyond the GPU"


def calibration(interference: dict | None, weights: dict | None) -> dict:
    """SimConfig fields from benchmark results (`rose bench interference|weights --json` objects).

    Interference: the result read as a profile (`interference`, rose.sim.interference.from_bench),
    which the run uses; beside it the linear model's alpha the result implies (`alpha`, for
    `rose paper-check`'s labelled column and the report). Alpha from a GPU (`alpha_per_share`, rose.bench._cuda): the least-squares slope of
    serving's p99 slowdown over rollout's share with rollout on the lowest-priority CUDA stream,
    the same ``1 + alpha × share`` the serving model applies. From the CPU bench (no
    `alpha_per_share`): it measures a serving step's p99 alone and beside a rollout worker
    running flat out with no protection (every core, no priority, no guard); that phase is a
    share of 1, so ``alpha = unprotected_p99_over_alone - 1``. The unprotected phase is used
    because the simulator models the protection (the guard's pause) itself; the bench's nice-19
    priority is not credited, which makes alpha an upper bound. Weights: ``bytes_ratio_per_step``.
    """
    out: dict = {}
    if interference is not None:
        where = f"rose bench interference ({interference.get('_source', 'result')}, device {interference.get('device', '?')}"
        a = interference.get("alpha_per_share")
        r = interference.get("unprotected_p99_over_alone")
        if a is not None and (isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) or a < 0):
            raise ProfileError("--interference-bench: alpha_per_share must be a number >= 0")
        try:
            out["interference"] = from_bench(interference, str(interference.get("_source", "result")))
        except ProfileError as e:
            raise ProfileError(f"--interference-bench: {str(e).removeprefix('--interference-bench: ')}") from None
        if a is not None:
            out["alpha"] = round(float(a), 4)
            gpu = interference.get("gpu_name")
            out["alpha_source"] = (
                f"{where}{f', {gpu}' if gpu else ''}): p99 slowdown per unit of share, priority streams"
            )
        elif isinstance(r, (int, float)) and not isinstance(r, bool):
            out["alpha"] = round(max(0.0, float(r) - 1.0), 4)
            out["alpha_source"] = f"{where}): unprotected p99 / alone = {r}"
    if weights is not None:
        r = weights.get("bytes_ratio_per_step")
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
            raise ValueError(
                "--weights-bench: expected bytes_ratio_per_step in (0, 1] (the output of `rose bench weights --json`)"
            )
        out["weight_delta_ratio"] = float(r)
        out["weight_ratio_source"] = f"rose bench weights ({weights.get('_source', 'result')})"
    return out


def auto_workers(n_gpus: int, n_win: int, policies) -> int:
    """Processes for `SimConfig.workers` 0: 2 when ROSE runs beside another policy on at least
    PARALLEL_MIN_GPU_WINDOWS GPU-windows, this process may fork (not a daemonic worker, such as
    a `rose paper-check` pool's) and at least 2 CPUs are ours; else 1."""
    forked = [p for p in policies if p in FORKED]
    if not forked or len(forked) == len(policies) or n_gpus * n_win < PARALLEL_MIN_GPU_WINDOWS:
        return 1
    if not hasattr(os, "fork") or multiprocessing.current_process().daemon:
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 2 if cpus >= 2 else 1


def _tallies(run: Run) -> Run:
    """`run` without what only its window loop needs (serving model, scheduling core, lease
    machines, context): what the result is made of, small enough to send between processes."""
    run.sim = None
    run.ctx = None  # type: ignore[assignment]
    if isinstance(run, RoseRun):
        run.core = None  # type: ignore[assignment]
        run.machines = []
    rep = getattr(run, "rep", None)
    if rep is not None:
        rep.sim = rep.ctx = None
    return run


class _Forked(Generic[_T]):
    """`fn()` in a forked child process: `result()` waits for it and gives what it returned (or
    raises its error); `stop()` ends it."""

    def __init__(self, fn: Callable[[], _T]):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: send the result (or the error) and leave without any cleanup
            os.close(r)
            try:
                data = pickle.dumps((True, fn()), protocol=pickle.HIGHEST_PROTOCOL)
            except BaseException as e:  # every error goes to the parent
                try:
                    data = pickle.dumps((False, e))
                except Exception:
                    data = pickle.dumps((False, RuntimeError(f"{type(e).__name__}: {e}")))
            with os.fdopen(w, "wb") as f:
                f.write(data)
            os._exit(0)
        os.close(w)
        self.pid, self.fd = pid, r

    def result(self) -> _T:
        with os.fdopen(self.fd, "rb") as f:
            data = f.read()
        os.waitpid(self.pid, 0)
        if not data:
            raise RuntimeError("the simulation's second process ended without a result")
        ok, value = pickle.loads(data)
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        os.close(self.fd)
        os.waitpid(self.pid, 0)


def auto_decide_every(n_gpus: int, n_win: int, period_s: float, pc: PolicyConfig) -> int:
    """Windows per policy event: 1 while the run needs at most DECIDE_CALLS_BUDGET calls, else the
    smallest factor under it, kept below the lease renewal margin (so leases never lapse)."""
    k = max(1, math.ceil(n_gpus * n_win / DECIDE_CALLS_BUDGET))
    cap = max(1, math.floor((pc.renew_before_s - 1e-9) / period_s))
    return min(k, cap)


def _static_episodes(ctx: RunContext) -> float:
    """Episodes the static pool's rollout gives the trainer in the run (its ledger alone; no
    serving involved)."""
    led = Ledger(ctx.ep, ctx.rollout.reprefill_units, ctx.train_step_s)
    w = np.zeros(1)
    for _ in range(ctx.n_win):
        led.progress(w, np.array([ctx.ded_fill]), np.array([ctx.ded_rate * ctx.dt]))
        led.train(ctx.dt)
    return led.trained


def simulate_seeds(trace: Trace, cfg: SimConfig, seeds: int = 1) -> dict:
    """`simulate` under seeds cfg.seed, cfg.seed + 1, ...: one result with each policy's mean and
    95 % interval over the seeds (rose.sim.report.across_seeds); one seed: simulate's result."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    if seeds == 1:
        return simulate(trace, cfg)
    runs = [
        simulate(trace, replace(cfg, seed=cfg.seed + k, record_series=cfg.record_series and k == 0))
        for k in range(seeds)
    ]
    return across_seeds(runs)
