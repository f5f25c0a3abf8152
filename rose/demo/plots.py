"""The demo report's PNG plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

from rose.demo.observed import Observed, lease_intervals
from rose.obs.figures import pyplot, save

LEASE_COLOR = "#f4c542"
ON_COLOR = "#55a868"  # leases-on windows


def _windows(ax, rep: dict, label: bool = False, strip: bool = False) -> None:
    """Shade the leases-on windows (x: seconds since the start of the run); with `strip`, also a
    band along the top of the axes, seen above bars that hide the shading."""
    for i, w in enumerate(x for x in rep["timeline"]["windows"] if x["leases"]):
        lab = "leases-on window" if label and not i else None
        ax.axvspan(w["start_s"], w["end_s"], color=ON_COLOR, alpha=0.10, lw=0, label=None if strip else lab)
        if strip:
            ax.axvspan(
                w["start_s"], w["end_s"], ymin=0.96, ymax=1.0, color=ON_COLOR, alpha=0.8, lw=0, label=lab, zorder=3
            )


def serving(path: Path, rep: dict, obs: Observed) -> Path:
    """Per GPU: TTFT and TPOT p99 as a fraction of the SLO over time, lease periods shaded."""
    plt = pyplot()
    tl = rep["timeline"]
    t0, t_end = tl["t0"], tl["t_end"]
    intervals = lease_intervals(obs.lease_states, t_end)
    gpus = sorted(obs.telemetry, key=lambda g: (g == rep["real_gpu"], g))
    fig, axes = plt.subplots(len(gpus), 1, figsize=(11, 2.3 * len(gpus) + 0.8), sharex=True, squeeze=False)
    for ax, gpu in zip(axes[:, 0], gpus):
        rows = [r for r in obs.telemetry[gpu] if t0 - 5 <= r[0] <= t_end]
        xs = [r[0] - t0 for r in rows]
        ttft = [r[1] / r[3] for r in rows]
        tpot = [r[2] / r[4] for r in rows]
        for a, b in intervals.get(gpu, []):
            ax.axvspan(max(a, t0 - 5) - t0, min(b, t_end) - t0, color=LEASE_COLOR, alpha=0.35, lw=0)
        ax.plot(xs, ttft, lw=1.0, label="TTFT p99 / SLO", color="#1f77b4")
        ax.plot(xs, tpot, lw=1.0, label="TPOT p99 / SLO", color="#d62728")
        ax.axhline(1.0, color="black", lw=1.0, label="SLO")
        ax.axhline(0.9, color="gray", lw=0.8, ls="--", label="revoke below 10% headroom")
        ax.axhline(0.7, color="gray", lw=0.8, ls=":", label="grant needs 30% headroom")
        _windows(ax, rep, label=True)
        top = max([1.3] + [min(3.0, v) for v in ttft + tpot])
        ax.set_ylim(0, top * 1.05)
        src = "measured on this machine" if gpu == rep["real_gpu"] else "trace-driven model"
        slo = f"SLO TTFT {rows[-1][3]:.0f} ms, TPOT {rows[-1][4]:.0f} ms" if rows else ""
        ax.set_title(f"{gpu} ({src}); {slo}", fontsize=9, loc="left")
        ax.set_ylabel("p99 / SLO")
        ax.grid(alpha=0.3)
    from matplotlib.patches import Patch

    handles, labels = axes[0, 0].get_legend_handles_labels()
    handles.append(Patch(color=LEASE_COLOR, alpha=0.35))
    labels.append("rollout lease active")
    fig.legend(handles, labels, loc="upper center", ncol=7, fontsize=8, frameon=False, bbox_to_anchor=(0.5, 0.995))
    axes[-1, 0].set_xlabel("time since start of the run (s); green bands: leases-on windows, the rest leases off")
    fig.suptitle("Serving p99 latency vs SLO per GPU (values above 3× SLO are clipped)", y=0.965, fontsize=11)
    return save(fig, path, rect=(0, 0, 1, 0.94))


def throughput(path: Path, rep: dict, obs: Observed) -> Path:
    """Left: episodes finished per 5 s bin by worker kind, the windows marked, and each window's
    episodes/min (by start) as a line over it. Right: the mean of each kind of window with its
    95 % interval, and every window's figure."""
    plt = pyplot()
    tl = rep["timeline"]
    t0, t_end = tl["t0"], tl["t_end"]
    tp = rep["throughput"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [2.3, 1]})
    width = 5.0
    n = max(1, int(-(-(t_end - t0) // width)))  # bins up to t_end (the drain is not shown)
    edges = [i * width for i in range(n + 1)]
    ded = [0] * n
    lea = [0] * n
    for e in obs.episodes:
        x = e["finished_at"] - t0
        if 0 <= x < t_end - t0:
            (ded if e["dedicated"] else lea)[int(x // width)] += 1
    scale = 60.0 / width
    mids = [edges[i] + width / 2 for i in range(n)]
    _windows(a1, rep, label=True, strip=True)
    a1.bar(mids, [d * scale for d in ded], width=width * 0.95, color="#4c72b0", label="dedicated worker")
    a1.bar(
        mids,
        [v * scale for v in lea],
        width=width * 0.95,
        bottom=[d * scale for d in ded],
        color="#dd8452",
        label="leased workers (on serving GPUs)",
    )
    for i, w in enumerate(tp["windows"]):
        if w["episodes_per_min"] is not None:
            a1.hlines(
                w["episodes_per_min"],
                w["start_s"],
                w["end_s"],
                color="black",
                lw=1.5,
                label="window's episodes/min (by start)" if not i else None,
            )
    a1.set_xlabel("time since start of the run (s)")
    a1.set_ylabel("episodes / min (5 s bins, by finish)")
    a1.set_title("Rollout throughput over time, leases off / on windows", fontsize=10)
    a1.legend(fontsize=7, loc="lower right")
    a1.grid(alpha=0.3, axis="y")
    kinds = [("dedicated_only", False, "#4c72b0"), ("with_leases", True, "#dd8452")]
    for x, (kind, on, color) in enumerate(kinds):
        mean, ci = tp[kind], tp[f"ci95_{kind}"]
        if mean is None:
            continue
        err = [[mean - ci[0]], [ci[1] - mean]] if ci else None
        a2.bar(x, mean, color=color, yerr=err, capsize=6, alpha=0.85)
        pts = [w["episodes_per_min"] for w in tp["windows"] if w["leases"] is on and w["episodes_per_min"] is not None]
        a2.plot([x + 0.25] * len(pts), pts, "o", color="black", ms=3)
        label = f"{mean:.0f}" + (f"\n[{ci[0]:.0f}, {ci[1]:.0f}]" if ci else "")
        a2.text(x, mean / 2, label, ha="center", va="center", fontsize=8, color="white")
    a2.set_xticks([0, 1], ["leases off", "leases on"])
    a2.set_ylabel("episodes / min")
    gain = f", ×{tp['gain']:.2f}" if tp.get("gain") else ""
    a2.set_title(f"Mean of the windows ± 95 % CI{gain}\n(dots: each window)", fontsize=10)
    a2.grid(alpha=0.3, axis="y")
    return save(fig, path)


def revoke(path: Path, rep: dict, obs: Observed) -> Path:
    plt = pyplot()
    rv = rep["revoke"]
    fig, ax = plt.subplots(figsize=(8, 4))
    a, b = rv["samples_ms"], rv["samples_to_revoking_ms"]
    if a or b:
        hi = max(a + b)
        bins = max(5, min(40, len(a) + len(b)))
        edges = [hi * i / bins for i in range(bins + 1)] if hi > 0 else None
        if b:
            ax.hist(
                b, bins=edges or bins, alpha=0.7, color="#55a868", label=f"→ revoking: pause flag raised (n={len(b)})"
            )
        if a:
            ax.hist(
                a,
                bins=edges or bins,
                alpha=0.7,
                color="#c44e52",
                label=f"→ revoked: worker gone, memory back (n={len(a)})",
            )
        for v, name in ((rv["p50"], "p50"), (rv["p99"], "p99")):
            if v is not None:
                ax.axvline(
                    v, color="black", ls="--" if name == "p50" else ":", lw=1, label=f"revoked {name} {v:.0f} ms"
                )
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no revokes in this run", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("latency from the revoke command's Kafka record timestamp (ms)")
    ax.set_ylabel("revokes")
    ax.set_title("Revoke latency (Kafka record timestamps of command and lease state)", fontsize=10)
    ax.grid(alpha=0.3)
    return save(fig, path)


def weight_bytes(path: Path, rep: dict, obs: Observed) -> Path:
    plt = pyplot()
    vs = obs.versions
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
    if vs:
        x = [v["version"] for v in vs]
        from matplotlib.patches import Patch

        a1.bar(
            x, [v["bytes_sent"] / 1e6 for v in vs], color=["#c44e52" if v.get("keyframe") else "#4c72b0" for v in vs]
        )
        (line,) = a1.plot(x, [v["bytes_full"] / 1e6 for v in vs], color="black", lw=1.2)
        a1.set_ylim(0, max(v["bytes_full"] for v in vs) / 1e6 * 1.2)
        a1.legend(
            [Patch(color="#c44e52"), Patch(color="#4c72b0"), line],
            ["sent: keyframe (full, compressed)", "sent: delta", "full broadcast (bf16)"],
            fontsize=8,
        )
        r = [(v["version"], v["reward_mean"]) for v in vs if v.get("reward_mean") is not None]
        if r:
            a2.plot([a for a, _ in r], [b for _, b in r], marker=".", color="#8172b2")
    a1.set_xlabel("policy version")
    a1.set_ylabel("MB on the Redis weight stream")
    w = rep["weights"]
    ratio = f" (total ratio {w['weight_bytes_ratio']:.3f})" if w.get("weight_bytes_ratio") else ""
    a1.set_title(f"Weight bytes per version vs full broadcast{ratio}", fontsize=10)
    a1.grid(alpha=0.3, axis="y")
    a2.set_xlabel("policy version (after the optimizer step)")
    a2.set_ylabel("mean reward of the training batch")
    a2.set_title("Closed loop: reward of the batch each step trained on", fontsize=10)
    a2.grid(alpha=0.3)
    return save(fig, path)


def reward(path: Path, rep: dict, obs: Observed) -> Path:
    """The mean reward of each trainer step's batch over the run's time."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    steps = (rep.get("rl") or {}).get("reward_by_step") or []
    if steps:
        ax.plot([x["t_s"] for x in steps], [x["reward_mean"] for x in steps], marker=".", color="#8172b2", lw=0.8)
        k = min(8, len(steps))
        if k > 1:
            ys = [x["reward_mean"] for x in steps]
            avg = [sum(ys[max(0, i - k + 1) : i + 1]) / len(ys[max(0, i - k + 1) : i + 1]) for i in range(len(ys))]
            ax.plot([x["t_s"] for x in steps], avg, color="black", lw=1.5, label=f"mean of the last {k} steps")
            ax.legend(fontsize=8)
        ax.set_ylim(-0.02, max(0.1, max(x["reward_mean"] for x in steps) * 1.15))
    e = rep.get("engine") or {}
    ax.set_xlabel("seconds since the measured run started (start-up before 0)")
    ax.set_ylabel("mean reward of the step's batch")
    ax.set_title(f"Reward per trainer step ({e.get('name')}, {Path(str(rep.get('model', ''))).name})", fontsize=10)
    ax.grid(alpha=0.3)
    return save(fig, path)


def write_all(directory: Path, rep: dict, obs: Observed) -> list[Path]:
    return [
        serving(directory / "serving_p99.png", rep, obs),
        throughput(directory / "throughput.png", rep, obs),
        revoke(directory / "revoke_latency.png", rep, obs),
        weight_bytes(directory / "weight_bytes.png", rep, obs),
        reward(directory / "reward.png", rep, obs),
    ]
