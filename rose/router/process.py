"""vllm-router as a child process on loopback (tests, the demo, `rose bench replica`): started in a
session of its own, waited for until it listens, stopped with SIGTERM.

    vllm-router --host 127.0.0.1 --port P --prometheus-host 127.0.0.1 --prometheus-port M
        --policy cache_aware --worker-startup-check-interval 1 --worker-urls U ...

`cache_aware` (the router's default) keeps a per-worker in-flight count, which `round_robin` and
`random` do not; a check interval of 1 s (the router's default is 30 s) lets `/add_worker` of a
healthy replica return within a second. `power_of_two` (two workers drawn, the one with fewer
requests in flight taken) keeps the count too and is the policy for traffic whose prompts share no
prefix: `cache_aware` routes by prefix match while the workers' in-flight counts differ by at most
`--balance-abs-threshold` (64), and with nothing to match a light load may all go to one worker."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rose.child_server import free_port, stop_session, wait_http_ok
from rose.router.base import RouterError, replica_url


@dataclass(frozen=True)
class RouterProcess:
    url: str  # the router's API and OpenAI endpoints, http://127.0.0.1:P
    metrics_url: str  # its Prometheus exporter, http://127.0.0.1:M
    log: Path
    proc: subprocess.Popen


POLICIES = ("cache_aware", "power_of_two")  # the ones that keep the in-flight count a drain reads


def router_argv(
    worker_urls: Sequence[str], port: int, metrics_port: int, admit_timeout_s: float, policy: str = "cache_aware"
) -> list[str]:
    if policy not in POLICIES:
        raise RouterError(f"router policy {policy!r} is not one of {POLICIES} (the drain reads their in-flight count)")
    exe = shutil.which("vllm-router", path=os.path.dirname(sys.executable)) or shutil.which("vllm-router")
    if exe is None:
        raise RouterError("vllm-router is not installed; install it with `pip install -e .[router]`")
    return [
        exe,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--policy",
        policy,
        "--worker-startup-check-interval",
        "1",
        "--worker-startup-timeout-secs",
        str(int(admit_timeout_s)),
        "--log-level",
        "warning",
        "--worker-urls",
        *(replica_url(u) for u in worker_urls),
    ]


def start_router(
    worker_urls: Sequence[str], log: Path, *, admit_timeout_s: float = 120.0, policy: str = "cache_aware"
) -> RouterProcess:
    """Start the router over `worker_urls` (each must answer /health: the router waits for them)
    and wait until it answers /liveness; RouterError, with its log's last lines, when it exits
    first or does not answer within `admit_timeout_s`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    argv = router_argv(worker_urls, free_port(), free_port(), admit_timeout_s, policy)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    rp = RouterProcess(f"http://127.0.0.1:{argv[4]}", f"http://127.0.0.1:{argv[8]}", log, proc)
    try:
        wait_http_ok(
            rp.url + "/liveness", proc, log, admit_timeout_s, what="vllm-router", error=RouterError, poll_s=0.2
        )
    except BaseException:
        stop_router(rp)
        raise
    return rp


def stop_router(rp: RouterProcess) -> None:
    """SIGTERM the router's session, SIGKILL it after 10 s."""
    stop_session(rp.proc, 10)
