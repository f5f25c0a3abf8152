"""Bounded shutdown: every ROSE process is gone within `GRACE_S` of SIGTERM, whatever state its
clients are in (a wedged transaction coordinator call, a fenced producer, a broker that is down).

The first SIGTERM or SIGINT asks the process to stop (it sets an event and calls the process's
own stop hooks) and arms a deadline. A process that has not finished its graceful exit when the
deadline passes is ended with `os._exit` after one log line: nothing it holds is unsafe to drop,
because every ROSE process is built to survive a SIGKILL (open Kafka transactions abort, leases
expire, the weight stream is resumed from its applied seq). A second signal ends it at once,
except in a process installed with `repeat_ends=False`: a rollout worker, whose SIGTERM is also
its parent's death (PR_SET_PDEATHSIG), which the kernel sends again at each reparenting as a
multithreaded parent exits (to a thread of it still exiting, then to init), and whose drain that
repeat must not cut short; the deadline still bounds it.
Supervisors (systemd, Kubernetes) send SIGKILL after their own grace period, 30 s by default;
this bound is well inside it, so a rolling restart never waits on a wedged client.

`kill -USR1 <pid>` prints every thread's stack to stderr (faulthandler), so a process that
stops making progress can be read without stopping it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

GRACE_S = 8.0  # leaves 2 s of the 10 s bound for the interpreter and the kernel to let go
EXIT_FORCED = 3


class Shutdown:
    """Install with `Shutdown.install(...)` from the main thread; `stop` is the event to watch."""

    def __init__(
        self,
        stop: threading.Event | None = None,
        grace_s: float = GRACE_S,
        name: str = "rose",
        repeat_ends: bool = True,
    ):
        self.stop = stop or threading.Event()
        self.grace_s = grace_s
        self.name = name
        self.repeat_ends = repeat_ends  # a second signal ends the process at once (else: the deadline does)
        self.hooks: list[Callable[[], None]] = []
        self.requested_at: float | None = None
        self._timer: threading.Timer | None = None

    @classmethod
    def install(
        cls,
        stop: threading.Event | None = None,
        grace_s: float = GRACE_S,
        name: str = "rose",
        hooks: tuple[Callable[[], None], ...] = (),
        repeat_ends: bool = True,
    ) -> Shutdown:
        s = cls(stop, grace_s, name, repeat_ends)
        s.hooks.extend(hooks)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, s._on_signal)
            signal.signal(signal.SIGINT, s._on_signal)
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        return s

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def _on_signal(self, signum, _frame) -> None:
        if self.requested_at is not None:
            if self.repeat_ends:  # a second signal: the operator means now
                self._exit(f"second {signal.Signals(signum).name}")
            return
        self.request(signal.Signals(signum).name)

    def request(self, why: str = "requested") -> None:
        """Ask for a graceful stop and arm the hard deadline (idempotent)."""
        if self.requested_at is not None:
            return
        self.requested_at = time.monotonic()
        self.stop.set()
        for hook in self.hooks:
            try:
                hook()
            except Exception:  # a stop hook must never keep the process alive
                pass
        self._timer = threading.Timer(
            self.grace_s, self._exit, args=(f"{why}: graceful stop took over {self.grace_s:.0f}s",)
        )
        self._timer.daemon = True
        self._timer.name = "rose-shutdown-deadline"
        self._timer.start()

    def _exit(self, why: str) -> None:
        # plain write: the logging pipeline may be the thing that is stuck
        try:
            sys.stderr.write(f'{{"event": "shutdown.forced", "process": "{self.name}", "why": "{why}"}}\n')
            sys.stderr.flush()
        finally:
            os._exit(EXIT_FORCED)

    def cancel(self) -> None:
        """The graceful exit finished: disarm the deadline (the process is about to return)."""
        if self._timer is not None:
            self._timer.cancel()
