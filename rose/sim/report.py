"""What `rose simulate` reports: the result object (`--json`), the `--report DIR` files
(report.json, report.md and PNG plots, matplotlib Agg) and the paper-check table."""

from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from rose.obs.stats import mean_ci95

if TYPE_CHECKING:
    from rose.sim.models import ModelSize
    from rose.sim.runs import Run, RunContext
    from rose.sim.sim_config import SimConfig
    from rose.sim.traces import Trace

SLO_TOLERANCE = 0.005  # ROSE's attainment counts as equal to static's within this
GAP_TOLERANCE = 1e-6  # |residual| of rose_vs_share_all.gap: ROSE's part and the causes make up share-all's
VALID_STATIC_SLO = 0.95  # a run whose static baseline meets its SLO less often is not a valid comparison
PLOTS = ("serving_p99_vs_slo.png", "throughput.png", "leased_gpus.png")
COLORS = {
    "static": "tab:gray",
    "elastic": "tab:blue",
    "share-all": "tab:red",
    "rose": "tab:green",
    "rose-coresident": "tab:olive",
    "rose-replica": "tab:purple",
}


def result_of(
    trace: Trace,
    cfg: SimConfig,
    ctx: RunContext,
    model: ModelSize,
    load: dict,
    runs: dict[str, Run],
    static_episodes: float,
) -> dict:
    """The JSON-ready result of a run: per policy, its tallies (gain over `static_episodes`, the
    static pool's); the configuration with the load mapping's figures (`load`); the series."""
    hours = ctx.n_win * ctx.dt / 3600.0
    ep = ctx.ep
    pol: dict[str, dict] = {}
    for p, run in runs.items():
        led = run.ledger
        res = {
            # RL throughput: episodes the trainer consumed (rollout's completions, as far as
            # training keeps up: docs/simulator.md "Training")
            "episodes": round(led.trained, 3),
            "episodes_per_hour": round(led.trained / hours, 2),
            "rollout_episodes": led.completed,
            "rl_steps": led.steps(),
            "rl_steps_per_hour": round(led.steps() / hours, 3),
            "gain_vs_static": round(led.trained / static_episodes, 4) if static_episodes > 0 else None,
            "slo_attainment": round(run.slo_ok_gpu_windows / max(1, run.gpu_windows), 5),
            "slo_attainment_all_gpus": round(run.slo_ok_windows / max(1, run.windows), 5),
            "revokes": run.revokes,
            "throttles": run.throttles,
            "weight_sync_bytes": int(run.weight_bytes),
            "weight_sync_bytes_full_broadcast": int(run.weight_bytes_full),
            "work": {
                "produced": round(led.produced, 4),
                "completed": led.completed,
                "in_flight": round(run.in_flight(), 4),
                "parked": round(led.parked, 4),
                "recomputed": round(led.recomputed, 4),
                "consumed": round(led.trained, 3),
                "buffered": round(led.completed - led.trained, 3),
            },
            "min_free_mem_bytes": run.min_free_bytes,
            "harvest_per_serving_gpu": (harvest := harvest_per_serving_gpu(run, ctx)),
            # start of the first window in which rollout ran on a serving GPU (None: it never did)
            "lease_start_s": None if run.lease_start_s is None else round(run.lease_start_s, 3),
        }
        if run.harvests:
            res["gain_from_harvest"] = round(1.0 + ctx.G / ctx.M * harvest, 4)
            res.update(
                mean_leased_gpus=round(run.lease_gpu_s / (hours * 3600.0), 3),
                mean_leased_compute=round(run.lease_share_s / (hours * 3600.0), 3),
                leases_unusable=run.leases_unusable,
            )
        res.update(run.policy_tallies())
        pol[p] = res
    rollout, slo = ctx.rollout, ctx.slo
    profile = ctx.profile if ctx.profile is not None else cfg.profile()
    out: dict = {
        "policies": pol,
        "interference_profile": profile.label(),
        "fleet": {
            "serving_gpus": ctx.G,
            "dedicated_gpus": ctx.M,
            "model": model.name,
            "tensor_parallel": model.tp,
            "gpu": ctx.gpu.name,
            "lease_group_size": ctx.policy.group_size,  # GPUs per ROSE lease: gang leases when > 1
            "rollout_tensor_parallel": ctx.rollout.tp,
        },
        "config": {
            "trace": trace.name,
            "trace_format": trace.fmt,
            "gpus": ctx.G,
            "dedicated": ctx.M,
            "model_size": model.name,
            "gpu": ctx.gpu.name,
            "duration_s": ctx.n_win * ctx.dt,
            "period_s": ctx.dt,
            "windows": ctx.n_win,
            "seed": cfg.seed,
            "load": cfg.load,
            "decide_every": ctx.decide_every,
            "telemetry_period_s": ctx.decide_every * ctx.dt,
            "slo_ms": {"ttft_p99": slo.ttft_p99, "tpot_p99": slo.tpot_p99},
            **load,
            "interference_alpha": cfg.alpha,  # the linear model's alpha, when given (a sweep or a bench's fit)
            "interference_alpha_source": cfg.alpha_source if cfg.alpha is not None else None,
            # what starting rollout costs each policy (rose.sim.models: sources)
            "costs": start_costs(cfg, ctx),
            "weight_delta_ratio": cfg.weight_delta_ratio,
            "weight_delta_ratio_source": cfg.weight_ratio_source,
            "episode": asdict(ep),
            "rollout": {
                "dedicated_batch": rollout.dedicated_batch,
                "dedicated_episodes_per_s": round(rollout.dedicated_rate, 5),
                "policy_weight_bytes_per_gpu": model.weight_bytes_per_gpu,
                "kv_bytes_per_episode": int(rollout.kv_episode),
            },
            "slo_tolerance": SLO_TOLERANCE,
            "replica_pool": asdict(cfg.replica_pool),  # the pool decision's settings as configured
        },
    }
    out.update(validity(pol))
    if "rose" in pol and "share-all" in pol:
        out["rose_vs_share_all"] = rose_vs_share_all([pol], [share_all_gap(runs["rose"], runs["share-all"])])
    if cfg.record_series:
        out["series"] = {p: run.series for p, run in runs.items()}
    return out


def start_costs(cfg: SimConfig, ctx: RunContext) -> dict:
    """The start costs the run used, each with its source."""
    from rose.sim.models import COLD_SOURCE, RESUME_S, RESUME_SOURCE, TRAIN_SOURCE, WAKE_SOURCE
    from rose.sim.runs import ELASTIC_PROVISION_S

    return {
        "lease_start_s": round(ctx.lease_start_s, 4),  # ROSE's every lease, share-all's workers once
        "lease_start_source": WAKE_SOURCE if cfg.lease_start_s is None else "set (--lease-start-s)",
        "warm_workers_per_node": ctx.warm_workers,
        "cold_start_s": round(ctx.cold_start_s, 4),  # a lease that finds no ready warm worker on its node
        "cold_start_source": COLD_SOURCE if cfg.cold_start_s is None else "set (--cold-start-s)",
        "warm_build_s": round(ctx.warm_build_s, 4),  # a warm worker's replacement, launch to ready
        "train_step_s": round(ctx.train_step_s, 4),  # one RL step's training, beside rollout
        "train_step_source": TRAIN_SOURCE if cfg.train_step_s is None else "set (train_step_s)",
        "train_gpus": cfg.train_gpus or ctx.M,
        "train_mfu": cfg.train_mfu,
        "resume_s": ctx.resume_s,
        "resume_source": RESUME_SOURCE if cfg.resume_s == RESUME_S else "set (--resume-s)",
        "elastic_provision_s": ctx.elastic_provision_s,
        "elastic_provision_source": "assumption (no measurement); swept in the paper check"
        if cfg.elastic_provision_s == ELASTIC_PROVISION_S
        else "set (--elastic-provision-s)",
    }


def harvest_per_serving_gpu(run: Run, ctx: RunContext) -> float:
    """Rollout work the policy did on serving GPUs (leases, shares) in dedicated-GPU
    equivalents (the work one dedicated rollout GPU does over the run), per serving GPU: what
    the ledger produced beyond the dedicated pool and the external GPUs, whose rates are fixed.
    So ``gain ≈ 1 + (G / M) × harvest`` (docs/simulator.md "What the gain is made of")."""
    seconds = ctx.n_win * ctx.dt
    per_gpu = ctx.rollout.dedicated_rate  # episodes/s of one dedicated GPU
    own = ctx.ded_rate * seconds + run.ext_gpu_s * per_gpu
    if per_gpu <= 0 or seconds <= 0:
        return 0.0
    return round(max(0.0, run.ledger.produced - own) / (per_gpu * seconds * ctx.G), 6)


def share_all_gap(rose: Run, share_all: Run) -> dict:
    """Where ROSE harvests less than share-all in one run (docs/simulator.md "Where ROSE
    harvests less than share-all"): share-all's rollout work on serving GPUs (episodes
    produced, `share_all_harvested_episodes`) split into ROSE's own part (`rose`) and the work
    share-all does on a GPU-window that ROSE does not, by cause, each a fraction of it;
    ``rose + no_lease + lease_start + paused + share_cap - above_share_all + residual = 1``.
    `unfinished`: work ROSE produced but did not complete beyond share-all's (in flight, parked,
    recomputed), so that the causes, `unfinished` and `residual` add up to the episode gap
    (share-all's completed minus ROSE's) over share-all's harvest."""
    from rose.sim.rose_run import GAP_CAUSES, NO_LEASE_WHY

    sa = share_all.harvested
    rg, by = getattr(rose, "gap", {}), getattr(rose, "no_lease_gap", {})
    if sa <= 0:  # nothing to split: every part 0
        zero = dict.fromkeys(("rose", *GAP_CAUSES), 0.0)
        return {
            "share_all_harvested_episodes": 0.0,
            **zero,
            "no_lease_by_reason": dict.fromkeys(NO_LEASE_WHY, 0.0),
            "paused_by": {"guard": 0.0, "throttle": 0.0},
            "residual": 0.0,
            "tolerance": GAP_TOLERANCE,
            "unfinished": 0.0,
        }
    parts = {k: rg.get(k, 0.0) / sa for k in GAP_CAUSES}
    mine = rose.harvested / sa
    unfinished = (
        rose.ledger.produced - rose.ledger.completed - (share_all.ledger.produced - share_all.ledger.completed)
    ) / sa
    residual = 1.0 - mine - sum(parts.values()) + 2.0 * parts["above_share_all"]
    return {
        "share_all_harvested_episodes": round(sa, 4),
        "rose": round(mine, 6),
        **{k: round(v, 6) for k, v in parts.items()},
        "no_lease_by_reason": {k: round(v / sa, 6) for k, v in by.items()},
        "paused_by": {k: round(v / sa, 6) for k, v in getattr(rose, "paused_gap", {}).items()},
        "residual": round(residual, 9),
        "tolerance": GAP_TOLERANCE,
        "unfinished": round(unfinished, 6),
    }


def mean_gap(gaps: list[dict]) -> dict:
    """Seeds' `share_all_gap` results as one: each figure's mean, and every seed's (`per_seed`)."""
    first = gaps[0]
    out: dict = {}
    for k, v in first.items():
        if isinstance(v, dict):
            out[k] = {j: round(statistics.fmean(g[k][j] for g in gaps), 6) for j in v}
        elif all(k in g for g in gaps):
            out[k] = round(statistics.fmean(g[k] for g in gaps), 9 if k == "residual" else 6)
    if len(gaps) > 1:
        out["per_seed"] = gaps
    return out


def rose_vs_share_all(per_seed: list[dict[str, dict]], gaps: list[dict] | None = None) -> dict:
    """ROSE beside share-all, from each seed's policy results: `throughput_ratio` (ROSE's
    episodes over share-all's, the mean of the seeds' ratios), its 95 % Student t interval over
    the seeds (`throughput_ratio_ci95`, None with one seed), `slo_difference` (ROSE's SLO
    attainment minus share-all's, mean over the seeds) and, given each seed's `share_all_gap`,
    `gap`: their mean (rose.sim.report.mean_gap)."""
    ratios, diffs = [], []
    for pol in per_seed:
        r, s = pol["rose"], pol["share-all"]
        ratios.append(r["episodes"] / s["episodes"] if s["episodes"] > 0 else float("nan"))
        diffs.append(r["slo_attainment"] - s["slo_attainment"])
    finite = [x for x in ratios if x == x]
    m, ci = mean_ci95(finite) if len(finite) == len(ratios) else (None, None)
    return {
        "throughput_ratio": None if m is None else round(m, 6),
        "throughput_ratio_ci95": None if ci is None else [round(ci[0], 6), round(ci[1], 6)],
        "ci_basis": "seeds (Student t over the per-seed ratios)",
        "slo_difference": round(statistics.fmean(diffs), 6),
        **({"gap": mean_gap(gaps)} if gaps else {}),
    }


def validity(policies: dict[str, dict]) -> dict:
    """`valid` and, when not, `invalid_reason`: a run is a valid comparison only when serving
    alone (the static baseline's serving) meets its SLO in at least VALID_STATIC_SLO of the
    (GPU, window) pairs; below that the fleet is overloaded and every gain is measured on it."""
    base = policies.get("static") or policies.get("elastic")  # the same serving, alone
    if base is None:
        return {"valid": None, "invalid_reason": "no static baseline in the run"}
    att = base["slo_attainment"]
    if att < VALID_STATIC_SLO:
        return {
            "valid": False,
            "invalid_reason": f"static baseline SLO attainment {att:.5f} < {VALID_STATIC_SLO:g}: serving is overloaded",
        }
    return {"valid": True}


def markdown(result: dict) -> str:
    """The report as markdown: configuration, the policy table, and where the numbers come from."""
    c = result["config"]
    lines = [
        f"# rose simulate: {c['trace']}",
        "",
        f"{c['gpus']} serving GPUs ({c['gpu']}, {c['model_size']}, tensor parallel "
        f"{result['fleet']['tensor_parallel']}; rollout TP {result['fleet']['rollout_tensor_parallel']}) "
        f"and {c['dedicated']} dedicated rollout GPUs, "
        f"{c['duration_s']:g} s of trace time in {c['windows']} windows of {c['period_s']:g} s; "
        f"{_seeds_text(c)}; wall time {result['wall_s']:.1f} s.",
        "",
        *([f"**Not a valid comparison: {result['invalid_reason']}.**", ""] if result.get("valid") is False else []),
        f"- Serving SLO (p99): TTFT {c['slo_ms']['ttft_p99']:g} ms, TPOT {c['slo_ms']['tpot_p99']:g} ms.",
        f"- Load: {c['rps_per_gpu']:g} requests/s per GPU (busiest minute at {c['load']:g} of its capacity, "
        f"{c['capacity_bound']}-bound; "
        f"peak/mean {c['peak_to_mean']:g}); trace compressed ×{c['trace_compress']:g}, "
        f"{c['trace_copies']} shifted copies, each request kept with p={c['trace_keep']:g}.",
        f"- Policy telemetry every {c['telemetry_period_s']:g} s (decide_every {c['decide_every']}).",
        f"- Interference profile ({result['interference_profile']['mechanism']}): "
        f"{result['interference_profile']['source']}.",
        f"- Weight delta ratio {c['weight_delta_ratio']:g}: {c['weight_delta_ratio_source']}.",
        f"- Rollout: {c['rollout']['dedicated_batch']} concurrent episodes per dedicated GPU, "
        f"{c['rollout']['dedicated_episodes_per_s']:g} episodes/s each; "
        f"{c['episode']['episodes_per_step']} episodes per RL step.",
        "",
        "| policy | episodes/h | RL steps/h | gain vs static | SLO attainment | harvest per serving GPU | "
        "1 + (G/M) × harvest | revokes | throttles | weight sync GB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    gm = result["fleet"]["serving_gpus"] / result["fleet"]["dedicated_gpus"]
    for p, r in result["policies"].items():
        ident = f"{r['gain_from_harvest']:.3f}" if "gain_from_harvest" in r else "–"
        lines.append(
            f"| {p} | {r['episodes_per_hour']:.1f} | {r['rl_steps_per_hour']:.2f} | "
            f"{with_ci(r, 'gain_vs_static', 3)} | {with_ci(r, 'slo_attainment', 5)} | "
            f"{with_ci(r, 'harvest_per_serving_gpu', 4)} | {ident} | {r['revokes']:g} | {r['throttles']:g} | "
            f"{r['weight_sync_bytes'] / 1e9:.1f} |"
        )
    lines += [
        "",
        "SLO attainment is the fraction of (GPU, window) pairs whose TTFT and TPOT p99 are both within "
        "the SLO. Harvest is the rollout work done on serving GPUs, in dedicated rollout GPUs' worth, per "
        f"serving GPU; the gain is about 1 + (G/M) × harvest with G/M = {gm:g} (the pipeline fill and the "
        "work still in flight at the end make up the difference). ± is the half-width of a 95 % Student t "
        "interval over the seeds. The model behind every figure is described in `docs/simulator.md`.",
        "",
    ]
    lines += [f"![{name}]({name})" for name in PLOTS if "series" in result]
    return "\n".join(lines) + "\n"


HEADLINE = ("episodes_per_hour", "gain_vs_static", "slo_attainment", "harvest_per_serving_gpu")


def across_seeds(results: list[dict]) -> dict:
    """Runs of one configuration under several seeds, as one result: each policy's numeric
    figures are their mean over the seeds, and ``ci95`` holds the two-sided 95 % Student t
    interval [low, high] of each HEADLINE figure (None with one seed); ``per_seed`` keeps every
    seed's headline figures. The first seed's run gives the rest (fleet, config, series)."""
    first = results[0]
    out = {k: v for k, v in first.items() if k not in ("policies", "wall_s")}
    out["config"] = {**first["config"], "seeds": [r["config"]["seed"] for r in results]}
    pol: dict[str, dict] = {}
    for p, r0 in first["policies"].items():
        rs = [r["policies"][p] for r in results]
        agg: dict = {}
        for k, v in r0.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and all(x.get(k) is not None for x in rs):
                agg[k] = round(statistics.fmean(x[k] for x in rs), 6)
            elif k == "grant_prediction":  # quantiles do not average: every seed's
                agg[k] = [x.get(k) for x in rs]
            elif not isinstance(v, dict):
                agg[k] = v
        agg["ci95"] = {}
        for k in HEADLINE:
            if k in r0 and all(x.get(k) is not None for x in rs):
                _m, ci = mean_ci95([x[k] for x in rs])
                agg["ci95"][k] = None if ci is None else [round(ci[0], 6), round(ci[1], 6)]
        pol[p] = agg
    out["policies"] = pol
    out["per_seed"] = [
        {
            "seed": r["config"]["seed"],
            "policies": {p: {k: x.get(k) for k in HEADLINE} for p, x in r["policies"].items()},
        }
        for r in results
    ]
    if all("rose_vs_share_all" in r for r in results):
        gaps = [r["rose_vs_share_all"].get("gap") for r in results]
        out["rose_vs_share_all"] = rose_vs_share_all(
            [r["policies"] for r in results], [g for g in gaps if g] if all(gaps) else None
        )
    if any("valid" in r for r in results):
        bad = [r for r in results if r.get("valid") is False]
        out["valid"] = not bad and all(r.get("valid") for r in results)
        if bad:
            out["invalid_reason"] = f"seed {bad[0]['config']['seed']}: {bad[0].get('invalid_reason')}"
        else:
            out.pop("invalid_reason", None)
    out["wall_s"] = round(sum(r["wall_s"] for r in results), 3)
    return out


def with_ci(r: dict, key: str, nd: int) -> str:
    """`key` of a policy's result, with ± the half-width of its 95 % interval when it has one."""
    v = r[key]
    ci = (r.get("ci95") or {}).get(key)
    return f"{v:.{nd}f}" if not ci else f"{v:.{nd}f} ± {(ci[1] - ci[0]) / 2:.{nd}f}"


def _seeds_text(c: dict) -> str:
    seeds = c.get("seeds")
    return f"seed {c['seed']}" if not seeds or len(seeds) < 2 else f"seeds {', '.join(map(str, seeds))}"


def write_report(result: dict, out_dir: str | Path) -> list[Path]:
    """Write report.json, report.md and the plots into `out_dir`; returns the paths written."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths = [d / "report.json", d / "report.md"]
    paths[0].write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    paths[1].write_text(markdown(result))
    if "series" in result:
        paths += _plots(result, d)
    return paths


def _plots(result: dict, d: Path) -> list[Path]:
    from rose.obs.figures import pyplot, save

    plt = pyplot()
    series, pol = result["series"], result["policies"]
    names = list(series)
    out = []

    fig, axes = plt.subplots(len(names), 1, figsize=(10, 2.2 * len(names) + 0.6), sharex=True, squeeze=False)
    for ax, p in zip(axes[:, 0], names):
        s = series[p]
        t = [x / 60 for x in s["t"]]
        ax.plot(t, s["ttft_p99_max_ratio"], lw=0.8, label="worst GPU TTFT p99 / SLO")
        ax.plot(t, s["tpot_p99_max_ratio"], lw=0.8, label="worst GPU TPOT p99 / SLO")
        ax.axhline(1.0, color="red", lw=1, ls="--", label="SLO")
        if any(s["leased"]):
            ax2 = ax.twinx()
            ax2.fill_between(t, s["running"], step="post", color="tab:green", alpha=0.2, label="GPUs running rollout")
            ax2.set_ylabel("leased GPUs", fontsize=8)
            ax2.set_ylim(0, max(1, max(s["leased"])) * 1.1)
        ax.set_yscale("log")
        ax.set_ylabel("p99 / SLO")
        ax.set_title(f"{p}: SLO attainment {pol[p]['slo_attainment']:.4f}", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("trace time (min)")
    out.append(save(fig, d / PLOTS[0]))

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for p in names:
        s = series[p]
        a1.plot([x / 60 for x in s["t"]], s["episodes"], label=p, color=COLORS[p])
    a1.set_xlabel("trace time (min)")
    a1.set_ylabel("episodes completed")
    a1.legend(fontsize=8)
    eph = [pol[p]["episodes_per_hour"] for p in names]
    bars = a2.bar(names, eph, color=[COLORS[p] for p in names])
    for b, p in zip(bars, names):
        a2.annotate(
            f"×{pol[p]['gain_vs_static']:.2f}\nSLO {pol[p]['slo_attainment']:.3f}",
            (b.get_x() + b.get_width() / 2, b.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    a2.set_ylabel("episodes / hour")
    a2.set_ylim(0, max(eph + [1]) * 1.25)
    a2.set_title("RL rollout throughput (gain vs static, serving SLO attainment)", fontsize=9)
    out.append(save(fig, d / PLOTS[1]))

    fig, ax = plt.subplots(figsize=(10, 3.5))
    for p in names:
        s = series[p]
        t = [x / 60 for x in s["t"]]
        if p.startswith("rose") or p == "share-all":
            ax.plot(t, s["leased"], lw=0.9, color=COLORS[p], label=f"{p}: leased serving GPUs")
            if p == "rose":
                ax.plot(t, s["running"], lw=0.9, ls=":", color="black", label="rose: running (not paused)")
        if p == "elastic":
            ax.plot(t, s["external_gpus"], lw=0.9, color=COLORS[p], label="elastic: external GPUs")
    ax.set_xlabel("trace time (min)")
    ax.set_ylabel("GPUs")
    ax.legend(fontsize=8)
    ax.set_title(f"GPUs lent to rollout over time ({result['config']['gpus']} serving GPUs)", fontsize=9)
    out.append(save(fig, d / PLOTS[2]))
    return out
