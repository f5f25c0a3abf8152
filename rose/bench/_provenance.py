"""Where a figure came from: the command, the commit, the machine and its load when it ran.

A committed figure is only as good as what a reader can tell about its run; the load average
says how much else the machine was doing (a loaded machine's tails are the machine's)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path


def _git_commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(argv: list[str] | None = None) -> dict:
    """The run's command line, commit, time, machine (CPU model, cores) and 1/5/15-min load."""
    args = sys.argv if argv is None else argv
    load = os.getloadavg()
    return {
        "command": " ".join(["rose", *args[1:]]) if args and Path(args[0]).name == "rose" else " ".join(args),
        "git_commit": _git_commit(),
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpu_model": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
        "load_average": {"1m": round(load[0], 2), "5m": round(load[1], 2), "15m": round(load[2], 2)},
    }
