"""A lease's rollout worker as its executor holds it: the process, its pause flag and its
lease (`WorkerHandle`); the worker's configuration for a lease (`worker_config`); starting one
for a lease (a cold start), asking it to drain (`stop_worker`), reaping it; and the memory it
holds (`measure_rollout_mem`, published with each lease state). The executor's pool of warm
workers, which a lease may be handed to instead of a cold start, is rose.executor.warm_pool.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from rose.config import Config
from rose.executor import lease_machine as lm
from rose.obs import metrics
from rose.rollout.launcher import EXIT_DEVICE_CHECK, WorkerConfig, launch, spawn, threads
from rose.rollout.pause_flag import PAUSE, RUN, STOP, PauseFlag

STARTS = metrics.counter("rose_executor_worker_starts_total", "Lease workers, by how they started (warm | cold)")

# A stand-in process for a worker (`executor.worker = "placeholder"`): it holds the lease's slot
# and dies on SIGTERM, so load and soak runs exercise the whole control plane on fleets of
# thousands of GPUs without a model per lease.
PLACEHOLDER_ARGV = ("sleep", "infinity")


def worker_config(cfg: Config, start: lm.Start, flag_name: str, device: str, seed: int) -> WorkerConfig:
    """The configuration of a lease's rollout worker (rose.rollout.worker): the lease's share,
    and `cfg`'s Redis connection, weights key, job and model. `rose.rollout.launcher.launch`
    hands it to the worker off the command line."""
    return WorkerConfig.from_config(
        cfg,
        gpu=start.gpu,
        worker_id=f"{socket.gethostname()}:{start.gpu}:{start.epoch}",
        device=device,
        mem_bytes=start.mem_bytes,
        compute_share=start.compute_share,
        pause_flag=flag_name,
        dedicated=False,
        nice=cfg.executor.worker_nice,
        sched_idle=cfg.executor.worker_sched_idle,
        seed=seed,
        weights=cfg.executor.worker_weights,
        max_staleness=cfg.executor.max_staleness,
    )


def measure_rollout_mem(pid: int, device: str) -> int:
    """Bytes the worker holds: NVML per-process memory on CUDA when available, else RSS."""
    if device.startswith("cuda"):
        try:
            import pynvml

            pynvml.nvmlInit()
            idx = int(device.split(":")[1]) if ":" in device else 0
            h = pynvml.nvmlDeviceGetHandleByIndex(idx)
            used = sum(p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == pid)
            if used:
                return int(used)
        except Exception:  # noqa: BLE001 - NVML absent or no permission: fall back to RSS
            pass
    try:
        proc = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0


@dataclass
class WorkerHandle:
    gpu: str
    proc: subprocess.Popen[bytes]
    flag: PauseFlag | None  # None once the worker is reaped
    epoch: int
    started_ns: int = field(default_factory=time.monotonic_ns)
    lease_file: str = ""  # a warm worker's lease record, removed with the flag
    warm: bool = False  # taken from the pool rather than started for this lease


def unlink_quietly(path: str) -> None:
    """Remove `path` if there is one ("" or a file already gone: nothing to do)."""
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def launch_worker(wc: WorkerConfig | None) -> subprocess.Popen[bytes]:
    """A worker process: `python -m rose.rollout.worker_process` for `wc`, or the placeholder (None)."""
    if wc is None:
        return spawn(PLACEHOLDER_ARGV, stdin=subprocess.DEVNULL)
    return launch(wc, stdin=subprocess.DEVNULL)


def start_worker(a: lm.Start, flag_name: str, wc: WorkerConfig | None) -> WorkerHandle:
    """A cold start of `a`'s worker: a new pause flag in the lease's state and share, then the
    process (`wc`'s rollout worker, or the placeholder for None)."""
    flag = PauseFlag(flag_name, create=True)
    flag.set(PAUSE if a.paused else RUN)
    flag.set_share(a.compute_share)
    return WorkerHandle(a.gpu, launch_worker(wc), flag, a.epoch)


def log_started(log: Any, a: lm.Start, pid: int, warm: bool, **extra: object) -> None:
    """The `worker.started` line of a lease's worker, started cold or handed from the warm pool."""
    log.info(
        "worker.started",
        gpu=a.gpu,
        pid=pid,
        epoch=a.epoch,
        mem_bytes=a.mem_bytes,
        compute_share=a.compute_share,
        paused=a.paused,
        warm=warm,
        **extra,
    )


def stop_worker(h: WorkerHandle, log: Any = None) -> None:
    """Ask the worker to drain and exit: STOP in its flag, SCHED_OTHER back if it ran under
    SCHED_IDLE, its niceness back to 0, SIGTERM. `log`: where a priority it could not give back
    is reported (the executor's logger; None: nowhere)."""
    assert h.flag is not None  # a running worker's
    h.flag.set(STOP)
    # a draining worker launches no more compute; at nice 19 (or SCHED_IDLE) on a busy host it
    # would take seconds to get the CPU it needs to hand its episodes back and exit. Policy and
    # niceness are per thread on Linux (every thread the worker started inherited them): set
    # each thread back, the policy first (SCHED_OTHER keeps the niceness, which follows).
    tids = threads(h.proc.pid)
    refused = sum(not _leave_sched_idle(tid) for tid in tids)
    if refused and log is not None:
        log.warning("worker.sched_idle_kept", gpu=h.gpu, pid=h.proc.pid, threads=refused)
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 0)
        except (PermissionError, ProcessLookupError, OSError):
            pass  # lowering niceness needs CAP_SYS_NICE; draining still works, only slower
    try:
        h.proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass


def _leave_sched_idle(tid: int) -> bool:
    """Thread `tid` back under SCHED_OTHER if it runs under SCHED_IDLE; False only when that was
    refused (leaving SCHED_IDLE may need CAP_SYS_NICE: the worker then drains, only slower)."""
    try:
        if os.sched_getscheduler(tid) == os.SCHED_IDLE:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    except PermissionError:
        return False
    except OSError:  # ProcessLookupError: the thread ended meanwhile
        pass
    return True


def refused_why(code: int | None) -> str:
    """Why a worker that exited with `code` refused its lease, or "" where it did not: a restart on
    the same device would be refused again, so the lease ends (revoked) with this reason."""
    if code == EXIT_DEVICE_CHECK:
        return f"the worker's device check refused the lease (exit {code}: the GEMM check failed, or MPS is meant and not attached; its log says which)"
    return ""


def reap_worker(h: WorkerHandle) -> int:
    """Wait for the worker's exit, then remove its flag and lease record; its exit code."""
    code = h.proc.wait()
    flag = h.flag
    assert flag is not None  # reaped once
    h.flag = None
    flag.close()
    flag.unlink()
    unlink_quietly(h.lease_file)
    return code
