"""Stopping the processes a test started, and the bound every ROSE process keeps on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import time

from rose.shutdown import GRACE_S

SHUTDOWN_BOUND_S = 10.0  # docs: every ROSE process is gone within this of SIGTERM, in any state
assert GRACE_S < SHUTDOWN_BOUND_S


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
