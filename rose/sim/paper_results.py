"""The results of `rose paper-check` and its targets: `Results` holds the runs by table and cell,
`targets()` checks the paper's claim made checkable (docs/paper-check.md "Targets") and says, for
a missed one, which constant holds it back.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

from rose.obs.stats import mean_ci95
from rose.sim.ledger import trainer_rate
from rose.sim.paper_plan import LINEAR, CheckConfig, Job, model_cell
from rose.sim.report import VALID_STATIC_SLO, rose_vs_share_all
from rose.sim.runs import ELASTIC_CAP_FRAC, ELASTIC_PROVISION_S

PAPER_CLAIM = "1.20–3.31× RL throughput over the baselines, no serving SLO violation, gain growing with model size"
# The targets (docs/paper-check.md "Targets"): the paper's claim made checkable at G/M = 8.
GAIN_SMALL = 1.5  # ROSE over static at 7B/8B
GAIN_LARGE = 1.2  # ROSE over static at 70B (the paper's lower end, 1.20×)
SLO_GAP = 0.002  # the SLO rule: a policy's SLO attainment at least static's minus this
STATIC_SLO = VALID_STATIC_SLO  # serving alone meets its SLO at least this often (a valid comparison)
BEATS_ELASTIC_TRACES = 2  # ROSE over the elastic baseline on at least this many traces
RATIO_GOAL = 0.95  # ROSE's throughput over share-all's, in a cell where share-all keeps the SLO rule
# the causes of `rose_vs_share_all.gap` (rose.sim.report.share_all_gap): (group, field, name, the
# constant behind it); docs/simulator.md "Where ROSE harvests less than share-all"
CAUSES = (
    ("no_lease_by_reason", "below_threshold", "below the grant threshold", "the grant threshold policy.grant_headroom"),
    ("no_lease_by_reason", "cooldown", "cooldown", "the cooldown after a revoke policy.cooldown_s"),
    ("no_lease_by_reason", "memory", "memory", "the memory margin policy.mem_margin_frac"),
    ("no_lease_by_reason", "other", "no lease, other", "the grant streak policy.grant_streak and policy.max_pause_s"),
    ("", "lease_start", "lease start", "the lease's start: a warm worker's wake-up, or a cold start (rose.sim.models)"),
    ("paused_by", "throttle", "paused (throttle)", "the latency pause policy.revoke_headroom"),
    ("paused_by", "guard", "paused (guard)", "the executors' guard"),
    ("", "share_cap", "share cap", "the share cap policy.max_compute_share"),
)


def _mci(xs: list[float]) -> tuple[float, float | None]:
    """Mean and the half-width of its 95 % interval (None with fewer than two values)."""
    m, ci = mean_ci95(xs)
    return float(m if m is not None else math.nan), None if ci is None else (ci[1] - ci[0]) / 2


def mean_text(xs: list[float], nd: int) -> str:
    m, h = _mci(xs)
    return f"{m:.{nd}f}" if h is None else f"{m:.{nd}f} ± {h:.{nd}f}"


def figures(rs: list[dict], policy: str, key: str) -> list[float]:
    return [r["policies"][policy][key] for r in rs]


def ran_both(rs: list[dict]) -> bool:
    """Whether every run of `rs` ran ROSE and share-all."""
    return bool(rs) and all({"rose", "share-all"} <= r["policies"].keys() for r in rs)


def versus(rs: list[dict]) -> dict:
    """ROSE beside share-all over the seeds' runs `rs` (rose.sim.report.rose_vs_share_all): the
    throughput ratio with its 95 % interval, the SLO difference and the mean gap split."""
    gaps = [(r.get("rose_vs_share_all") or {}).get("gap") for r in rs]
    return rose_vs_share_all([r["policies"] for r in rs], [g for g in gaps if g] if all(gaps) else None)


def _ratios(rs: list[dict]) -> list[float]:
    """Per seed: ROSE's episodes over share-all's (the simulator's `throughput_ratio`)."""
    ratios = [versus([r])["throughput_ratio"] for r in rs]
    return [math.nan if x is None else x for x in ratios]


class Results:
    """The runs of a check, by table and cell; `profile` is the main runs' profile label."""

    def __init__(self, cc: CheckConfig, jobs: Sequence[Job], results: Sequence[dict]):
        self.cc = cc
        self.by: dict[tuple[str, str, str, float | str | None], list[dict]] = {}
        for j, r in zip(jobs, results):
            self.by.setdefault((j.kind, j.trace, j.model, None if j.kind == "main" else j.value), []).append(r)
        first = next((r for j, r in zip(jobs, results) if j.kind == "main"), {})
        self.profile: dict = first.get("interference_profile") or {"mechanism": "?", "source": "?"}

    def main(self, t: str, m: str) -> list[dict]:
        return self.by[("main", t, m, None)]

    def fig(self, t: str, m: str, policy: str, key: str) -> list[float]:
        return figures(self.main(t, m), policy, key)

    def ratio(self, t: str, m: str, a: str, b: str) -> list[float]:
        """Per seed: policy a's episodes over policy b's."""
        rs = self.main(t, m)
        return [r["policies"][a]["episodes"] / max(1, r["policies"][b]["episodes"]) for r in rs]

    def slo_gap(self, t: str, m: str, policy: str, rs: list[dict] | None = None) -> list[float]:
        """Per seed: the policy's SLO attainment in `rs` (default: the main runs) minus static's
        in the main run of the same seed (static's serving runs without rollout: no profile)."""
        rs = self.main(t, m) if rs is None else rs
        return [
            a - s for a, s in zip(figures(rs, policy, "slo_attainment"), self.fig(t, m, "static", "slo_attainment"))
        ]

    def keeps(self, t: str, m: str, policy: str, rs: list[dict] | None = None) -> bool:
        """Whether the policy keeps the SLO rule: attainment ≥ static's − SLO_GAP, mean over the seeds."""
        gap = self.slo_gap(t, m, policy, rs)
        return bool(gap) and statistics.fmean(gap) >= -SLO_GAP

    def sweep(self, kind: str, t: str, m: str, v: float | str) -> list[dict]:
        """A sweep's runs of a cell; the main runs' first seeds at the main runs' own value."""
        own = {
            "profile": self.profile["mechanism"],
            "gm": self.cc.gm,
            "cap": ELASTIC_CAP_FRAC,
            "provision": ELASTIC_PROVISION_S,
        }[kind]
        if v == own:
            return self.main(t, m)[: self.cc.sweep_seeds if kind not in ("cap", "provision") else 1]
        return self.by.get((kind, t, m, v), [])

    def profile_keys(self) -> list[str]:
        """The profile sweep's keys: the main profile's mechanism, the other measured ones, the
        linear model's alphas in increasing order."""
        keys = {str(k[3]) for k in self.by if k[0] == "profile"} - {self.profile["mechanism"]}
        linear = sorted((k for k in keys if k.startswith(LINEAR)), key=lambda k: float(k.removeprefix(LINEAR)))
        return [self.profile["mechanism"], *sorted(keys - set(linear)), *linear]

    def label(self, key: str) -> str:
        """A profile key as the tables show it."""
        if key.startswith(LINEAR):
            return f"{key} (model, not measured)"
        return f"{key} (measured{', main runs' if key == self.profile['mechanism'] else ''})"

    def source(self, key: str) -> str:
        """Where a swept profile comes from (its runs' `interference_profile.source`)."""
        if key == self.profile["mechanism"]:
            return self.profile["source"]
        rs: list[dict] = next((rs for k, rs in self.by.items() if k[0] == "profile" and k[3] == key), [{}])
        return (rs[0].get("interference_profile") or {}).get("source", "?")

    def met_with(self, t: str, m: str, ok: Callable[[list[dict]], bool]) -> list[str]:
        """The swept profiles (keys) whose runs of the cell satisfy `ok`."""
        return [k for k in self.profile_keys() if (rs := self.sweep("profile", t, m, k)) and ok(rs)]

    def where(self, keys: list[str]) -> str:
        """What a miss's profile sweep says: the measured profiles it would be met with, else the
        linear rows, else none."""
        measured = [k for k in keys if not k.startswith(LINEAR)]
        if measured:
            return f"met with the {', '.join(measured)} profile{'s' if len(measured) > 1 else ''}"
        if keys:
            return f"missed at every measured profile; met with {', '.join(self.label(k) for k in keys)}"
        return "missed at every measured profile and every linear alpha"


def _is_small(model: str) -> bool:
    return model.partition("@")[0].partition("/")[0].upper() in ("7B", "8B")


def _row(target: str, cell: str, xs: list[float], goal: float, nd: int, why: str, strict: bool = False) -> dict:
    """One target row: the measured mean (met when at least `goal`, above it when `strict`), its
    interval half-width, and for a miss what holds it back."""
    m, h = _mci(xs)
    ok = m > goal if strict else m >= goal
    return {
        "target": target,
        "cell": cell,
        "mean": round(m, 6),
        "ci95_half": None if h is None else round(h, 6),
        "goal": f"{'>' if strict else '≥'} {goal:g}".replace("-", "−"),
        "met": bool(ok),
        "held_back_by": "" if ok else why,
        "text": f"{m:.{nd}f}" if h is None else f"{m:.{nd}f} ± {h:.{nd}f}",
    }


def targets(res: Results, more: Callable[[Results, str, str], list[dict]] | None = None) -> list[dict]:
    """Each target per cell (then `more`'s rows of the cell: rose.sim.paper_kinds.all_targets
    adds the lease kinds'), per model and per trace (growth with size)."""
    rows: list[dict] = []
    for m in res.cc.models:
        for t in res.cc.traces:
            rows += _cell_targets(res, t, m) + (more(res, t, m) if more else [])
        rows += _model_targets(res, m)
    return rows + _growth_targets(res)


def _cell_targets(res: Results, t: str, m: str) -> list[dict]:
    cell = f"{trace_name(t)} {m}"
    goal = GAIN_SMALL if _is_small(m) else GAIN_LARGE
    rows = [
        _row(f"ROSE ≥ {goal:g}× static", cell, res.fig(t, m, "rose", "gain_vs_static"), goal, 3,
             _gain_why(res, t, m, goal)),
        _row(f"SLO ROSE ≥ static − {SLO_GAP:g}", cell, res.slo_gap(t, m, "rose"), -SLO_GAP, 5, _slo_why(res, t, m)),
    ]  # fmt: skip
    if _is_small(m):
        why = (
            "the fleet's provisioning: DEFAULT_LOAD (rose.sim.sim_config) against the SLO scales "
            "TTFT_SLO_SCALE / TPOT_SLO_SCALE (rose.sim.requests); not swept"
        )
        rows.append(_row(f"SLO static ≥ {STATIC_SLO:g}", cell, res.fig(t, m, "static", "slo_attainment"),
                         STATIC_SLO, 5, why))  # fmt: skip
    if res.keeps(t, m, "share-all"):
        rows.append(_row(f"ROSE / share-all ≥ {RATIO_GOAL:g} where share-all keeps the SLO rule", cell,
                         _ratios(res.main(t, m)), RATIO_GOAL, 3, _ratio_why(res, t, m)))  # fmt: skip
    return rows


def _breaks(res: Results, t: str, m: str, rs: list[dict] | None = None) -> bool:
    """Share-all breaks the SLO rule where ROSE keeps it."""
    return not res.keeps(t, m, "share-all", rs) and res.keeps(t, m, "rose", rs)


def _model_targets(res: Results, m: str) -> list[dict]:
    traces = res.cc.traces
    n = sum(_breaks(res, t, m) for t in traces)
    beats = sum(statistics.fmean(res.ratio(t, m, "rose", "elastic")) > 1.0 for t in traces)
    return [
        _row("share-all breaks the SLO rule where ROSE keeps it, in ≥ 1 cell", m, [float(n)], 1, 0,
             _breaks_why(res, m)),
        _row(f"ROSE beats elastic on ≥ {BEATS_ELASTIC_TRACES} traces", m, [float(beats)], BEATS_ELASTIC_TRACES, 0,
             _elastic_why(res, m)),
    ]  # fmt: skip


def _growth_targets(res: Results) -> list[dict]:
    """Per trace and GPU: ROSE's gain at the largest model cell minus at the smallest (the
    paper's gain growing with model size)."""
    from rose.sim.models import model_size

    cc = res.cc
    by_gpu: dict[str, list[str]] = {}
    for m in cc.models:
        by_gpu.setdefault(model_cell(m, cc.gpu)["gpu"], []).append(m)

    def params(m: str) -> float:
        return model_size(model_cell(m, cc.gpu)["model"]).params

    rows = []
    for ms in by_gpu.values():
        small, large = min(ms, key=params), max(ms, key=params)
        for t in cc.traces if params(small) < params(large) else ():
            gains = {m: res.fig(t, m, "rose", "gain_vs_static") for m in (small, large)}
            d = [b - a for a, b in zip(gains[small], gains[large])]
            why = _growth_why(res, t, small, large)
            rows.append(
                _row("ROSE's gain grows with model size", f"{trace_name(t)} {small} → {large}", d, 0, 3, why, True)
            )
    return rows


def _causes(g: dict) -> list[tuple[str, str, float]]:
    """(name, constant, fraction of share-all's harvest) of each cause in a gap split."""
    return [
        (name, const, float((g.get(grp) or {}).get(k, 0.0) if grp else g.get(k, 0.0))) for grp, k, name, const in CAUSES
    ]


def _gap_text(g: dict) -> str:
    """A gap split in words: ROSE's part of share-all's harvest on serving GPUs and each cause's."""
    if not g:
        return "no gap split in the runs"
    causes = ", ".join(f"{name} {v:.3f}" for name, _c, v in _causes(g))
    return f"of share-all's harvest on serving GPUs ROSE does {g.get('rose', 0.0):.3f}; {causes}; unfinished {g.get('unfinished', 0.0):.3f}"


def _held_back(g: dict) -> str:
    """The cause that costs ROSE most against share-all, with the constant behind it."""
    if not g:
        return "no gap split in the runs"
    name, const, v = max(_causes(g), key=lambda c: c[2])
    gap = 1.0 - g.get("rose", 0.0)
    if v <= 0.0 or gap <= 0.0:
        return "no cause of the split: ROSE harvests as much; the difference is the work in flight (unfinished)"
    return f"{const} holds it back: {name} {v:.3f} of share-all's harvest, {v / gap:.0%} of the gap"


def _ratio_why(res: Results, t: str, m: str) -> str:
    g = versus(res.main(t, m)).get("gap") or {}
    where = res.where(res.met_with(t, m, lambda rs: ran_both(rs) and statistics.fmean(_ratios(rs)) >= RATIO_GOAL))
    return f"{where}; {_held_back(g)} ({_gap_text(g)})"


def trainer_bound(r: dict) -> float | None:
    """The most RL throughput a run's trainer allows, over static's: the episodes it consumes at
    its rate (rose.sim.ledger.trainer_rate) over the whole run, over static's episodes; None where
    the record lacks the figures or training is free."""
    c = r.get("config") or {}
    try:
        rate = trainer_rate(c["episode"]["episodes_per_step"], c["costs"]["train_step_s"])
        bound = rate * c["duration_s"] / r["policies"]["static"]["episodes"]
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    return bound if math.isfinite(bound) else None


def at_trainer_bound(r: dict, policy: str) -> bool:
    """Whether the trainer, not rollout, set the policy's pace in run `r`: its rollout left at
    least one step's episodes waiting for the trainer at the end (the ledger's `buffered`)."""
    try:
        return bool(r["policies"][policy]["work"]["buffered"] >= r["config"]["episode"]["episodes_per_step"])
    except (KeyError, TypeError):
        return False


def _mean_trainer_bound(runs: list[dict]) -> float | None:
    """The trainer's bound (`trainer_bound`) averaged over `runs`, or None unless ROSE sits at
    it in every one of them and each has a bound."""
    bounds = [trainer_bound(r) for r in runs]
    if not runs or not all(at_trainer_bound(r, "rose") for r in runs) or None in bounds:
        return None
    return statistics.fmean(b for b in bounds if b is not None)


def _trainer_constants(r: dict) -> str:
    """The constants that size a run's trainer, with their values."""
    costs = r["config"]["costs"]
    if str(costs.get("train_step_source", "")).startswith("set"):
        return f"SimConfig.train_step_s ({costs['train_step_s']:g} s a step)"
    mfu = f" {costs['train_mfu']:g}" if "train_mfu" in costs else ""
    return f"its size and speed, SimConfig.train_gpus {costs['train_gpus']} and models.TRAIN_MFU{mfu}"


def _trainer_why(res: Results, t: str, m: str, goal: float) -> str | None:
    """For a gain held back by the trainer (ROSE at its bound in every main run): the constants
    behind it, the bound's gain over static against the goal, and the rollout it left waiting."""
    main = res.main(t, m)
    if (bound := _mean_trainer_bound(main)) is None:
        return None
    c = main[0]["config"]
    rollout = statistics.fmean(
        r["policies"]["rose"]["rollout_episodes"] / r["policies"]["static"]["episodes"] for r in main
    )
    waiting = statistics.fmean(r["policies"]["rose"]["work"]["buffered"] for r in main)
    return (
        f"the trainer holds it back ({_trainer_constants(main[0])}): a step of {c['episode']['episodes_per_step']} episodes "
        f"trains in {c['costs']['train_step_s']:.1f} s, at most ×{bound:.3f} of static's episodes in the run "
        f"against the goal ×{goal:g} (×{bound / goal:.2f} of it); ROSE's rollout completed ×{rollout:.3f} of "
        f"static's, {waiting:.0f} episodes left waiting for the trainer"
    )


def _gain_why(res: Results, t: str, m: str, goal: float) -> str:
    cc = res.cc
    h = statistics.fmean(res.fig(t, m, "rose", "harvest_per_serving_gpu"))
    need = (goal - 1.0) / cc.gm
    harvest = f"harvest {h:.4f} per serving GPU, {need:.4f} needed at G/M {cc.gm} (×{h / need:.2f} of it)"
    if trainer := _trainer_why(res, t, m, goal):
        return "; ".join([trainer, f"{harvest}, not binding", *_memory_why(res, t, m, h)])
    parts = [harvest]

    def gain(rs: list[dict]) -> float:
        return statistics.fmean(figures(rs, "rose", "gain_vs_static"))

    ok = res.met_with(t, m, lambda rs: gain(rs) >= goal)
    parts.append(res.where(ok))
    if not ok and (swept := {k: rs for k in res.profile_keys() if (rs := res.sweep("profile", t, m, k))}):
        best = max(swept, key=lambda k: gain(swept[k]))
        parts.append(f"best ×{gain(swept[best]):.3f} with {res.label(best)}")
    return "; ".join(parts + _memory_why(res, t, m, h))


def _memory_why(res: Results, t: str, m: str, h: float) -> list[str]:
    """What GPU memory costs a lease: little work per leased GPU, leases too small to use."""
    main, gpus = res.main(t, m), res.cc.gpus
    leased = statistics.fmean(figures(main, "rose", "mean_leased_gpus"))
    share = statistics.fmean(figures(main, "rose", "mean_leased_compute")) / leased if leased else 0.0
    per_lease = h * gpus / leased if leased else 0.0
    parts = []
    if leased and per_lease < share / 2:
        shard = main[0]["config"]["rollout"]["policy_weight_bytes_per_gpu"] / 2**30
        parts.append(
            f"GPU memory: a leased GPU does {per_lease:.3f} of a dedicated GPU's work at a mean compute share of "
            f"{share:.2f}, its lease holding few episodes beside {shard:.0f} GiB of policy weights per GPU on "
            f"{main[0]['fleet']['gpu']} (the GPU's memory, the model presets, rose.sim.models, and the rollout tensor "
            "parallelism, --rollout-tp)"
        )
    unusable = statistics.fmean(figures(main, "rose", "leases_unusable"))
    if unusable > 0:
        parts.append(
            f"GPU memory: {unusable:.0f} leases too small to hold the policy's weights and one episode beside "
            f"serving on {main[0]['fleet']['gpu']} (the model and GPU presets, rose.sim.models)"
        )
    return parts


def _slo_why(res: Results, t: str, m: str) -> str:
    where = res.where(res.met_with(t, m, lambda rs: res.keeps(t, m, "rose", rs)))
    return (
        f"{where}; the profile's serving p99 ratio against the policy's headroom thresholds "
        "(policy.grant_headroom, policy.revoke_headroom) sets it"
    )


def _breaks_why(res: Results, m: str) -> str:
    """Where share-all would break the SLO rule while ROSE keeps it: the profiles it does at."""
    traces = res.cc.traces
    keys = {k for t in traces for k in res.met_with(t, m, lambda rs: ran_both(rs) and _breaks(res, t, m, rs))}
    sa = [t for t in traces if not res.keeps(t, m, "share-all")]
    now = (
        f"share-all breaks the rule in {len(sa)} of {len(traces)} cells, ROSE too in each"
        if sa
        else "share-all keeps the rule in every cell: its share SHARE_ALL_SHARE and memory SHARE_ALL_MEM_FRAC "
        f"(rose.sim.runs) leave serving within its SLO on the {res.profile['mechanism']} profile"
    )
    return f"{now}; {res.where([k for k in res.profile_keys() if k in keys])}"


def _growth_why(res: Results, t: str, small: str, large: str) -> str:
    def gain(m: str, k: str) -> float:
        rs = res.sweep("profile", t, m, k)
        return statistics.fmean(figures(rs, "rose", "gain_vs_static")) if rs else math.nan

    h = {m: statistics.fmean(res.fig(t, m, "rose", "harvest_per_serving_gpu")) for m in (small, large)}
    keys = [k for k in res.profile_keys() if gain(large, k) > gain(small, k)]
    harvest = (
        f"harvest per serving GPU {h[small]:.4f} at {small}, {h[large]:.4f} at {large} "
        f"(gain ≈ 1 + (G/M) × harvest); {res.where(keys)}"
    )
    at_small, at_large = (_mean_trainer_bound(res.main(t, m)) for m in (small, large))
    if at_small is None or at_large is None:
        return harvest
    return (
        f"the trainer holds it back ({_trainer_constants(res.main(t, large)[0])}): ROSE sits at the trainer's bound in both "
        f"cells, at most ×{at_small:.3f} of static's episodes at {small}, ×{at_large:.3f} at {large}; {harvest}"
    )


def _elastic_why(res: Results, m: str) -> str:
    cc = res.cc
    parts: list[tuple[float, int]] = []
    for cap in sorted(cc.elastic_caps):
        n = 0
        for t in cc.traces:
            el = res.sweep("cap", t, m, cap)
            if not el:
                continue
            rose = statistics.fmean(r["policies"]["rose"]["episodes"] for r in res.main(t, m))
            n += rose > el[0]["policies"]["elastic"]["episodes"]
        parts.append((cap, n))
    wins = ", ".join(f"{n} at cap {cap:g}×M" for cap, n in parts)
    if not any(n >= BEATS_ELASTIC_TRACES for _cap, n in parts):
        gains = ", ".join(f"×{statistics.fmean(res.fig(t, m, 'rose', 'gain_vs_static')):.3f}" for t in cc.traces)
        return f"not the elastic cap (ROSE wins on {wins}): ROSE's own gain ({gains}), see its gain rows"
    return f"the elastic baseline's cost cap ELASTIC_CAP_FRAC {ELASTIC_CAP_FRAC:g} (rose.sim.runs): ROSE wins on {wins}"


def trace_name(trace: str) -> str:
    return trace.removesuffix(".csv").removesuffix(".jsonl")
