"""The imperative shell of replica leases (rose.executor.replica_lease, pure): the router, the
serving engine and the marker of a lent replica's rollout process, for the executor's GPUs that
are serving replicas. Each step's action is done at once and its result fed back, so a reclaim
(wake, health check, readmission) runs to its end, or to a failure tried again a tick later,
inside the executor's loop (docs/executor.md "Replica leases")."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import psutil

from rose.config import Config
from rose.executor import lease_machine as lm
from rose.executor import replica_lease as rl
from rose.executor.serving_engine import ServingEngine
from rose.router.base import Router, RouterError, replica_url


class Executor(Protocol):
    """What of rose.executor.service.Executor the shell uses (named here: the service imports this)."""

    cfg: Config
    gpus: list[str]
    device: str
    params: lm.Params
    states: dict[str, lm.GpuLease]
    log: Any

    def _act(self, actions: Any) -> None: ...
    def _apply(self, gpu: str, inp: lm.Input, parent: Any, quiet: bool = False) -> tuple[rl.ShellAction, ...]: ...
    def _publish(self, a: lm.Publish) -> None: ...


# where a lent replica's rollout process is noted (pid and start time), for the restart's check
# that none is left: a file per GPU and replica, removed once the replica serves again
MARKER_DIR = Path(tempfile.gettempdir()) / "rose-replica-leases"


class ReplicaShell:
    def __init__(self, ex: Executor, replicas: dict[str, str], router: Router | None):
        unknown = sorted(set(replicas) - set(ex.gpus))
        if unknown:
            raise ValueError(f"executor replicas: {', '.join(unknown)} not among this executor's GPUs")
        urls = [replica_url(u) for u in replicas.values()]
        if len(set(urls)) < len(urls):
            raise ValueError("executor replicas: one replica on several GPUs is not lent yet; give each GPU its own")
        if replicas and router is None:
            raise ValueError("executor replicas: a router is needed to lend a replica (router.kind)")
        self.ex = ex
        self.router = router
        self.params = rl.Params(drain_timeout_s=ex.cfg.executor.drain_timeout_s, retry_s=ex.params.restart_backoff_s)
        self.replicas = {g: rl.initial(g, replica_url(u)) for g, u in replicas.items()}
        self.engines = {g: ServingEngine(u, ex.device) for g, u in replicas.items()}
        self._started_at = time.monotonic()

    # ---- inputs from the executor -----------------------------------------------------------
    def receive(self, received: lm.Received) -> bool:
        """Whether the command went to a replica's path (which hands it on to the lease machine when due)."""
        gpu = received.command.gpu
        if gpu not in self.replicas:
            return False
        self._step(gpu, received)
        return True

    def tick(self) -> None:
        for gpu in self.replicas:
            self._step(gpu, lm.Tick())

    def shutdown(self) -> None:
        for gpu in self.replicas:
            self._step(gpu, lm.Shutdown())

    def reconcile(self) -> None:
        """At start (after a crash too): every replica of this node the router does not list is reclaimed."""
        if not self.replicas:
            return
        assert self.router is not None  # __init__ checked
        self._started_at = time.monotonic()
        listed = self.router.serving()
        for gpu, r in self.replicas.items():
            self.replicas[gpu], actions = rl.restart(gpu, r.url, r.url in listed)
            self.ex._act(actions)

    def on_lease_actions(self, gpu: str, actions: tuple[lm.Action, ...], now: float) -> tuple[rl.ShellAction, ...]:
        if gpu not in self.replicas:
            return actions
        self.replicas[gpu], out = rl.on_lease_actions(self.replicas[gpu], actions, now)
        return out

    def lent_to(self, gpu: str, pid: int) -> None:
        """Note the rollout process a lent replica's GPU now runs, for a restart's leftover check."""
        if gpu in self.replicas:
            MARKER_DIR.mkdir(parents=True, exist_ok=True)
            path = self._marker(gpu)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"pid": pid, "create_time": psutil.Process(pid).create_time()}))
            os.replace(tmp, path)

    # ---- the step and its actions -----------------------------------------------------------
    def _step(self, gpu: str, inp: rl.Input) -> None:
        self.replicas[gpu], actions = rl.step(
            self.replicas[gpu], inp, time.monotonic(), self.ex.states[gpu], self.params
        )
        self.ex._act(actions)

    def act(self, a: rl.Action) -> None:
        """Carry out one of rose.executor.replica_lease's actions."""
        if isinstance(a, rl.Forward):
            self.ex._apply(a.gpu, a.received, None)
        elif isinstance(a, rl.Fence):
            self.ex.states[a.gpu] = rl.fence(self.ex.states[a.gpu], a.record)
            self.ex._publish(lm.Publish(a.gpu, a.record))
        elif isinstance(a, rl.Report):
            self.ex.log.warning(a.event, gpu=a.gpu, replica=self.replicas[a.gpu].url, reason=a.reason)
        elif isinstance(a, rl.ReadDrain):
            self._step(a.gpu, rl.InFlight(self._in_flight(a.gpu)))
        elif isinstance(a, rl.Do):
            ok, detail = self._do(a.gpu, a.what)
            self.ex.log.info("replica." + a.what, gpu=a.gpu, replica=self.replicas[a.gpu].url, ok=ok, detail=detail)
            self._step(a.gpu, rl.Done(a.what, ok, detail))
        else:  # pragma: no cover - a bug in the executor
            raise TypeError(f"unknown action {a!r}")

    def _in_flight(self, gpu: str) -> int | None:
        """The router's count of requests on the replica; where it cannot tell, or the engine is about
        to sleep (requests that reached it by another path would fail), the engine's own too."""
        assert self.router is not None  # __init__ checked
        url, engine = self.replicas[gpu].url, self.engines[gpu]
        try:
            n = self.router.in_flight(url)
        except RouterError as e:
            self.ex.log.warning("replica.drain_unread", gpu=gpu, replica=url, reason=str(e))
            n = None
        if n is None or engine.can_sleep:
            own = engine.in_flight()
            n = own if n is None else max(n, own or 0)
        return n

    def _do(self, gpu: str, what: str) -> tuple[bool, str]:
        assert self.router is not None  # __init__ checked
        url, engine = self.replicas[gpu].url, self.engines[gpu]
        try:
            if what == "remove":
                self.router.remove(url)
            elif what == "readmit":
                self.router.readmit(url)
                self._marker(gpu).unlink(missing_ok=True)
            elif what == "sleep":
                return engine.sleep()
            elif what == "wake":
                return engine.wake()
            elif what == "health":
                return engine.healthy()
            elif what == "leftover":
                return self._no_leftover(gpu)
        except RouterError as e:
            return False, str(e)
        return True, ""

    def _marker(self, gpu: str) -> Path:
        key = hashlib.sha1(f"{gpu} {self.replicas[gpu].url}".encode()).hexdigest()[:16]
        return MARKER_DIR / f"{key}.json"

    def _no_leftover(self, gpu: str) -> tuple[bool, str]:
        """Whether the rollout process noted for the replica (by an earlier executor) is gone. It got
        SIGTERM when that executor died (PR_SET_PDEATHSIG) and drains; past the revoke deadline
        after this executor's start it is SIGKILLed."""
        path = self._marker(gpu)
        try:
            note = json.loads(path.read_text())
            proc = psutil.Process(int(note["pid"]))
            same = abs(proc.create_time() - float(note["create_time"])) < 0.01
            alive = same and proc.status() != psutil.STATUS_ZOMBIE  # a zombie has exited: its memory is back
        except (OSError, ValueError, KeyError, TypeError, psutil.Error):
            alive = False
        if not alive:
            path.unlink(missing_ok=True)
            return True, ""
        if time.monotonic() - self._started_at > self.ex.params.revoke_deadline_s:
            proc.kill()
        return False, f"rollout process {proc.pid} of an earlier lease is still running"
