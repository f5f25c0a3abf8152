"""Starting and stopping the processes a test runs, and the bound every ROSE process keeps on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from rose.shutdown import GRACE_S

SHUTDOWN_BOUND_S = 10.0  # docs: every ROSE process is gone within this of SIGTERM, in any state
assert GRACE_S < SHUTDOWN_BOUND_S


def start_scheduler(env: dict, instance: str, log: Path) -> subprocess.Popen:
    """`rose scheduler --instance <instance>` with `env`, its stderr (the JSON log) to `log`."""
    with open(log, "wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "rose", "scheduler", "--instance", instance],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def terminate_all(procs: dict[str, subprocess.Popen], wait_s: float = SHUTDOWN_BOUND_S + 5) -> dict[str, float]:
    """SIGTERM every process at once; seconds until each was gone (one still there after
    `wait_s` is SIGKILLed and reported as `wait_s`, over the bound)."""
    t0 = time.monotonic()
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    gone: dict[str, float] = {}
    for name, p in procs.items():
        try:
            p.wait(max(0.0, wait_s - (time.monotonic() - t0)))
            gone[name] = round(time.monotonic() - t0, 2)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            gone[name] = wait_s
    return gone
