"""TRL's GRPOTrainer trained over ROSE (examples/trl_grpo.py): reward and seconds per optimizer step, and the run's wall time."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rose.bench._stack import ServedGateway, checkpoint_or_tiny, private_stack, progress, rollout_workers

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl_grpo.py"
MINUTES, QUICK_MINUTES = 10.0, 1.0  # the example's wall-time budget (--max-minutes)
MAX_STEPS = 10_000  # more than fit in the budget: the budget ends the run
JOB, MODEL, KEY = "bench-trl", "bench-trl", "bench-trl-key"
STEP_LINE = re.compile(
    r"^step (\d+)  reward ([\d.]+)  answers (\d+)  versions \[([\d, ]+)\]  workers \[([^\]]*)\]"
    r"  ([\d.]+)s \(rollout ([\d.]+)s\)  published (\d+)$"
)


def run(cfg: Any, quick: bool, *, model: str = "", plot: str = "") -> dict:
    """Two hf-engine workers following the weights and a gateway (in this process) on `model`
    (default: a tiny random-init checkpoint with a tokenizer); the example as a user runs it, for
    `MINUTES`; its step lines parsed. The reference beside the last third's reward is the first
    third's, measured in the same run."""
    import tempfile

    if not EXAMPLE.is_file():
        raise SystemExit(f"bench trl: {EXAMPLE} not found; run it from a source checkout of ROSE")
    minutes = QUICK_MINUTES if quick else MINUTES
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rose-bench-trl-") as tmp, private_stack(cfg, "trl", kafka=False) as c:
        model = checkpoint_or_tiny(model, Path(tmp), tokenizer=True)
        c = _gateway_cfg(c)
        with _workers(c, model, Path(tmp)) as (_flags, procs):
            served = _serve_when_running(c, sorted(procs), t0)
            try:
                lines, wall_s = _run_example(served.url, model, Path(tmp) / "out", minutes, t0)
            finally:
                served.stop()
    steps = [m for m in map(STEP_LINE.match, lines) if m]
    if not steps:
        raise SystemExit("bench trl: the example took no step:\n" + "\n".join(lines[-20:]))
    result = _report(steps, wall_s, minutes, model, lines)
    if plot:
        _plot(result, Path(plot))
        result["plot"] = plot
    return result


def _gateway_cfg(c: Any) -> Any:
    from rose.config import GatewayConfig

    return dataclasses.replace(
        c,
        executor=dataclasses.replace(c.executor, job=JOB, model=MODEL),
        gateway=GatewayConfig(api_keys=KEY, request_timeout_s=600.0),
    )


def _workers(c: Any, model: str, logs: Path) -> Any:
    """Two hf-engine rollout workers following `model`'s weights, each with a pause flag at RUN."""
    fields = {"engine": "hf", "checkpoint": model, "nice": 0, "weights": "follow", "max_batch": 8, "max_model_len": 256}
    return rollout_workers(c, "trl", logs, fields)


def _serve_when_running(c: Any, workers: list[str], t0: float) -> Any:
    import httpx

    served = ServedGateway(c)
    deadline = time.monotonic() + 300
    while sorted(httpx.get(served.url + "/health").json()["workers_running"]) != workers:
        if time.monotonic() > deadline:
            served.stop()
            raise SystemExit(f"bench trl: workers {workers} not running after 300 s")
        time.sleep(0.2)
    progress("trl", t0, f"gateway {served.url}, workers {', '.join(workers)} running")
    return served


def _run_example(url: str, model: str, out: Path, minutes: float, t0: float) -> tuple[list[str], float]:
    """The example as a subprocess with its own command line; each line echoed as progress."""
    argv = [sys.executable, str(EXAMPLE), "--gateway", url, "--api-key", KEY, "--served-model", MODEL]
    argv += ["--model", model, "--steps", str(MAX_STEPS), "--max-minutes", str(minutes), "--out", str(out)]
    progress("trl", t0, f"running {EXAMPLE.name} for {minutes:g} min")
    start = time.monotonic()
    log = out.parent / "example.stderr"  # a file, not a pipe: nothing blocks the example however much it logs
    with open(log, "w") as err:
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, cwd=EXAMPLE.parent)
        assert p.stdout is not None
        lines = []
        for line in p.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith(("model ", "step ", "done: ")):  # not TRL's own log dicts
                progress("trl", t0, line.rstrip("\n"))
    if p.wait() != 0:
        raise SystemExit(f"bench trl: the example exited {p.returncode}:\n{log.read_text()[-4000:]}")
    return lines, time.monotonic() - start


def _mean_ci(xs: list[float]) -> dict:
    """Mean over the steps and its 95 % Student t interval (None for a single step)."""
    from rose.obs.stats import mean_ci95

    m, ci = mean_ci95(xs)
    return {"n": len(xs), "mean": round(m or 0.0, 4), "ci95": None if ci is None else [round(x, 4) for x in ci]}


def _report(steps: list[re.Match], wall_s: float, minutes: float, model: str, lines: list[str]) -> dict:
    rewards = [float(m.group(2)) for m in steps]
    step_s = [float(m.group(6)) for m in steps]
    rollout_s = [float(m.group(7)) for m in steps]
    third = max(1, len(steps) // 3)
    first, last = _mean_ci(rewards[:third]), _mean_ci(rewards[-third:])
    return {
        "model": model,
        "budget_minutes": minutes,
        "wall_s": round(wall_s, 1),
        "optimizer_steps": len(steps),
        "answers_per_step": int(steps[0].group(3)),
        "reward_per_step": rewards,
        "seconds_per_step": _mean_ci(step_s),
        "rollout_seconds_per_step": _mean_ci(rollout_s),
        "rollout_share_of_step": round(sum(rollout_s) / sum(step_s), 4),
        "reward_first_third": first,
        "reward_last_third": last,
        "reward_last_over_first_third": round(last["mean"] / first["mean"], 4) if first["mean"] else None,
        "reward_intervals_overlap": _overlap(first["ci95"], last["ci95"]),
        "versions_published": [int(steps[0].group(8)) - 1, int(steps[-1].group(8))],
        "done_line": next((x for x in lines if x.startswith("done: ")), ""),
    }


def _overlap(a: list[float] | None, b: list[float] | None) -> bool | None:
    return None if a is None or b is None else not (a[0] > b[1] or b[0] > a[1])


def _plot(result: dict, path: Path) -> None:
    from rose.obs.figures import pyplot, save

    plt = pyplot()
    ys = result["reward_per_step"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(range(len(ys)), ys, marker=".", lw=1, label="mean reward of the step's answers")
    for key, xs in (
        ("reward_first_third", (0, len(ys) // 3)),
        ("reward_last_third", (len(ys) - len(ys) // 3, len(ys))),
    ):
        if result[key]["ci95"] is None:
            continue
        lo, hi = result[key]["ci95"]
        ax.fill_between(
            [xs[0], max(xs[0], xs[1] - 1)], lo, hi, alpha=0.2, label=f"{key.replace('_', ' ')} 95 % interval"
        )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward")
    ax.set_title(f"TRL GRPOTrainer over ROSE: {Path(result['model']).name}, {result['wall_s']:.0f} s")
    ax.legend(fontsize=7)
    save(fig, path)
