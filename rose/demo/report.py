"""The demo's report: figures computed from what the run left in Kafka and Redis (pure
functions of an `Observed` and the run's timeline), written as report.json, report.md and PNG
plots (rose.demo.plots).

Definitions (also printed in report.md):
- serving_slo_attainment: fraction of telemetry windows, over every serving GPU and the
  measured part of the run, whose TTFT p99 and TPOT p99 are both within that GPU's SLO.
- episodes_per_min.dedicated_only: episodes finished per minute during phase 1, when only the
  dedicated worker runs (the scheduler is not started yet, so no lease can exist);
  .with_leases: episodes per minute during phase 2 (scheduler on; dedicated + leased workers),
  lease start-up included. Both phases are in the same run, on the same task shape.
- revoke_latency_ms: revoke command (its Kafka record timestamp, stamped when the scheduler
  produced it inside its transaction) → lease state `revoked` (its record timestamp: the worker
  has exited and its memory is back). `to_revoking_ms`: → `revoking`, published as the executor
  raises the worker's pause flag.
- weight_bytes_ratio: payload bytes sent on the weight stream / bytes of a full broadcast of
  every published version (the first version is a full keyframe).
"""

from __future__ import annotations

import json
from pathlib import Path

from rose.demo import plots
from rose.demo.observed import Observed, lease_intervals
from rose.obs.stats import percentile


def leased_at(intervals: list[tuple[float, float]], t: float) -> bool:
    return any(a <= t < b for a, b in intervals)


def slo_attainment(obs: Observed, t0: float, t_end: float, intervals) -> dict:
    per_gpu = {}
    ok_all = n_all = 0
    split = {"leased": [0, 0], "not_leased": [0, 0]}
    for gpu, rows in sorted(obs.telemetry.items()):
        ok = n = 0
        for ts, ttft, tpot, s_ttft, s_tpot, *_ in rows:
            if not t0 <= ts <= t_end:
                continue
            good = ttft <= s_ttft and tpot <= s_tpot
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


def throughput(obs: Observed, t0: float, t1: float, t_end: float) -> dict:
    def rate(a: float, b: float, pred=lambda e: True) -> float | None:
        if b <= a:
            return None
        n = sum(1 for e in obs.episodes if a <= e["finished_at"] < b and pred(e))
        return round(n / ((b - a) / 60.0), 2)

    ded = lambda e: e["dedicated"]  # noqa: E731
    leased = lambda e: not e["dedicated"]  # noqa: E731
    p1, p2 = rate(t0, t1), rate(t1, t_end)
    mid = t1 + (t_end - t1) / 2
    return {
        "dedicated_only": p1,
        "with_leases": p2,
        "gain": round(p2 / p1, 3) if p1 and p2 is not None else None,
        "with_leases_second_half": rate(mid, t_end),
        "phase2_by_dedicated": rate(t1, t_end, ded),
        "phase2_by_leased": rate(t1, t_end, leased),
        "episodes_total": len(obs.episodes),
        "episodes_phase1": sum(1 for e in obs.episodes if t0 <= e["finished_at"] < t1),
        "episodes_phase2": sum(1 for e in obs.episodes if t1 <= e["finished_at"] < t_end),
        "episodes_by_gpu": _count(e["gpu"] for e in obs.episodes),
        "method": "phase 1 (dedicated worker only, no scheduler) vs phase 2 (scheduler on, leases), same run",
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


def build(obs: Observed, timeline: dict, meta: dict) -> dict:
    """report.json: the contract's keys first, then the details."""
    t0, t1, t_end = timeline["t0"], timeline["t1"], timeline["t_end"]
    intervals = lease_intervals(obs.lease_states, t_end)
    slo = slo_attainment(obs, t0, t_end, intervals)
    tp = throughput(obs, t0, t1, t_end)
    rv = revoke_latency(obs)
    w = weights(obs)
    return {
        "serving_slo_attainment": slo["overall"],
        "episodes_per_min": {"dedicated_only": tp["dedicated_only"], "with_leases": tp["with_leases"]},
        "revoke_latency_ms": {"p50": rv["p50"], "p99": rv["p99"]},
        "weight_bytes_ratio": w["weight_bytes_ratio"],
        "slo": slo,
        "throughput": tp,
        "revoke": rv,
        "weights": w,
        "leases": leases(obs, intervals),
        "coserve": {
            **{k: v for k, v in obs.coserve.items() if k != "summary"},
            "summary": json.loads(obs.coserve["summary"]) if "summary" in obs.coserve else None,
        },
        "timeline": {**timeline, "phase1_s": round(t1 - t0, 2), "phase2_s": round(t_end - t1, 2)},
        **meta,
    }


def _f(x, unit: str = "", nd: int = 2) -> str:
    if x is None:
        return "n/a"
    return f"{x:.{nd}f}{unit}" if isinstance(x, float) else f"{x}{unit}"


def markdown(rep: dict) -> str:
    tp, slo, rv, w, ls, cs = rep["throughput"], rep["slo"], rep["revoke"], rep["weights"], rep["leases"], rep["coserve"]
    tl = rep["timeline"]
    lines = [
        "# ROSE demo report",
        "",
        f"Run `{rep['run_id']}` on {rep['host']['cpus']} CPU(s){' + CUDA' if rep['host']['cuda'] else ''}: "
        f"{tl['phase1_s']:.0f} s dedicated-only, then {tl['phase2_s']:.0f} s with leases. "
        f"Trace `{rep['trace']}` at {rep['speed']}× speed, {rep['gpus']} trace-driven GPUs + `{rep['real_gpu']}` "
        f"(measured, device `{rep['real_device']}`, serving the trace at its recorded rate).",
        "",
        "| figure | value |",
        "|---|---|",
        f"| serving SLO attainment (all GPUs, all windows) | {_f(slo['overall'], '', 4)} ({slo['windows']} windows) |",
        f"| … while a lease was active / not | {_f(slo['while_leased'], '', 4)} / {_f(slo['while_not_leased'], '', 4)} |",
        f"| episodes/min dedicated-only (phase 1) | {_f(tp['dedicated_only'])} |",
        f"| episodes/min with leases (phase 2) | {_f(tp['with_leases'])} (gain {_f(tp['gain'], '×', 2)}; "
        f"second half {_f(tp['with_leases_second_half'])}) |",
        f"| … phase 2 by dedicated / leased workers | {_f(tp['phase2_by_dedicated'])} / {_f(tp['phase2_by_leased'])} |",
        f"| grants / revokes | {ls['grants']} / {ls['revokes']} |",
        f"| revoke command → `revoked` p50 / p99 | {_f(rv['p50'], ' ms', 0)} / {_f(rv['p99'], ' ms', 0)} "
        f"(n={rv['measured']}) |",
        f"| revoke command → `revoking` (pause flag raised) p50 / p99 | {_f(rv['to_revoking_ms']['p50'], ' ms', 0)} / "
        f"{_f(rv['to_revoking_ms']['p99'], ' ms', 0)} |",
        f"| telemetry → revoke command p50 / p99 | {_f(rv['telemetry_to_revoke_command_ms']['p50'], ' ms', 0)} / "
        f"{_f(rv['telemetry_to_revoke_command_ms']['p99'], ' ms', 0)} |",
        f"| policy versions published / newest seen in trajectories | {w['versions_published']} / "
        f"{w['max_version_in_trajectories']} |",
        f"| weight bytes sent / full broadcast | {_f(w['weight_bytes_ratio'], '', 3)} (deltas only: "
        f"{_f(w['delta_bytes_ratio'], '', 3)}) |",
        f"| mean reward first → last version | {_f(w['reward_first'], '', 3)} → {_f(w['reward_last'], '', 3)} |",
        "",
        "## Per GPU",
        "",
        "| GPU | source | windows | SLO attainment | lease seconds | episodes |",
        "|---|---|---|---|---|---|",
    ]
    for gpu, g in slo["per_gpu"].items():
        src = "measured (torch on this machine)" if gpu == rep["real_gpu"] else "trace-driven model"
        lines.append(
            f"| {gpu} | {src} | {g['windows']} | {_f(g['attainment'], '', 4)} | "
            f"{ls['lease_seconds_by_gpu'].get(gpu, 0.0)} | {tp['episodes_by_gpu'].get(gpu, 0)} |"
        )
    s = cs.get("summary") or {}
    if s:
        wr, wo = s.get("with_rollout", {}), s.get("without_rollout", {})
        lines += [
            "",
            f"## The co-served device `{rep['real_gpu']}` (measured)",
            "",
            f"SLO (calibrated: {cs.get('slo_factor', '')}× the p99 measured alone): TTFT "
            f"{_f(_num(cs.get('slo_ttft_ms')), ' ms', 1)}, TPOT {_f(_num(cs.get('slo_tpot_ms')), ' ms', 1)}.",
            "",
            "| requests | n | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 |",
            "|---|---|---|---|---|---|",
            f"| with a rollout worker leased on it | {wr.get('requests')} | {_f(wr.get('ttft_p50_ms'), ' ms')} | "
            f"{_f(wr.get('ttft_p99_ms'), ' ms')} | {_f(wr.get('tpot_p50_ms'), ' ms')} | {_f(wr.get('tpot_p99_ms'), ' ms')} |",
            f"| without | {wo.get('requests')} | {_f(wo.get('ttft_p50_ms'), ' ms')} | {_f(wo.get('ttft_p99_ms'), ' ms')} | "
            f"{_f(wo.get('tpot_p50_ms'), ' ms')} | {_f(wo.get('tpot_p99_ms'), ' ms')} |",
        ]
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in rep["plots"]]
    lines += [
        "",
        "## How each figure is measured",
        "",
        __doc__.split("Definitions (also printed in report.md):")[1].strip(),
        "",
        "- The trace-driven GPUs' latencies come from rose.serving_model (a queueing model of an LLM engine) "
        "driven by the trace; their lease decisions, commands, workers and trajectories are real. "
        f"`{rep['real_gpu']}`'s latencies are wall-clock measurements of a torch model on this machine.",
        "- The toy RL task: reward = fraction of action tokens that are lowercase ASCII letters; REINFORCE "
        "with a batch-mean baseline (rose.demo.trainer).",
        "- All processes share this machine's CPUs, so the trace-driven GPUs' rollout workers also compete "
        f"with `{rep['real_gpu']}` for CPU: its interference figures are an upper bound of a real node's.",
        "",
        f"Process logs: `logs/` beside this file. Problems seen: {', '.join(rep['problems']) or 'none'}.",
    ]
    return "\n".join(lines) + "\n"


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
