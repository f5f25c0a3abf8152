"""The demo's child processes, each with its log file under the report's logs/, started in its
own session from the repository root and stopped in a given order.

Shutdown is SIGTERM, then SIGKILL after a deadline, for every process started here, also on
Ctrl-C or an error; children also get PR_SET_PDEATHSIG (`rose.rollout.launcher.spawn`) so
that none outlives a killed orchestrator. A name may be stopped and started again (the
scheduler, between the run's windows); its CPU time adds up over its runs.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from rose.rollout.launcher import WorkerConfig, launch, spawn

REPO = Path(__file__).resolve().parent.parent.parent


class Processes:
    """The child processes, each with its log file; stopped in a given order."""

    def __init__(self, log_dir: Path, env: dict):
        self.log_dir, self.env = log_dir, env
        self.procs: dict[str, subprocess.Popen] = {}
        self.reported: set[str] = set()
        self.cpu_done: dict[str, float] = {}  # CPU seconds of the stopped runs of each name

    def start(self, name: str, what: list[str] | WorkerConfig, cpus: set[int] | None = None) -> subprocess.Popen:
        """Start `what` (an argv, or a rollout worker's config) in its own session (Ctrl-C reaches
        only the orchestrator), SIGTERMed by the kernel if the orchestrator dies, on the CPUs
        `cpus` (None: any; a worker config names its own)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{name}.log", "ab")
        io: dict[str, Any] = {
            "env": self.env,
            "stdin": subprocess.DEVNULL,
            "stdout": log,
            "stderr": subprocess.STDOUT,
            "start_new_session": True,
            "cwd": str(REPO),
        }
        try:
            if isinstance(what, WorkerConfig):
                p = launch(dataclasses.replace(what, cpus=tuple(sorted(cpus or what.cpus))), **io)
            else:
                p = spawn(what, cpus=sorted(cpus or ()), **io)
        finally:
            log.close()
        self.procs[name] = p
        self.reported.discard(name)
        return p

    def exited(self) -> list[tuple[str, int]]:
        """Processes that ended on their own since the last call: (name, exit code)."""
        out = []
        for name, p in self.procs.items():
            if name not in self.reported and p.poll() is not None:
                self.reported.add(name)
                out.append((name, p.returncode))
        return out

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) of each process and its descendants so far, over every run of
        the name."""
        out = dict(self.cpu_done)
        for name, p in self.procs.items():
            if p.poll() is None:
                out[name] = out.get(name, 0.0) + _tree_cpu(p.pid)
        return {k: round(v, 1) for k, v in out.items()}

    def stop(self, names: list[str], timeout_s: float) -> list[str]:
        """SIGTERM these, wait up to timeout_s, SIGKILL what is left; names that needed a kill."""
        live = [n for n in names if n in self.procs and self.procs[n].poll() is None]
        for n in live:
            self.reported.add(n)
            self.cpu_done[n] = self.cpu_done.get(n, 0.0) + _tree_cpu(self.procs[n].pid)
            try:
                self.procs[n].send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(self.procs[n].poll() is None for n in live):
            time.sleep(0.05)
        killed = []
        for n in live:
            if self.procs[n].poll() is None:
                self.procs[n].kill()
                killed.append(n)
            self.procs[n].wait()
        return killed

    def stop_all(self, order: list[str], timeout_s: float = 10.0) -> list[str]:
        first = [n for n in order if n in self.procs]
        killed = self.stop(first, timeout_s)
        return killed + self.stop([n for n in self.procs if n not in first], timeout_s)


def _tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process and its descendants; 0 once it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        total = 0.0
        for q in [root, *root.children(recursive=True)]:
            t = q.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        return total
    except psutil.Error:
        return 0.0
