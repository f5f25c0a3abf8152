"""The demo's live view: a rich table per GPU (serving p99 vs SLO, lease state, rollout share),
the RL loop's figures and a progress bar; a compact line every few seconds when stdout is not a
terminal. `snapshot` (pure) turns what has been observed into the figures shown."""

from __future__ import annotations

from rose.contract.events import LEASE_SETTING_KINDS
from rose.demo.observed import Observed


def snapshot(obs: Observed, phase: str, elapsed_s: float, duration_s: float, now: float, real_gpu: str) -> dict:
    latest_state: dict[str, dict] = {}
    for s in list(obs.lease_states):
        cur = latest_state.get(s["gpu"])
        if cur is None or (s["epoch"], s["ts"]) >= (cur["epoch"], cur["ts"]):
            latest_state[s["gpu"]] = s
    shares: dict[str, float] = {}
    for c in list(obs.commands):
        if c.get("kind") in LEASE_SETTING_KINDS:  # a throttle to 0 shows the lease paused
            shares[c["lease_id"]] = c.get("compute_share", 0.0)
    episodes = list(obs.episodes)
    by_gpu: dict[str, int] = {}
    for e in episodes:
        by_gpu[e["gpu"]] = by_gpu.get(e["gpu"], 0) + 1
    gpus = []
    for gpu in sorted(obs.telemetry, key=lambda g: (g == real_gpu, g)):
        rows = obs.telemetry[gpu]
        if not rows:
            continue
        ts, ttft, tpot, s_ttft, s_tpot, util, *_ = rows[-1]
        ls = latest_state.get(gpu)
        state = ls["state"] if ls else "-"
        gpus.append(
            {
                "gpu": gpu,
                "measured": gpu == real_gpu,
                "ttft": ttft,
                "tpot": tpot,
                "slo_ttft": s_ttft,
                "slo_tpot": s_tpot,
                "util": util,
                "state": state,
                "share": shares.get(ls["lease_id"], 0.0) if ls and state == "active" else 0.0,
                "episodes": by_gpu.get(gpu, 0),
            }
        )
    recent = [e for e in episodes if e["finished_at"] >= now - 30.0]
    span = min(30.0, max(1e-6, elapsed_s)) / 60.0
    last = obs.versions[-1] if obs.versions else {}
    sent = sum(v["bytes_sent"] for v in obs.versions)
    full = sum(v["bytes_full"] for v in obs.versions)
    return {
        "phase": phase,
        "elapsed_s": elapsed_s,
        "duration_s": duration_s,
        "gpus": gpus,
        "episodes": len(episodes),
        "epm_dedicated": sum(1 for e in recent if e["dedicated"]) / span,
        "epm_leased": sum(1 for e in recent if not e["dedicated"]) / span,
        "version": last.get("version", 0),
        "reward": last.get("reward_mean"),
        "applied": max((e["v_max"] for e in episodes if e["v_max"] is not None), default=None),
        "bytes_sent": sent,
        "bytes_full": full,
        "grants": sum(1 for c in obs.commands if c.get("kind") == "grant"),
        "revokes": sum(1 for c in obs.commands if c.get("kind") == "revoke"),
    }


def _ratio_cell(p99: float, slo: float) -> str:
    r = p99 / slo if slo else 0.0
    color = "green" if r <= 0.7 else ("yellow" if r <= 0.9 else "red")
    return f"[{color}]{p99:7.1f} / {slo:.0f} ms[/{color}]"


def render(s: dict):
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    t = Table(title="ROSE demo: serving GPUs", expand=False)
    for col in ("GPU", "source", "TTFT p99 / SLO", "TPOT p99 / SLO", "util", "lease", "rollout share", "episodes"):
        t.add_column(col)
    for g in s["gpus"]:
        state = g["state"]
        st = {
            "active": "[bold green]active[/]",
            "revoking": "[yellow]revoking[/]",
            "revoked": "[red]revoked[/]",
            "expired": "[magenta]expired[/]",
        }.get(state, state)
        t.add_row(
            g["gpu"],
            "measured" if g["measured"] else "trace model",
            _ratio_cell(g["ttft"], g["slo_ttft"]),
            _ratio_cell(g["tpot"], g["slo_tpot"]),
            f"{g['util']:.2f}",
            st,
            f"{g['share']:.2f}" if g["share"] else "-",
            str(g["episodes"]),
        )
    full = s["bytes_full"] or 1
    rl = Text.from_markup(
        f"[bold]{s['phase']}[/]   rollout: [cyan]{s['epm_dedicated'] + s['epm_leased']:.0f}[/] episodes/min "
        f"(dedicated {s['epm_dedicated']:.0f}, leased {s['epm_leased']:.0f}; last 30 s), {s['episodes']} total   "
        f"grants {s['grants']} revokes {s['revokes']}\n"
        f"policy version [cyan]{s['version']}[/] (newest in trajectories {s['applied']}), batch reward "
        f"{s['reward'] if s['reward'] is not None else '-'}   weight bytes sent {s['bytes_sent'] / 1e6:.1f} MB vs full "
        f"{s['bytes_full'] / 1e6:.1f} MB ({s['bytes_sent'] / full:.2f})"
    )
    bar = ProgressBar(total=s["duration_s"], completed=min(s["elapsed_s"], s["duration_s"]), width=60)
    prog = Text(f"  {s['elapsed_s']:.0f} / {s['duration_s']:.0f} s")
    return Group(t, rl, Group(bar, prog))


def line(s: dict) -> str:
    gp = " ".join(
        f"{g['gpu']}:{max(g['ttft'] / g['slo_ttft'], g['tpot'] / g['slo_tpot']):.2f}"
        f"{'*' if g['state'] == 'active' else ''}"
        for g in s["gpus"]
    )
    return (
        f"[demo {s['elapsed_s']:5.0f}/{s['duration_s']:.0f}s] {s['phase']}; p99/SLO (*=leased) {gp}; "
        f"eps/min {s['epm_dedicated'] + s['epm_leased']:.0f} (leased {s['epm_leased']:.0f}); "
        f"v{s['version']}; grants {s['grants']} revokes {s['revokes']}"
    )
