"""The demo's report as files: report.md (its text: the figures of rose.demo.report with the
definitions the report's docstring gives), report.json and the PNG plots (rose.demo.plots)."""

from __future__ import annotations

import json
from pathlib import Path

from rose.demo import plots, report
from rose.demo.observed import Observed

IDLE_LITTLE = 0.05  # a core idle less than this fraction of a window's time had next to nothing to harvest


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


def _f(x, unit: str = "", nd: int = 2) -> str:
    if x is None:
        return "n/a"
    return f"{x:.{nd}f}{unit}" if isinstance(x, float) else f"{x}{unit}"


def _ci(ci, nd: int = 1) -> str:
    return f"[{ci[0]:.{nd}f}, {ci[1]:.{nd}f}]" if ci else "n/a"


def markdown(rep: dict) -> str:
    """report.md: the summary table, the windows, each GPU, the measured device, the promise, the
    RL task, the plots and how each figure is measured."""
    lines = _summary_lines(rep) + _window_lines(rep) + _per_gpu_lines(rep) + _device_lines(rep)
    lines += _promise_lines(rep)
    lines += _rl_lines(rep)
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in rep["plots"]]
    lines += _method_lines(rep)
    return "\n".join(lines) + "\n"


def _summary_lines(rep: dict) -> list[str]:
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
        f"(measured, device `{rep['real_device']}`, "
        + (
            "serving the trace thinned to its measured capacity: below)."
            if (rep.get("measured_device") or {}).get("serving_load")
            else f"serving the trace at its recorded rate{_replica_share(rep.get('real_replicas', 1))})."
        ),
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
        f"| weight bytes sent / full broadcast, this run's task (trainer lr {lr}) | {_f(w['weight_bytes_ratio'], '', 3)} "
        f"(deltas only: {_f(w['delta_bytes_ratio'], '', 3)}) |",
        f"| mean reward first → last version | {_f(w['reward_first'], '', 3)} → {_f(w['reward_last'], '', 3)} |",
        "",
        f"The weight-bytes ratio is this run's task's, at the trainer's learning rate ({lr}, Adam, {w.get('master_dtype')} master "
        f"weights published as {w.get('publish_dtype')}); each step changed {_f(w['changed_fraction_per_step'], '', 3)} "
        "of the published elements on average. `rose bench weights` measures the ratio at learning rates of "
        "large-model RL fine-tuning.",
    ]
    return lines


def _window_lines(rep: dict) -> list[str]:
    tp = rep["throughput"]
    lines = [
        "",
        "## Windows",
        "",
        "| window | leases | start – end (s) | episodes started | by dedicated / leased | episodes/min "
        "| lease GPU-seconds | first lease after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, x in enumerate(tp["windows"], 1):
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
    ]
    return lines


def _per_gpu_lines(rep: dict) -> list[str]:
    tp, slo, ls, md = rep["throughput"], rep["slo"], rep["leases"], rep["measured_device"]
    lines = [
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
    return lines


def _device_lines(rep: dict) -> list[str]:
    md = rep["measured_device"]
    lines: list[str] = []
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
    return lines + _load_lines(md.get("serving_load"))


def _load_lines(load: dict | None) -> list[str]:
    """How the trace was scaled to the device's measured capacity (rose.demo.capacity)."""
    if not load:
        return []
    return [
        "",
        f"Load: measured before the run with no lease, beside the run's other processes, the device carries "
        f"{load['capacity_rps']} requests/s {'within the SLO' if load.get('slo_met_alone', True) else 'with one client'} "
        f"(closed loop; one client alone: TTFT p99 {_f(load['solo_ttft_p99_ms'], ' ms')}, TPOT p99 "
        f"{_f(load['solo_tpot_p99_ms'], ' ms')}; requests of {load['mean_prompt_tokens']} prompt and "
        f"{load['mean_output_tokens']} answer tokens on average). The trace is played ×{load['speed']} as fast as "
        f"recorded with {load['keep']} of its requests, so its peak {load['bin_s']:g}-s rate "
        f"({load['trace_peak_rps']} requests/s as recorded) is {load['fraction']} of that capacity; its mean is "
        f"{round(load['trace_mean_rps'] * load['speed'] * load.get('keep', 1.0), 4)} requests/s.",
        *(
            []
            if load.get("slo_met_alone", True)
            else ["", f"What holds serving back on this machine: {load.get('held_back')}."]
        ),
    ]


def _method_lines(rep: dict) -> list[str]:
    md, inter = rep["measured_device"], rep.get("interference") or {}
    lines: list[str] = []
    lines += [
        "",
        "## How each figure is measured",
        "",
        (report.__doc__ or "").split("Definitions (also printed in report.md):")[1].strip(),
        "",
        "- The trace-driven GPUs' latencies come from rose.sim.serving_model (a queueing model of an LLM engine) "
        "driven by the trace, slowed under a running lease by the simulator's default interference profile "
        f"(`{inter.get('profile', 'n/a')}`, mechanism {inter.get('mechanism', 'n/a')}: {inter.get('source', 'n/a')}); "
        f"their lease decisions, commands, workers and trajectories are real. {_measured_text(rep['real_gpu'], md)}",
        _task_line(rep),
        "- All processes share this machine's CPUs, so the trace-driven GPUs' rollout workers also compete "
        f"with `{rep['real_gpu']}` and the dedicated worker for CPU: interference figures are an upper bound of a "
        "real node's, and the leased workers' gain is net of what they take from the dedicated one.",
        "",
        f"Process logs: `logs/` beside this file. Problems seen: {', '.join(rep['problems']) or 'none'}.",
    ]
    return lines


def _task_line(rep: dict) -> str:
    rl = rep.get("rl") or {}
    if (rep.get("engine") or {}).get("name", "reference") == "reference" or not rl.get("group"):
        return (
            "- The toy RL task: reward = fraction of action tokens that are lowercase ASCII letters; REINFORCE "
            "with a batch-mean baseline (rose.demo.trainer)."
        )
    return (
        f"- The RL task: {rl['task']}. GRPO's shape: advantages normalised within each group of "
        f"{rl['group']:g} samples of one prompt (rose.demo.hf_trainer)."
    )


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
        f"| `{gpu}` SLO attainment with leases ≥ leases off − {report.SLO_TOLERANCE} "
        f"({_f(p.get('measured_slo_with_leases'), '', 4)} against {_f(p.get('measured_slo_leases_off'), '', 4)}) "
        f"| {_yes(p.get('measured_slo_with_leases_within_0_01')) if p.get('measured_device_lease_s') != 0 else 'untested: no lease ran on it'} |",
        f"| episodes/min with leases: 95 % CI low end above the leases-off mean "
        f"({_ci(p.get('episodes_ci95_with_leases'))} against {_f(p.get('episodes_leases_off_mean'), '', 1)}) "
        f"| {_yes(p.get('episodes_ci95_above_leases_off_mean'))} |",
        f"| both | {_yes(p.get('held'))} |",
    ]
    g = rep.get("learning") or {}
    if g.get("steps"):
        lines.append(
            f"| model learned: last third's mean reward above the first's, 95 % intervals apart "
            f"({_ci(g['last_third']['ci95'], 3)} against {_ci(g['first_third']['ci95'], 3)}), from a start in "
            f"{report.START_BAND[0]}–{report.START_BAND[1]} | {_yes(g.get('held'))} |",
        )
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
    lines += _learning_lines(rep.get("learning") or {})
    samples = r.get("samples") or []
    if samples:
        lines += ["", "| question | answer (decoded) | reward | policy version | GPU |", "|---|---|---|---|---|"]
        for x in samples[-6:]:
            ans = str(x.get("answer", "")).replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {x.get('question')} | `{ans}` | {x.get('reward')} | {x.get('version')} | {x.get('gpu')} |")
    return lines


def _learning_lines(g: dict) -> list[str]:
    """The model-learned line of the promise: the first and last thirds of the training steps."""
    if not g.get("steps"):
        return ["No training step in the run."]
    first, last, k = g["first_third"], g["last_third"], g["steps_per_third"]
    lo, hi = report.START_BAND
    line = (
        f"Learning over {g['steps']} training steps (one every {_f(g['step_s'], ' s', 1)}): mean batch reward "
        f"{_f(first['mean'], '', 3)} {_ci(first['ci95'], 3)} over the first third, {_f(last['mean'], '', 3)} "
        f"{_ci(last['ci95'], 3)} over the last ({k} step{'' if k == 1 else 's'} each, 95 % intervals). Learned (the last third's interval "
        f"above the first's, from a start within {lo}–{hi}): {_yes(g['held'])}."
    )
    if g["held"]:
        return [line]
    if k < 2:
        why = f"{g['steps']} steps are too few for an interval over a third"
    elif not g["learned"]:
        why = f"the intervals overlap, {k} steps a third at one step every {_f(g['step_s'], ' s', 1)}"
    else:
        why = f"the start {_f(first['mean'], '', 3)} is outside {lo}–{hi}"
    return [f'{line} What holds it back: {why} (docs/demo.md, "What holds learning back").']


def write(directory: str | Path, rep: dict, obs: Observed) -> list[Path]:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    rep["plots"] = [p.name for p in plots.write_all(d, rep, obs)]
    (d / "report.json").write_text(json.dumps(rep, indent=2, default=str) + "\n")
    (d / "report.md").write_text(markdown(rep))
    return [d / "report.json", d / "report.md", *[d / p for p in rep["plots"]]]
