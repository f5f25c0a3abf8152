"""The demo's report: figures computed from what the run left in Kafka and Redis (pure
functions of an `Observed` and the run's timeline), written as report.json, report.md and PNG
plots (rose.demo.plots).

Definitions (also printed in report.md):
- serving_slo_attainment: fraction of telemetry windows, over every serving GPU and the
  measured run, whose TTFT p99 and TPOT p99 are both within that GPU's SLO.
- episodes_per_min: the run alternates leases-off windows (no scheduler running: no grant or
  renewal is issued; the leases of the window before lapse at their expiry, policy.ttl_s) and
  leases-on windows (the scheduler running; lease start-up included), leases off first. Each
  episode counts in the window it started in (first taken by a worker), whenever it finished.
  .dedicated_only / .with_leases: the mean episodes per minute over the windows of each kind;
  .ci95_*: its two-sided 95 % Student t interval over those windows, [low, high].
- measured_device: the co-served device whose latency is measured, not modelled: its SLO
  attainment (as above, its windows only; its SLO is the run's configured serving SLO), and the
  p99 TTFT and TPOT (each request's mean time per output token) over the requests it finished
  in the run, served alone and while a rollout lease ran on it. .slo_attainment_by_window: its
  SLO attainment over the telemetry windows inside the leases-off (dedicated_only) and leases-on
  (with_leases) windows. .core (CPU): what its core did in each kind of window, from the core's
  /proc/stat line, in core-seconds summed over the windows: idle_s (idle + iowait), serving_s
  (user + system + irq + softirq: the nice-0 work, the serving engine), rollout_s (nice: the
  leased workers, which run niced, under SCHED_IDLE on that core), counted_s (their sum).
- promise: serving keeps its SLO while leases add rollout. measured_slo_with_leases_within_0_01:
  the measured device's SLO attainment in the leases-on windows is at least its leases-off
  attainment − 0.01; episodes_ci95_above_leases_off_mean: the low end of the 95 % interval of
  episodes/min with leases is above the leases-off mean; held: both.
- revoke_latency_ms: revoke command (its Kafka record timestamp, stamped when the scheduler
  produced it inside its transaction) → lease state `revoked` (its record timestamp: the worker
  has exited and its memory is back). `to_revoking_ms`: → `revoking`, published as the executor
  raises the worker's pause flag.
- weight_bytes_ratio: payload bytes sent on the weight stream / bytes of a full broadcast of
  every published version (the first version is a full keyframe), for the toy task at the
  trainer's learning rate (trainer_lr).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from rose.demo import device_core, plots
from rose.demo.coserve import latency_summary
from rose.demo.observed import Observed, lease_intervals
from rose.demo.windows import started_at, window_rates
from rose.obs.stats import mean_ci95, percentile

# the two kinds of window, by the key the report gives each (the window's `leases` flag)
WINDOW_KINDS = (("dedicated_only", False), ("with_leases", True))
SLO_TOLERANCE = 0.01  # the promise: serving's attainment with leases at most this below leases off
IDLE_LITTLE = 0.05  # a core idle less than this fraction of a window's time had next to nothing to harvest


def leased_at(intervals: list[tuple[float, float]], t: float) -> bool:
    return any(a <= t < b for a, b in intervals)


def within_slo(row) -> bool:
    """A telemetry row (ts, ttft p99, tpot p99, slo ttft, slo tpot, ...) with both p99s in its SLO."""
    _ts, ttft, tpot, s_ttft, s_tpot, *_ = row
    return ttft <= s_ttft and tpot <= s_tpot


def slo_attainment(obs: Observed, t0: float, t_end: float, intervals) -> dict:
    per_gpu = {}
    ok_all = n_all = 0
    split = {"leased": [0, 0], "not_leased": [0, 0]}
    for gpu, rows in sorted(obs.telemetry.items()):
        ok = n = 0
        for row in rows:
            ts = row[0]
            if not t0 <= ts <= t_end:
                continue
            good = within_slo(row)
            ok += good
            n += 1
            bucket = split["leased" if leased_at(intervals.get(gpu, []), ts) else "not_leased"]
            bucket[0] += good
            bucket[1] += 1
        per_gpu[gpu] = {"windows": n, "within_slo": ok, "attainment": round(ok / n, 4) if n else None}
        ok_all += ok
        n_all += n
    return {
        "overall": round(ok_all / n_all, 4) if n_all else None,
        "windows": n_all,
        "per_gpu": per_gpu,
        "while_leased": round(split["leased"][0] / split["leased"][1], 4) if split["leased"][1] else None,
        "while_not_leased": round(split["not_leased"][0] / split["not_leased"][1], 4)
        if split["not_leased"][1]
        else None,
        "windows_while_leased": split["leased"][1],
    }


def revoke_latency(obs: Observed) -> dict:
    states: dict[tuple[str, str], int] = {}
    for s in obs.lease_states:
        key = (s.get("command_id", ""), s["state"])
        states.setdefault(key, s["_record_ms"])
    to_revoked, to_revoking, decide = [], [], []
    revokes = [c for c in obs.commands if c.get("kind") == "revoke"]
    for c in revokes:
        t = c["_record_ms"]
        if (c["command_id"], "revoked") in states:
            to_revoked.append(states[(c["command_id"], "revoked")] - t)
        if (c["command_id"], "revoking") in states:
            to_revoking.append(states[(c["command_id"], "revoking")] - t)
        cause = obs.event_ms.get(c.get("cause_event_id", ""))
        if cause is not None:
            decide.append(t - cause)
    return {
        "revokes": len(revokes),
        "measured": len(to_revoked),
        "p50": percentile(to_revoked, 0.5, 3),
        "p99": percentile(to_revoked, 0.99, 3),
        "max": percentile(to_revoked, 1.0, 3),
        "to_revoking_ms": {
            "p50": percentile(to_revoking, 0.5, 3),
            "p99": percentile(to_revoking, 0.99, 3),
            "n": len(to_revoking),
        },
        "telemetry_to_revoke_command_ms": {
            "p50": percentile(decide, 0.5, 3),
            "p99": percentile(decide, 0.99, 3),
            "n": len(decide),
        },
        "samples_ms": sorted(to_revoked),
        "samples_to_revoking_ms": sorted(to_revoking),
    }


def throughput(obs: Observed, timeline: dict, intervals: dict[str, list[tuple[float, float]]]) -> dict:
    """Episodes per minute in each window (by the window the episode started in) and, per kind of
    window, the mean over windows with its 95 % Student t interval."""
    t0 = timeline["t0"]
    windows = [w for w in timeline.get("windows", []) if w.get("end") is not None]
    rows = window_rates(obs.episodes, obs.started, windows)
    for w in rows:
        lease_s = [
            max(0.0, min(b, w["end"]) - max(a, w["start"])) for iv in intervals.values() for a, b in iv if a < w["end"]
        ]
        firsts = [a for iv in intervals.values() for a, _b in iv if w["start"] <= a < w["end"]]
        w["lease_gpu_seconds"] = round(float(sum(lease_s)), 1)
        w["first_lease_after_s"] = round(min(firsts) - w["start"], 2) if firsts else None
    by_kind: dict[str, dict] = {}
    for kind, leases_on in WINDOW_KINDS:
        sel = [w for w in rows if w["leases"] is leases_on and w["episodes_per_min"] is not None]
        mean, ci = mean_ci95([w["episodes_per_min"] for w in sel])
        minutes = [(w["end"] - w["start"]) / 60.0 for w in sel]
        by_kind[kind] = {
            "mean": _r(mean),
            "ci95": [_r(x) for x in ci] if ci else None,
            "windows": len(sel),
            "by_dedicated": _mean_rate([w["by_dedicated"] for w in sel], minutes),
            "by_leased": _mean_rate([w["by_leased"] for w in sel], minutes),
        }
    off, on = by_kind["dedicated_only"], by_kind["with_leases"]
    in_run = [e for e in obs.episodes if t0 <= started_at(e, obs.started) < timeline["t_end"]]
    done = {e.get("task_id") for e in obs.episodes}
    return {
        "dedicated_only": off["mean"],
        "with_leases": on["mean"],
        "ci95_dedicated_only": off["ci95"],
        "ci95_with_leases": on["ci95"],
        "gain": round(on["mean"] / off["mean"], 3) if off["mean"] and on["mean"] is not None else None,
        "by_kind": by_kind,
        "windows": [
            {
                **{k: v for k, v in w.items() if k not in ("start", "end")},
                "start_s": round(w["start"] - t0, 2),
                "end_s": round(w["end"] - t0, 2),
                "episodes_per_min": _r(w["episodes_per_min"]),
            }
            for w in rows
        ],
        "episodes_total": len(obs.episodes),
        "episodes_in_run": len(in_run),
        "starts_seen": round(sum(1 for e in in_run if e.get("task_id") in obs.started) / len(in_run), 4)
        if in_run
        else None,
        "unfinished_at_end": sum(
            1 for tid, t in obs.started.items() if t0 <= t < timeline["t_end"] and tid not in done
        ),
        "episodes_by_gpu": _count(e["gpu"] for e in obs.episodes),
        "method": "alternating leases-off / leases-on windows of one run; each episode counted in the window it "
        "started in; mean over the windows of each kind, 95 % Student t interval over them",
    }


def _mean_rate(counts: list[int], minutes: list[float]) -> float | None:
    return _r(statistics.fmean([c / m for c, m in zip(counts, minutes)])) if counts else None


def _r(x, nd: int = 2):
    return None if x is None else round(x, nd)


def _engine_text(md: dict) -> str:
    return "vLLM's OpenAI server" if md.get("server") == "vllm" else "torch"


def _measured_text(gpu: str, md: dict) -> str:
    if md.get("server") == "vllm":
        return (
            f"`{gpu}` is vLLM's OpenAI server on `{md.get('model')}` on this machine: its telemetry's p99s and "
            "KV-cache usage come from the server's own histograms (/metrics, read by the agent's reader); the "
            "per-request figures below are the client's wall-clock measurements."
        )
    return f"`{gpu}`'s latencies are wall-clock measurements of a torch model on this machine."


def attainment_by_window_kind(obs: Observed, windows, gpu: str) -> dict:
    """`gpu`'s SLO attainment per kind of run window (`WINDOW_KINDS`): the fraction of its
    telemetry windows stamped inside a window of that kind whose TTFT and TPOT p99 are both
    within its SLO (None: no telemetry there)."""
    out: dict = {}
    rows = obs.telemetry.get(gpu, [])
    for kind, leases_on in WINDOW_KINDS:
        spans = [(w["start"], w["end"]) for w in windows if w["leases"] is leases_on and w.get("end") is not None]
        inside = [within_slo(row) for row in rows if leased_at(spans, row[0])]
        out[kind] = round(sum(inside) / len(inside), 4) if inside else None
    return out


def core_by_window_kind(windows) -> dict | None:
    """The device core's seconds (rose.demo.device_core.split) summed per kind of window; None
    when no window sampled the core (no device core of its own: CUDA, or a single CPU)."""
    if not any(w.get("core") for w in windows):
        return None
    return {
        kind: device_core.add([w["core"] for w in windows if w["leases"] is on and w.get("core")])
        for kind, on in WINDOW_KINDS
    }


def measured_device(obs: Observed, t0: float, t_end: float, gpu: str, slo: dict, windows=()) -> dict:
    """The device whose latency is measured, not modelled: its SLO attainment over the run's
    telemetry windows (and per kind of run window among `windows`), the p99 over its requests
    (finished within the run) served alone and while a rollout lease ran on it, and what its core
    did in each kind of window. The SLO is the one it reported: the run's configuration."""
    try:
        rows = [r for r in json.loads(obs.coserve.get("requests") or "[]") if t0 <= r[0] <= t_end]
    except (TypeError, ValueError):
        rows = []
    s = latency_summary([(r[0], r[1], r[2], bool(r[3])) for r in rows])
    alone, leased = s["without_rollout"], s["with_rollout"]
    return {
        "gpu": gpu,
        "slo_attainment": (slo["per_gpu"].get(gpu) or {}).get("attainment"),
        "slo_attainment_by_window": attainment_by_window_kind(obs, windows, gpu),
        "core": core_by_window_kind(windows),
        "p99_alone_ms": {"ttft": alone["ttft_p99_ms"], "tpot": alone["tpot_p99_ms"]},
        "p99_leased_ms": {"ttft": leased["ttft_p99_ms"], "tpot": leased["tpot_p99_ms"]},
        "requests_alone": alone["requests"],
        "requests_leased": leased["requests"],
        "slo_ms": {"ttft": _num(obs.coserve.get("slo_ttft_ms")), "tpot": _num(obs.coserve.get("slo_tpot_ms"))},
        "slo_source": obs.coserve.get("slo_source"),
        "device": obs.coserve.get("device"),
        "server": obs.coserve.get("server") or "torch",
        "model": obs.coserve.get("model"),
        "summary": s,
    }


def promise(md: dict, episodes: dict) -> dict:
    """Whether the run kept the promise (the module docstring): the measured device's SLO
    attainment with leases against leases off (`md`, from `measured_device`), and episodes/min
    with leases against leases off (`episodes`: the report's `episodes_per_min`); with the
    figures compared and, from its core, the idle time of the leases-on windows beside what the
    leased workers took of it."""
    by = md.get("slo_attainment_by_window") or {}
    on, off = by.get("with_leases"), by.get("dedicated_only")
    slo_kept = on is not None and off is not None and round(off - on, 6) <= SLO_TOLERANCE
    ci, off_mean = episodes.get("ci95_with_leases"), episodes.get("dedicated_only")
    more = ci is not None and off_mean is not None and ci[0] > off_mean
    core = (md.get("core") or {}).get("with_leases") or {}
    return {
        "measured_slo_with_leases_within_0_01": slo_kept,
        "episodes_ci95_above_leases_off_mean": more,
        "held": slo_kept and more,
        "measured_slo_with_leases": on,
        "measured_slo_leases_off": off,
        "episodes_ci95_with_leases": ci,
        "episodes_leases_off_mean": off_mean,
        "core_idle_s_with_leases": core.get("idle_s"),
        "core_rollout_s_with_leases": core.get("rollout_s"),
        "core_counted_s_with_leases": core.get("counted_s"),
    }


def _count(items) -> dict:
    out: dict = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return dict(sorted(out.items()))


def weights(obs: Observed) -> dict:
    vs = obs.versions
    sent = sum(v["bytes_sent"] for v in vs)
    full = sum(v["bytes_full"] for v in vs)
    deltas = [v for v in vs if not v.get("keyframe")]
    d_sent = sum(v["bytes_sent"] for v in deltas)
    d_full = sum(v["bytes_full"] for v in deltas)
    applied = [e["v_max"] for e in obs.episodes if e["v_max"] is not None]
    rewards = [(v["version"], v["reward_mean"]) for v in vs if v.get("reward_mean") is not None]
    # bf16 elements a delta changed, of all (bytes_full / 2 bytes per bf16 element)
    changed = [v["changed_elements"] / (v["bytes_full"] / 2) for v in deltas if v.get("changed_elements") is not None]
    return {
        "versions_published": len(vs),
        "bytes_sent": sent,
        "bytes_full": full,
        "weight_bytes_ratio": round(sent / full, 4) if full else None,
        "delta_bytes_ratio": round(d_sent / d_full, 4) if d_full else None,
        "max_version_in_trajectories": max(applied) if applied else None,
        "versions_in_trajectories": len({e["v_max"] for e in obs.episodes if e["v_max"] is not None}),
        "reward_first": rewards[0][1] if rewards else None,
        "reward_last": rewards[-1][1] if rewards else None,
        "staleness_max": max((v.get("staleness", 0) for v in vs), default=0),
        "changed_fraction_per_step": round(statistics.fmean(changed), 4) if changed else None,
        "trainer_lr": _num(obs.trainer.get("lr")),
        "master_dtype": obs.trainer.get("master_dtype"),
        "publish_dtype": obs.trainer.get("publish_dtype"),
    }


def leases(obs: Observed, intervals) -> dict:
    kinds = _count(c.get("kind") for c in obs.commands)
    return {
        "commands": kinds,
        "grants": kinds.get("grant", 0),
        "revokes": kinds.get("revoke", 0),
        "states": _count(s["state"] for s in obs.lease_states),
        "lease_seconds_by_gpu": {g: round(sum(b - a for a, b in iv), 1) for g, iv in sorted(intervals.items())},
    }


def engine(obs: Observed, meta: dict) -> dict:
    """The rollout engine as the workers' heartbeats name it (else as the run configured it)."""
    for w in obs.workers.values():
        if w.engine:
            return {"name": w.engine, "version": w.engine_library, "device": w.device}
    r = meta.get("rollout") or {}
    return {"name": r.get("engine"), "version": r.get("engine_version"), "device": r.get("device")}


def _json(text, default):
    try:
        return json.loads(text) if text else default
    except (TypeError, ValueError):
        return default


def rl(obs: Observed, t0: float) -> dict:
    """The RL task, what is trained, a few sample turns and the mean reward of each step's batch."""
    tr = obs.trainer
    steps = [
        {
            "version": v["version"],
            "t_s": round(v["ts"] - t0, 1),
            "reward_mean": v["reward_mean"],
            "batch": v.get("batch"),
        }
        for v in obs.versions
        if v.get("reward_mean") is not None and "ts" in v
    ]
    return {
        "task": tr.get("task") or "toy: fraction of action tokens that are lowercase ASCII letters",
        "trained": _json(tr.get("trained"), None),
        "group": _num(tr.get("group")),
        "samples": _json(tr.get("samples"), []),
        "reward_by_step": steps,
    }


def build(obs: Observed, timeline: dict, meta: dict) -> dict:
    """report.json: the contract's keys first, then the details."""
    t0, t_end = timeline["t0"], timeline["t_end"]
    intervals = lease_intervals(obs.lease_states, t_end)
    slo = slo_attainment(obs, t0, t_end, intervals)
    tp = throughput(obs, timeline, intervals)
    rv = revoke_latency(obs)
    w = weights(obs)
    closed = [x for x in timeline.get("windows", []) if x.get("end") is not None]
    md = measured_device(obs, t0, t_end, meta.get("real_gpu", "real/0"), slo, closed)
    episodes = {
        "dedicated_only": tp["dedicated_only"],
        "with_leases": tp["with_leases"],
        "ci95_dedicated_only": tp["ci95_dedicated_only"],
        "ci95_with_leases": tp["ci95_with_leases"],
    }
    return {
        "serving_slo_attainment": slo["overall"],
        "episodes_per_min": episodes,
        "revoke_latency_ms": {"p50": rv["p50"], "p99": rv["p99"]},
        "weight_bytes_ratio": w["weight_bytes_ratio"],
        "trainer_lr": w["trainer_lr"],
        "measured_device": md,
        "promise": promise(md, episodes),
        "engine": engine(obs, meta),
        "model": (meta.get("rollout") or {}).get("model") or "reference (toy byte-level policy)",
        "rl": rl(obs, t0),
        "slo": slo,
        "throughput": tp,
        "revoke": rv,
        "weights": w,
        "leases": leases(obs, intervals),
        "coserve": {k: v for k, v in obs.coserve.items() if k not in ("summary", "requests")},
        "timeline": {
            **timeline,
            "measured_s": round(t_end - t0, 2),
            "windows": [{**x, "start_s": round(x["start"] - t0, 2), "end_s": round(x["end"] - t0, 2)} for x in closed],
        },
        **meta,
    }


def _f(x, unit: str = "", nd: int = 2) -> str:
    if x is None:
        return "n/a"
    return f"{x:.{nd}f}{unit}" if isinstance(x, float) else f"{x}{unit}"


def _ci(ci, nd: int = 1) -> str:
    return f"[{ci[0]:.{nd}f}, {ci[1]:.{nd}f}]" if ci else "n/a"


def markdown(rep: dict) -> str:
    tp, slo, rv, w, ls = rep["throughput"], rep["slo"], rep["revoke"], rep["weights"], rep["leases"]
    md, tl = rep["measured_device"], rep["timeline"]
    off, on = tp["by_kind"]["dedicated_only"], tp["by_kind"]["with_leases"]
    wins = tp["windows"]
    length = (wins[0]["end_s"] - wins[0]["start_s"]) if wins else 0.0
    lr = f"{rep['trainer_lr']:g}" if rep.get("trainer_lr") is not None else "n/a"
    lines = [
        "# ROSE demo report",
        "",
        f"Run `{rep['run_id']}` on {rep['host']['cpus']} CPU(s){' + CUDA' if rep['host']['cuda'] else ''}: "
        f"{tl['measured_s']:.0f} s in {len(wins)} alternating windows of {length:.1f} s, leases off first "
        f"({off['windows']} off, {on['windows']} on). "
        f"Trace `{rep['trace']}` at {rep['speed']}× speed, {rep['gpus']} trace-driven GPUs + `{rep['real_gpu']}` "
        f"(measured, device `{rep['real_device']}`, serving the trace at its recorded rate"
        f"{_replica_share(rep.get('real_replicas', 1))}).",
        "",
        "| figure | value |",
        "|---|---|",
        f"| serving SLO attainment (all GPUs, all windows) | {_f(slo['overall'], '', 4)} ({slo['windows']} windows) |",
        f"| … while a lease was active / not | {_f(slo['while_leased'], '', 4)} / {_f(slo['while_not_leased'], '', 4)} |",
        f"| episodes/min, leases off (mean of {off['windows']} windows, 95 % CI) | {_f(tp['dedicated_only'], '', 1)} "
        f"{_ci(tp['ci95_dedicated_only'])} |",
        f"| episodes/min, leases on (mean of {on['windows']} windows, 95 % CI) | {_f(tp['with_leases'], '', 1)} "
        f"{_ci(tp['ci95_with_leases'])} (gain {_f(tp['gain'], '×', 2)}) |",
        f"| … leases on: by the dedicated / leased workers | {_f(on['by_dedicated'], '', 1)} / "
        f"{_f(on['by_leased'], '', 1)} |",
        f"| … leases off: by the dedicated / leased workers (leases of the window before, lapsing) | "
        f"{_f(off['by_dedicated'], '', 1)} / {_f(off['by_leased'], '', 1)} |",
        f"| `{md['gpu']}` (measured) SLO attainment | {_f(md['slo_attainment'], '', 4)} |",
        f"| `{md['gpu']}` TTFT p99 alone / leased | {_f(md['p99_alone_ms']['ttft'], ' ms', 1)} / "
        f"{_f(md['p99_leased_ms']['ttft'], ' ms', 1)} |",
        f"| `{md['gpu']}` TPOT p99 alone / leased | {_f(md['p99_alone_ms']['tpot'], ' ms', 1)} / "
        f"{_f(md['p99_leased_ms']['tpot'], ' ms', 1)} |",
        f"| grants / revokes | {ls['grants']} / {ls['revokes']} |",
        f"| revoke command → `revoked` p50 / p99 | {_f(rv['p50'], ' ms', 0)} / {_f(rv['p99'], ' ms', 0)} "
        f"(n={rv['measured']}) |",
        f"| revoke command → `revoking` (pause flag raised) p50 / p99 | {_f(rv['to_revoking_ms']['p50'], ' ms', 0)} / "
        f"{_f(rv['to_revoking_ms']['p99'], ' ms', 0)} |",
        f"| telemetry → revoke command p50 / p99 | {_f(rv['telemetry_to_revoke_command_ms']['p50'], ' ms', 0)} / "
        f"{_f(rv['telemetry_to_revoke_command_ms']['p99'], ' ms', 0)} |",
        f"| policy versions published / newest seen in trajectories | {w['versions_published']} / "
        f"{w['max_version_in_trajectories']} |",
        f"| weight bytes sent / full broadcast, toy task (trainer lr {lr}) | {_f(w['weight_bytes_ratio'], '', 3)} "
        f"(deltas only: {_f(w['delta_bytes_ratio'], '', 3)}) |",
        f"| mean reward first → last version | {_f(w['reward_first'], '', 3)} → {_f(w['reward_last'], '', 3)} |",
        "",
        f"The weight-bytes ratio is the toy task's, at its learning rate ({lr}, Adam, {w.get('master_dtype')} master "
        f"weights published as {w.get('publish_dtype')}); each step changed {_f(w['changed_fraction_per_step'], '', 3)} "
        "of the published elements on average. `rose bench weights` measures the ratio at learning rates of "
        "large-model RL fine-tuning.",
        "",
        "## Windows",
        "",
        "| window | leases | start – end (s) | episodes started | by dedicated / leased | episodes/min "
        "| lease GPU-seconds | first lease after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, x in enumerate(wins, 1):
        lines.append(
            f"| {i} | {'on' if x['leases'] else 'off'} | {x['start_s']:.1f} – {x['end_s']:.1f} | {x['episodes']} | "
            f"{x['by_dedicated']} / {x['by_leased']} | {_f(x['episodes_per_min'], '', 1)} | "
            f"{x['lease_gpu_seconds']} | {_f(x['first_lease_after_s'], ' s', 1)} |"
        )
    lines += [
        "",
        f"Starts seen for {_f(tp['starts_seen'], '', 3)} of the run's episodes (the rest started and finished "
        f"between two looks at the task stream: their finish time stands for their start); "
        f"{tp['unfinished_at_end']} episode(s) started in the run were still unfinished after the drain.",
        "",
        "## Per GPU",
        "",
        "| GPU | source | windows | SLO attainment | lease seconds | episodes |",
        "|---|---|---|---|---|---|",
    ]
    for gpu, g in slo["per_gpu"].items():
        src = f"measured ({_engine_text(md)} on this machine)" if gpu == rep["real_gpu"] else "trace-driven model"
        lines.append(
            f"| {gpu} | {src} | {g['windows']} | {_f(g['attainment'], '', 4)} | "
            f"{ls['lease_seconds_by_gpu'].get(gpu, 0.0)} | {tp['episodes_by_gpu'].get(gpu, 0)} |"
        )
    s = md.get("summary") or {}
    if s.get("requests"):
        wr, wo = s.get("with_rollout", {}), s.get("without_rollout", {})
        lines += [
            "",
            f"## The measured device `{rep['real_gpu']}`",
            "",
            f"SLO (from the run's configuration, {md.get('slo_source')}): TTFT "
            f"{_f(md['slo_ms']['ttft'], ' ms', 1)}, TPOT {_f(md['slo_ms']['tpot'], ' ms', 1)}. Requests finished "
            "within the run; TPOT is each request's mean time per output token.",
            "",
            "| requests | n | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 |",
            "|---|---|---|---|---|---|",
            f"| with a rollout worker leased on it | {wr.get('requests')} | {_f(wr.get('ttft_p50_ms'), ' ms')} | "
            f"{_f(wr.get('ttft_p99_ms'), ' ms')} | {_f(wr.get('tpot_p50_ms'), ' ms')} | {_f(wr.get('tpot_p99_ms'), ' ms')} |",
            f"| alone | {wo.get('requests')} | {_f(wo.get('ttft_p50_ms'), ' ms')} | {_f(wo.get('ttft_p99_ms'), ' ms')} | "
            f"{_f(wo.get('tpot_p50_ms'), ' ms')} | {_f(wo.get('tpot_p99_ms'), ' ms')} |",
        ]
    lines += _promise_lines(rep)
    lines += _rl_lines(rep)
    inter = rep.get("interference") or {}
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in rep["plots"]]
    lines += [
        "",
        "## How each figure is measured",
        "",
        __doc__.split("Definitions (also printed in report.md):")[1].strip(),
        "",
        "- The trace-driven GPUs' latencies come from rose.sim.serving_model (a queueing model of an LLM engine) "
        "driven by the trace, slowed under a running lease by the simulator's default interference profile "
        f"(`{inter.get('profile', 'n/a')}`, mechanism {inter.get('mechanism', 'n/a')}: {inter.get('source', 'n/a')}); "
        f"their lease decisions, commands, workers and trajectories are real. {_measured_text(rep['real_gpu'], md)}",
        "- The toy RL task: reward = fraction of action tokens that are lowercase ASCII letters; REINFORCE "
        "with a batch-mean baseline (rose.demo.trainer).",
        "- All processes share this machine's CPUs, so the trace-driven GPUs' rollout workers also compete "
        f"with `{rep['real_gpu']}` and the dedicated worker for CPU: interference figures are an upper bound of a "
        "real node's, and the leased workers' gain is net of what they take from the dedicated one.",
        "",
        f"Process logs: `logs/` beside this file. Problems seen: {', '.join(rep['problems']) or 'none'}.",
    ]
    return "\n".join(lines) + "\n"


def _replica_share(n: int) -> str:
    return "" if n == 1 else f" as one of {n} replicas: 1/{n} of its requests"


def _yes(x: bool | None) -> str:
    return "n/a" if x is None else "yes" if x else "no"


def _core_rows(core: dict | None) -> list[str]:
    """Table rows (leases off | leases on) of the device core's seconds per kind of window."""
    if not core:
        return ["| device core | not sampled (no CPU core of its own) | |"]
    off, on = core["dedicated_only"], core["with_leases"]
    rows = (
        ("idle (idle + iowait)", "idle_s"),
        ("serving (user + system + irq + softirq: nice 0)", "serving_s"),
        ("rollout (nice: the leased workers)", "rollout_s"),
        ("counted (their sum)", "counted_s"),
    )
    return [f"| device core {what}, core-s | {_f(off[k], '', 1)} | {_f(on[k], '', 1)} |" for what, k in rows]


def _promise_lines(rep: dict) -> list[str]:
    """The measured device per kind of window (SLO attainment, its core) and the promise."""
    md, p = rep["measured_device"], rep.get("promise") or {}
    by = md.get("slo_attainment_by_window") or {}
    gpu = md["gpu"]
    lines = [
        "",
        "## Serving's SLO and the device core, leases off against on",
        "",
        f"`{gpu}`'s SLO attainment over its telemetry windows inside each kind of window, and what its CPU core did "
        "there (/proc/stat, core-seconds summed over the windows of the kind; the leased workers run niced, under "
        "SCHED_IDLE on that core, so their time is the core's `nice` time).",
        "",
        "| | leases off | leases on |",
        "|---|---|---|",
        f"| `{gpu}` SLO attainment | {_f(by.get('dedicated_only'), '', 4)} | {_f(by.get('with_leases'), '', 4)} |",
        *_core_rows(md.get("core")),
        "",
        "| promise | held |",
        "|---|---|",
        f"| `{gpu}` SLO attainment with leases ≥ leases off − {SLO_TOLERANCE} "
        f"({_f(p.get('measured_slo_with_leases'), '', 4)} against {_f(p.get('measured_slo_leases_off'), '', 4)}) "
        f"| {_yes(p.get('measured_slo_with_leases_within_0_01'))} |",
        f"| episodes/min with leases: 95 % CI low end above the leases-off mean "
        f"({_ci(p.get('episodes_ci95_with_leases'))} against {_f(p.get('episodes_leases_off_mean'), '', 1)}) "
        f"| {_yes(p.get('episodes_ci95_above_leases_off_mean'))} |",
        f"| both | {_yes(p.get('held'))} |",
    ]
    if p and not p.get("held"):
        lines += ["", _not_held(p)]
    return lines


def _not_held(p: dict) -> str:
    """Why the promise may not have held: the leases-on windows' idle core time beside what the
    leased workers took (under IDLE_LITTLE of the counted time is next to nothing)."""
    idle, took, counted = (p.get(f"core_{k}_s_with_leases") for k in ("idle", "rollout", "counted"))
    if idle is None:
        return "Not held. The device core was not sampled, so its idle time is not known."
    little = IDLE_LITTLE * (counted or 0)
    if idle >= little:
        why = "the idle time is what the leases left unharvested"
    elif (took or 0) >= little:
        why = "the leases took nearly all the time serving left"
    else:
        why = "serving kept the core busy, so there was next to nothing to harvest"
    return (
        f"Not held. In the leases-on windows the device core was idle for {_f(idle, ' core-s', 1)} of "
        f"{_f(counted, ' core-s', 1)}, and the leased workers took {_f(took, ' core-s', 1)}: {why}."
    )


def _rl_lines(rep: dict) -> list[str]:
    e, r = rep.get("engine") or {}, rep.get("rl") or {}
    lines = [
        "",
        "## Rollout engine and RL task",
        "",
        f"Engine `{e.get('name')}` {e.get('version') or ''} on `{e.get('device')}`; model `{rep.get('model')}`. "
        f"Task: {r.get('task')}.",
    ]
    tr = r.get("trained")
    if tr:
        lines.append(
            f"Trained: {tr.get('layers')} ({tr.get('parameters')} of {tr.get('of')} parameters; the rest frozen), "
            f"group of {int(r.get('group') or 0)} samples per prompt."
        )
    steps = r.get("reward_by_step") or []
    if steps:
        k = max(1, len(steps) // 4)
        quarters = [steps[i : i + k] for i in range(0, len(steps), k)]
        means = [
            f"{q[0]['t_s']:.0f}–{q[-1]['t_s']:.0f} s: {statistics.fmean(x['reward_mean'] for x in q):.3f}"
            for q in quarters
        ]
        lines.append(
            f"Mean reward of the trained batches ({len(steps)} steps), by part of the run: {'; '.join(means)}."
        )
    samples = r.get("samples") or []
    if samples:
        lines += ["", "| question | answer (decoded) | reward | policy version | GPU |", "|---|---|---|---|---|"]
        for x in samples[-6:]:
            ans = str(x.get("answer", "")).replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {x.get('question')} | `{ans}` | {x.get('reward')} | {x.get('version')} | {x.get('gpu')} |")
    return lines


def _num(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def write(directory: str | Path, rep: dict, obs: Observed) -> list[Path]:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    rep["plots"] = [p.name for p in plots.write_all(d, rep, obs)]
    (d / "report.json").write_text(json.dumps(rep, indent=2, default=str) + "\n")
    (d / "report.md").write_text(markdown(rep))
    return [d / "report.json", d / "report.md", *[d / p for p in rep["plots"]]]
