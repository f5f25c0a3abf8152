"""Stopping the processes a stack started: by their pid files, or, when a pid file is gone or
stale, by adopting the process that listens on the stack's port from the stack's own directory;
and the progress lines the stack prints while it starts them."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from rose.stack.layout import StackLayout


def log(msg: str) -> None:
    print(f"[stack] {msg}", file=sys.stderr, flush=True)


class StackProcesses(StackLayout):
    """Stops the stack's own processes, never another's."""

    def _adopt(self, name: str) -> int | None:
        """The pid of this stack's `name` when its pid file is gone or stale (two `up`s raced
        and the loser's pid was written last; a stop removed it): the process listening on
        the stack's port, if it runs from this stack's directory (Kafka, Jaeger: their config
        file is under the root; Redis: its working directory is root/redis, a cluster node's
        root/redis-cluster/<port>)."""
        import psutil

        port = self._ports(name)[0]
        try:
            conns = psutil.net_connections(kind="tcp")
        except psutil.AccessDenied:
            return None
        for c in conns:
            if c.status != psutil.CONN_LISTEN or not c.laddr or c.laddr.port != port or not c.pid:
                continue
            try:
                p = psutil.Process(c.pid)
                ours = (
                    Path(p.cwd()) == self._redis_dir(name)
                    if name.startswith("redis")
                    else any(str(self.root) in a for a in p.cmdline())
                )
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if ours:
                return c.pid
        return None

    def _stop(self, name: str, timeout_s: float) -> bool:
        """Stop a process this stack started; False if there was none."""
        pf = self._pidfile(name)
        pid: int | None
        try:
            pid = int(pf.read_text())
            os.kill(pid, 0)
        except (OSError, ValueError):
            pid = self._adopt(name)
            if pid is None:
                pf.unlink(missing_ok=True)
                return False
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pf.unlink(missing_ok=True)
            return False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            _reap(pid)
            if exited(pid):  # an adopted process: its parent reaps it, or nobody does
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
        _reap(pid)  # our child that exited between the checks above: no zombie left behind
        pf.unlink(missing_ok=True)
        return True


def exited(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
