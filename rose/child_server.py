"""A local HTTP server run as a child process in a session of its own (vLLM's OpenAI server,
vllm-router): a free loopback port for it, a wait until it answers, its log's last lines when it
does not, and a stop that takes its whole session (an engine core or worker it forked) with it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def last_lines(path: Path, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))
    except OSError:
        return ""


def wait_http_ok(
    url: str,
    proc: subprocess.Popen | None,
    log: Path,
    timeout_s: float,
    *,
    what: str,
    error: type[Exception],
    poll_s: float = 1.0,
) -> None:
    """Return once GET `url` answers 200; `error` (naming `what`, with the log's last lines) when
    the child exits first or nothing answers within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise error(f"{what} exited with {proc.returncode} while starting (log {log}):\n{last_lines(log)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 - a local child server
                if r.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        if time.monotonic() > deadline:
            raise error(f"{what} at {url} not answering after {timeout_s:.0f} s (log {log}):\n{last_lines(log)}")
        time.sleep(poll_s)


def stop_session(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the child's session, SIGKILL it after `grace_s`; then SIGKILL whatever of the
    session outlived the child (an engine core it forked)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
