"""The executor's pool of warm workers: rollout workers started and paused with no lease, which
build their model and apply the newest weights, then say so in their pause flag (`ready_ns`). A
grant hands its lease to a ready one (`WarmPool.hand_lease`) instead of starting a process, so
the lease decodes its first token in ~0.1 s rather than seconds. The lease machine knows
nothing of the pool: the executor asks it for a ready worker when it carries out `Start`, and
tends it from its housekeeping tick. In full: docs/executor.md, "The warm pool".
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rose.executor import lease_machine as lm
from rose.executor.workers import STARTS, WorkerHandle, launch_worker, log_started, unlink_quietly
from rose.obs import metrics
from rose.rollout.launcher import LeaseRecord, WorkerConfig
from rose.rollout.pause_flag import PAUSE, RUN, STOP, PauseFlag

WARM = metrics.gauge("rose_executor_warm_workers", "Warm workers in the pool, by whether they are ready")

# A refill waits until the lease the last warm worker took has decoded its first token (at most
# this long), so that the new worker's imports and model build do not compete with it for the CPU.
POOL_HOLD_S = 2.0


@dataclass
class WarmWorker:
    """A worker of the executor's pool: started and paused with no lease. It builds its model
    and applies the newest weights, then says so in its flag (`ready_ns`); a grant hands it the
    lease through a `LeaseRecord` in `lease_file` and the flag's assignment counter."""

    proc: subprocess.Popen[bytes]
    flag: PauseFlag
    config: WorkerConfig
    started_ns: int = field(default_factory=time.monotonic_ns)
    ready_said: bool = False

    @property
    def ready(self) -> bool:
        return self.flag.ready_ns > 0 and self.proc.poll() is None


def lease_file_for(flag_name: str) -> str:
    """Where the lease record of a warm worker goes: next to its flag (in /dev/shm when there)."""
    d = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(d, f"{flag_name}.lease")


class WarmPool:
    """Up to `size` warm workers, topped up by `tend()` while `on`. `new_worker()` names a new
    warm worker's pause flag and gives its `WorkerConfig` (`warm=True`, its `lease_file`);
    `log` is the executor's logger."""

    def __init__(
        self, size: int, restart_backoff_s: float, new_worker: Callable[[], tuple[str, WorkerConfig]], log: Any
    ) -> None:
        self.size = size
        self.workers: list[WarmWorker] = []
        self.on = False
        self.retry_at = 0.0
        self.failures = 0  # warm workers in a row that exited before they were ready
        self.hold: tuple[PauseFlag, float] | None = None  # a refill waits for this lease's first token
        self.stopping = False
        self.restart_backoff_s = restart_backoff_s
        self.new_worker = new_worker
        self.log = log

    def start(self) -> None:
        """Turn the pool on (when it has a size) and start filling it."""
        self.on = self.size > 0
        self.tend()

    def tend(self) -> None:
        """Reap warm workers that exited, note those that became ready, and start a new one
        while the pool is short (it imports and builds on its own: the executor does not wait)."""
        now = time.monotonic()
        for w in list(self.workers):
            if w.proc.poll() is not None:
                if not w.ready_said:  # died on the way up: back off, a broken set-up must not spin
                    self.failures += 1
                    delay = self.restart_backoff_s * 2 ** min(self.failures - 1, 5)
                    self.retry_at = now + min(30.0, delay)
                self.reap(w)
            elif not w.ready_said and w.flag.ready_ns > 0:
                w.ready_said = True
                self.failures = 0
                self.log.info(
                    "worker.warm_ready",
                    pid=w.proc.pid,
                    after_s=round((w.flag.ready_ns - w.started_ns) / 1e9, 3),
                    weights_version=w.flag.version,
                )
        if self.hold is not None:
            flag, until = self.hold
            try:
                if now >= until or flag.first_token_ns > 0:
                    self.hold = None
            except TypeError:  # the lease's worker is gone already (its flag is closed)
                self.hold = None
        if self.on and len(self.workers) < self.size and now >= self.retry_at and not self.hold:
            self._start_one()
        ready = sum(w.ready_said for w in self.workers)
        WARM.set(ready, ready="yes")
        WARM.set(len(self.workers) - ready, ready="no")

    def ready_for(self, wc: WorkerConfig) -> WarmWorker | None:
        """A ready warm worker that can run as `wc` (the config a cold start would get), if any."""
        return next((w for w in self.workers if w.ready and w.config.can_run_as(wc)), None)

    def hand_lease(self, w: WarmWorker, a: lm.Start, wc: WorkerConfig) -> WorkerHandle:
        """The lease goes to warm worker `w`, which leaves the pool: its lease record first, then
        the flag's state and share, then the assignment counter that the worker polls (so it
        reads a complete record and starts in the lease's state)."""
        self.workers.remove(w)
        flag = w.flag
        rec = LeaseRecord(
            assignment=(flag.assignment + 1) & 0xFFFFFFFF,
            gpu=wc.gpu,
            worker_id=wc.worker_id,
            lease_id=a.lease_id,
            epoch=a.epoch,
            mem_bytes=wc.mem_bytes,
            compute_share=wc.compute_share,
            lease_traceparent=wc.lease_traceparent,
        )
        rec.write(w.config.lease_file)
        flag.set(PAUSE if a.paused else RUN)
        flag.set_share(a.compute_share)
        flag.assign()
        h = WorkerHandle(a.gpu, w.proc, flag, a.epoch, lease_file=w.config.lease_file, warm=True)
        STARTS.inc(how="warm")
        self.hold = (flag, time.monotonic() + POOL_HOLD_S)
        log_started(
            self.log,
            a,
            w.proc.pid,
            warm=True,
            warm_for_s=round((time.monotonic_ns() - w.started_ns) / 1e9, 3),
            weights_version=flag.version,
        )
        return h

    def _start_one(self) -> None:
        name, wc = self.new_worker()
        unlink_quietly(wc.lease_file)
        flag = PauseFlag(name, create=True)
        flag.set(PAUSE)
        flag.set_share(0.0)
        try:
            proc = launch_worker(wc)
        except OSError as e:
            flag.close()
            flag.unlink()
            self.failures += 1
            self.retry_at = time.monotonic() + min(30.0, self.restart_backoff_s * 2**self.failures)
            self.log.warning("worker.warm_failed", error=str(e))
            return
        self.workers.append(WarmWorker(proc, flag, wc))
        self.log.info("worker.warming", pid=proc.pid, device=wc.device)

    def stop_all(self) -> None:
        """Turn the pool off and end every warm worker: STOP and SIGTERM (nothing to drain)."""
        self.on = False
        self.stopping = True
        for w in self.workers:
            w.flag.set(STOP)
            try:
                w.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def kill_all(self) -> None:
        """Kill and reap the warm workers that are still there."""
        for w in list(self.workers):
            w.proc.kill()
            w.proc.wait(5)
            self.reap(w)

    def reap(self, w: WarmWorker) -> None:
        if w in self.workers:
            self.workers.remove(w)
        code = w.proc.wait()
        w.flag.close()
        w.flag.unlink()
        unlink_quietly(w.config.lease_file)
        log = self.log.info if code == 0 or self.stopping else self.log.warning
        log("worker.warm_exited", pid=w.proc.pid, code=code, ready=w.ready_said)
