"""The stack's Redis: one redis-server on loopback (append-only file, no snapshots), its data
under root/redis; ready when it answers PING."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

from rose.stack.errors import StackError
from rose.stack.processes import StackProcesses, log


def server_args(exe: str, port: int, directory) -> list[str]:
    """redis-server's command line for the stack: loopback only, append-only file (fsync each
    second), no snapshots, in the foreground."""
    return [
        exe,
        *("--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory)),
        *("--appendonly", "yes", "--appendfsync", "everysec", "--save", ""),
        *("--daemonize", "no", "--protected-mode", "yes"),
    ]


class RedisServer(StackProcesses):
    """Finds (or installs), starts, checks and stops the stack's redis-server."""

    def _redis_server(self) -> str:
        exe = shutil.which("redis-server")
        if exe:
            return exe
        if os.geteuid() == 0 and shutil.which("apt-get"):
            log("installing redis-server from Debian's packages ...")
            subprocess.run(
                ["apt-get", "install", "-y", "-qq", "redis-server"],
                check=False,
                stdout=subprocess.DEVNULL,
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            )
            exe = shutil.which("redis-server")
            if exe:
                return exe
        raise StackError("redis-server not found: install Redis 7 (apt-get install redis-server)")

    def redis_up(self, timeout_s: float = 20.0) -> None:
        if self.redis_alive():
            return
        exe = self._redis_server()
        rdir = self.root / "redis"
        rdir.mkdir(parents=True, exist_ok=True)
        self._mark()
        out = open(self.root / "redis.out", "ab")
        proc = subprocess.Popen(
            server_args(exe, self.scfg.redis_port, rdir),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._pidfile("redis").write_text(str(proc.pid))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise StackError(f"redis-server exited with code {proc.returncode}; see {self.root}/redis.out")
            if self.redis_alive():
                return
            time.sleep(0.1)
        raise StackError(f"Redis did not answer PING on {self.redis_url} within {timeout_s}s")

    def redis_alive(self) -> bool:
        import redis

        try:
            return bool(redis.Redis.from_url(self.redis_url, socket_timeout=1, socket_connect_timeout=1).ping())
        except (redis.RedisError, OSError):
            return False

    def redis_down(self, timeout_s: float = 10.0) -> bool:
        return self._stop("redis", timeout_s)
