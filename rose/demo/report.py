"""The demo's report: figures computed from what the run left in Kafka and Redis (pure
functions of an `Observed` and the run's timeline), written as report.json, report.md and PNG
plots by rose.demo.report_files.

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
  episodes/min with leases is above the leases-off mean; held: both. Where no lease ran on the
  measured device (measured_device_lease_s 0), serving's half is untested: null, not held.
- revoke_latency_ms: revoke command (its Kafka record timestamp, stamped when the scheduler
  produced it inside its transaction) → lease state `revoked` (its record timestamp: the worker
  has exited and its memory is back). `to_revoking_ms`: → `revoking`, published as the executor
  raises the worker's pause flag.
- learning: whether the model learned within the run: the mean of the training steps' batch
  rewards over the last third of the steps against the first third, each with its 95 % Student
  t interval over those steps. learned: the last third's interval lies above the first's;
  start_in_band: the first third's mean is within START_BAND (0.1-0.7); held: both.
- weight_bytes_ratio: payload bytes sent on the weight stream / bytes of a full broadcast of
  every published version (the first version is a full keyframe), for the run's task at the
  trainer's learning rate (trainer_lr).
"""

from __future__ import annotations

import json
import statistics

from rose.demo import device_core
from rose.demo.coserve_device import latency_summary
from rose.demo.observed import Observed, lease_intervals
from rose.demo.windows import started_at, window_rates
from rose.obs.stats import mean_ci95, percentile

# the two kinds of window, by the key the report gives each (the window's `leases` flag)
WINDOW_KINDS = (("dedicated_only", False), ("with_leases", True))
SLO_TOLERANCE = 0.01  # the promise: serving's attainment with leases at most this below leases off
# a starting mean reward inside this band leaves groups whose rewards differ, so GRPO's
# group-normalised advantages have a signal (docs/demo.md "Task")
START_BAND = (0.1, 0.7)


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
        "serving_load": _json(obs.coserve.get("serving_load"), None),
        "summary": s,
    }


def promise(md: dict, episodes: dict, device_lease_s: float | None = None) -> dict:
    """Whether the run kept the promise (the module docstring): the measured device's SLO
    attainment with leases against leases off (`md`, from `measured_device`), and episodes/min
    with leases against leases off (`episodes`: the report's `episodes_per_min`); with the
    figures compared and, from its core, the idle time of the leases-on windows beside what the
    leased workers took of it. Where no lease ran on the measured device (`device_lease_s` 0),
    its two halves differ by load alone, so serving's half is untested (None), not held."""
    by = md.get("slo_attainment_by_window") or {}
    on, off = by.get("with_leases"), by.get("dedicated_only")
    slo_kept = on is not None and off is not None and round(off - on, 6) <= SLO_TOLERANCE
    if device_lease_s == 0:
        slo_kept = None
    ci, off_mean = episodes.get("ci95_with_leases"), episodes.get("dedicated_only")
    more = ci is not None and off_mean is not None and ci[0] > off_mean
    core = (md.get("core") or {}).get("with_leases") or {}
    return {
        "measured_slo_with_leases_within_0_01": slo_kept,
        "episodes_ci95_above_leases_off_mean": more,
        "held": bool(slo_kept and more),
        "measured_device_lease_s": device_lease_s,
        "measured_slo_with_leases": on,
        "measured_slo_leases_off": off,
        "episodes_ci95_with_leases": ci,
        "episodes_leases_off_mean": off_mean,
        "core_idle_s_with_leases": core.get("idle_s"),
        "core_rollout_s_with_leases": core.get("rollout_s"),
        "core_counted_s_with_leases": core.get("counted_s"),
    }


def learning(steps: list[dict]) -> dict:
    """Whether the model learned within the run (the module docstring): the thirds of the
    training steps' batch rewards (`rl`'s reward_by_step, in step order) with their intervals,
    and the seconds between steps, which bound how many steps a run of this length holds."""
    r = [x["reward_mean"] for x in steps]
    k = len(r) // 3
    (m1, ci1), (m3, ci3) = (mean_ci95(r[:k]), mean_ci95(r[-k:])) if k else ((None, None), (None, None))
    learned = ci1 is not None and ci3 is not None and ci3[0] > ci1[1]
    in_band = m1 is not None and START_BAND[0] <= m1 <= START_BAND[1]
    ts = [x["t_s"] for x in steps]
    return {
        "steps": len(r),
        "steps_per_third": k,
        "first_third": {"mean": _r(m1, 4), "ci95": _ci(ci1)},
        "last_third": {"mean": _r(m3, 4), "ci95": _ci(ci3)},
        "step_s": round((ts[-1] - ts[0]) / (len(ts) - 1), 1) if len(ts) > 1 else None,
        "start_in_band": in_band,
        "learned": learned,
        "held": learned and in_band,
    }


def _ci(ci: list[float] | None) -> list[float] | None:
    return None if ci is None else [round(ci[0], 4), round(ci[1], 4)]


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
    task = rl(obs, t0)
    ls = leases(obs, intervals)
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
        "promise": promise(md, episodes, ls["lease_seconds_by_gpu"].get(md["gpu"], 0.0)),
        "engine": engine(obs, meta),
        "model": (meta.get("rollout") or {}).get("model") or "reference (toy byte-level policy)",
        "rl": task,
        "learning": learning(task["reward_by_step"]),
        "slo": slo,
        "throughput": tp,
        "revoke": rv,
        "weights": w,
        "leases": ls,
        "coserve": {k: v for k, v in obs.coserve.items() if k not in ("summary", "requests")},
        "timeline": {
            **timeline,
            "measured_s": round(t_end - t0, 2),
            "windows": [{**x, "start_s": round(x["start"] - t0, 2), "end_s": round(x["end"] - t0, 2)} for x in closed],
        },
        **meta,
    }


def _num(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return None
