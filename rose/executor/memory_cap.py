"""Enforced memory caps of lease workers on CPU: a watchdog in the executor, and cgroup v2
`memory.max` where the executor may set it.

On CPU a lease's `mem_bytes` is otherwise arithmetic only (the engine sizes its KV cache to
it): nothing compares what the worker really holds with its grant. The rule that decides is
pure, `over_cap(samples, cap_bytes, rule)`: the worker is over its cap once the last
`rule.samples` polls all saw more than `cap_bytes` resident (RSS summed over the worker process
and its children). One sample is not enough because a sum of RSS over a process tree counts
copy-on-write pages twice for a moment after a fork, and a single poll can catch that.

`MemoryWatchdog` is the thin shell around it. The executor's housekeeping calls `poll()`
(which samples only every `rule.poll_s`, a few /proc reads per worker); a worker
newly over its cap is logged (`worker.over_memory_cap`, with rss and cap), counted
(`rose_executor_worker_over_memory_cap_total`) and returned, and the executor ends its lease
itself (`revoking`, then `revoked` once the worker is gone). The worker is asked to drain like
any revoked worker; if it is still there `rule.grace_s` later, the watchdog SIGKILLs it.

cgroup v2 (`CgroupCap`): where a cgroup v2 hierarchy with the memory controller is available
and writable, each lease worker also gets its own cgroup with `memory.max` = its grant, so the
kernel stops a runaway between two polls. Memory the worker was charged before it was moved
there (a warm worker's model) stays charged to the executor's cgroup, so the watchdog, which
counts all of it, remains the rule and `memory.max` the backstop. A worker the kernel killed in
its cgroup (`memory.events` oom_kill) is reported like one the watchdog caught. Where there is
no such cgroup, the executor says so once in its log and relies on the watchdog alone.

Only CPU workers are watched: on CUDA `mem_bytes` is device memory, capped by the allocator's
per-process fraction, and host RSS says nothing about it. In full: docs/executor.md.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from rose.config import ExecutorConfig
from rose.obs import metrics

OVER_CAP = metrics.counter(
    "rose_executor_worker_over_memory_cap_total",
    "Lease workers stopped for holding more memory than their grant, by who saw it (watchdog | cgroup)",
)


# ---- the rule (pure) -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CapRule:
    poll_s: float = 0.25  # how often the workers' memory is sampled; 0 turns the watchdog off
    samples: int = 2  # consecutive samples over the grant that stop the worker
    grace_s: float = 1.0  # SIGKILL a stopped over-cap worker still there this long after

    @classmethod
    def from_config(cls, ex: ExecutorConfig) -> CapRule:
        if ex.mem_cap_poll_s < 0:
            raise ValueError(f"executor.mem_cap_poll_s: expected >= 0, got {ex.mem_cap_poll_s}")
        if ex.mem_cap_samples < 1:
            raise ValueError(f"executor.mem_cap_samples: expected >= 1, got {ex.mem_cap_samples}")
        if ex.mem_cap_grace_s < 0:
            raise ValueError(f"executor.mem_cap_grace_s: expected >= 0, got {ex.mem_cap_grace_s}")
        # never later than the lease machine's own kill at the revoke deadline
        return cls(ex.mem_cap_poll_s, ex.mem_cap_samples, min(ex.mem_cap_grace_s, ex.revoke_deadline_s))


def over_cap(samples: Sequence[int] | deque[int], cap_bytes: int, rule: CapRule) -> bool:
    """Whether a worker with these resident-memory samples (oldest first) is over a grant of
    `cap_bytes`: the last `rule.samples` samples all exceed it. A grant of 0 or less (no
    lease) caps nothing."""
    n = rule.samples
    if cap_bytes <= 0 or n < 1 or len(samples) < n:
        return False
    return all(s > cap_bytes for s in list(samples)[-n:])


# ---- the psutil adapter ----------------------------------------------------------------------
def tree_rss(pids: Iterable[int]) -> dict[int, int]:
    """RSS summed over each of `pids` and all its descendants; a pid that is gone is left out.
    Children come from /proc/<pid>/task/<tid>/children (a few small reads per worker); where
    the kernel does not list them, from one pass over the process table for all of `pids`."""
    wanted = list(pids)
    if not wanted:
        return {}
    children = _proc_children if _PROC_CHILDREN else _ppid_map().get
    out: dict[int, int] = {}
    for root in wanted:
        total = _rss(root)
        if total is None:
            continue
        todo, seen = list(children(root) or ()), {root}
        while todo:
            pid = todo.pop()
            if pid not in seen:
                seen.add(pid)
                total += _rss(pid) or 0
                todo.extend(children(pid) or ())
        out[root] = total
    return out


_PROC_CHILDREN = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def _proc_children(pid: int) -> list[int]:
    """`pid`'s children as the kernel lists them, thread by thread (a child is listed under
    the thread that forked it)."""
    kids: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids  # gone
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                kids.extend(int(x) for x in f.read().split())
        except OSError:
            continue  # the thread ended meanwhile
    return kids


def _ppid_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for p in psutil.process_iter(["ppid"]):
        ppid = p.info.get("ppid")
        if ppid is not None:
            children.setdefault(ppid, []).append(p.pid)
    return children


def _rss(pid: int) -> int | None:
    try:
        rss: int = psutil.Process(pid).memory_info().rss
        return rss
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


# ---- cgroup v2 -------------------------------------------------------------------------------
def _cgroup2_mount(mountinfo: str = "/proc/self/mountinfo") -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (a hybrid host mounts it at .../unified)."""
    try:
        with open(mountinfo) as f:
            for line in f:
                pre, _, post = line.partition(" - ")
                if post.split(" ", 1)[0] == "cgroup2":
                    return Path(pre.split()[4])
    except OSError:
        pass
    return None


def _own_cgroup(proc_cgroup: str = "/proc/self/cgroup") -> str | None:
    """This process's cgroup v2 path (the `0::` line), e.g. `/system.slice/rose.service`."""
    try:
        with open(proc_cgroup) as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].strip()
    except OSError:
        pass
    return None


def _words(path: Path) -> set[str]:
    try:
        return set(path.read_text().split())
    except OSError:
        return set()


class CgroupCap:
    """Worker cgroups under `base`, a cgroup v2 directory whose children get the memory
    controller: `place(name, pid, cap)` makes `base/rose-worker-{name}` with `memory.max` =
    cap and moves `pid` into it; `oom_killed(path)` reads its memory.events; `remove(path)`."""

    PREFIX = "rose-worker-"

    def __init__(self, base: Path):
        self.base = base

    @classmethod
    def detect(cls, setting: str) -> tuple[CgroupCap | None, str]:
        """The cgroup to use for `executor.mem_cap_cgroup` ("auto", "off" or a directory), or
        None and why not. "auto" uses this process's own cgroup v2: when the memory controller
        is available there but not yet enabled for its children, and this process is the only
        one in it, it moves itself into a leaf (`rose-executor`) and enables it, as a service
        with a delegated cgroup does."""
        if setting == "off":
            return None, "turned off (executor.mem_cap_cgroup = off)"
        if setting != "auto":
            base = Path(setting)
        else:
            mount, own = _cgroup2_mount(), _own_cgroup()
            if mount is None or own is None:
                return None, "no cgroup v2 hierarchy"
            base = mount / own.lstrip("/")
        if not (base / "cgroup.controllers").is_file():
            return None, f"{base} is not a cgroup v2 directory"
        if "memory" not in _words(base / "cgroup.controllers"):
            return None, f"the memory controller is not available in {base}"
        if "memory" not in _words(base / "cgroup.subtree_control"):
            why = cls._enable_memory(base, move_self=setting == "auto")
            if why:
                return None, why
        if not os.access(base, os.W_OK):
            return None, f"{base} is not writable"
        return cls(base), ""

    @staticmethod
    def _enable_memory(base: Path, move_self: bool) -> str:
        """Enable the memory controller for `base`'s children; "" or why it could not."""
        control = base / "cgroup.subtree_control"
        try:
            control.write_text("+memory")
            return ""
        except OSError as e:
            if e.errno != errno.EBUSY or not move_self:
                return f"cannot enable memory in {control}: {e.strerror}"
        # busy: a cgroup with processes cannot have controlled children ("no internal processes")
        procs = {int(p) for p in _words(base / "cgroup.procs") if p.isdigit()}
        if procs != {os.getpid()}:
            return f"{base} holds other processes; give the executor a delegated cgroup (executor.mem_cap_cgroup)"
        try:
            leaf = base / "rose-executor"
            leaf.mkdir(exist_ok=True)
            (leaf / "cgroup.procs").write_text(str(os.getpid()))
            control.write_text("+memory")
            return ""
        except OSError as e:
            return f"cannot enable memory in {control}: {e.strerror}"

    def place(self, name: str, pid: int, cap_bytes: int) -> Path:
        """A new cgroup for worker `pid` with memory.max = cap (no swap beyond it); OSError if
        it cannot be made (the caller relies on the watchdog then)."""
        path = self.base / f"{self.PREFIX}{name}"
        path.mkdir(exist_ok=True)
        try:
            (path / "memory.max").write_text(str(max(1, cap_bytes)))
            try:
                (path / "memory.swap.max").write_text("0")
            except OSError:
                pass  # no swap accounting on this host: nothing to cap
            (path / "cgroup.procs").write_text(str(pid))
        except OSError:
            self.remove(path)
            raise
        return path

    @staticmethod
    def oom_killed(path: Path) -> bool:
        """Whether the kernel's OOM killer ended a process of this cgroup."""
        try:
            for line in (path / "memory.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and value.strip().isdigit() and int(value) > 0:
                    return True
        except OSError:
            pass
        return False

    @staticmethod
    def remove(path: Path) -> None:
        try:
            path.rmdir()
        except OSError:
            pass  # a process of it is still there; the cgroup goes when it is removed by hand


# ---- the watchdog (the shell) ----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Breach:
    """A lease worker over its grant: `by` "watchdog" (RSS samples) or "cgroup" (memory.max)."""

    gpu: str
    pid: int
    rss_bytes: int
    cap_bytes: int
    by: str


@dataclass
class _Watched:
    gpu: str
    proc: subprocess.Popen[bytes]
    cap_bytes: int
    samples: deque[int]
    cgroup: Path | None = None
    kill_at: float = float("inf")  # set at the breach: SIGKILL if the worker is still there
    breached: bool = False


@dataclass
class MemoryWatchdog:
    """Watches the lease workers of one executor (see the module docstring). `on` is False
    when nothing is to be watched (CUDA, placeholder workers, `mem_cap_poll_s = 0`)."""

    rule: CapRule
    log: Any  # the executor's structlog logger
    on: bool = True
    cgroup_setting: str = "auto"
    sample: Callable[[Iterable[int]], dict[int, int]] = tree_rss
    cgroup: CgroupCap | None = None
    watched: dict[str, _Watched] = field(default_factory=dict)
    next_poll: float = 0.0

    @classmethod
    def from_config(cls, ex: ExecutorConfig, device: str, log: Any) -> MemoryWatchdog:
        rule = CapRule.from_config(ex)
        on = rule.poll_s > 0 and device == "cpu" and ex.worker == "rollout"
        return cls(rule, log, on=on, cgroup_setting=ex.mem_cap_cgroup)

    def start(self) -> None:
        """Detect the cgroup and say once how caps are enforced."""
        if not self.on:
            self.log.info("executor.memory_cap", watchdog=False, cgroup=False)
            return
        self.cgroup, why = CgroupCap.detect(self.cgroup_setting)
        if self.cgroup is None:
            self.log.info(
                "executor.memory_cap", watchdog=True, poll_s=self.rule.poll_s, cgroup=False, cgroup_unavailable=why
            )
        else:
            self.log.info(
                "executor.memory_cap",
                watchdog=True,
                poll_s=self.rule.poll_s,
                cgroup=True,
                cgroup_dir=str(self.cgroup.base),
            )

    def watch(self, gpu: str, proc: subprocess.Popen[bytes], cap_bytes: int) -> None:
        """Start watching `gpu`'s lease worker, capped at `cap_bytes` (and put it in its cgroup)."""
        if not self.on:
            return
        w = _Watched(gpu, proc, cap_bytes, deque(maxlen=self.rule.samples))
        if self.cgroup is not None:
            try:
                w.cgroup = self.cgroup.place(f"{os.getpid()}-{proc.pid}", proc.pid, cap_bytes)
            except OSError as e:
                self.log.warning("worker.cgroup_failed", gpu=gpu, pid=proc.pid, error=e.strerror or str(e))
        self.watched[gpu] = w

    def unwatch(self, gpu: str) -> Breach | None:
        """`gpu`'s worker exited: stop watching it and remove its cgroup. A Breach when the
        kernel ended it for exceeding `memory.max` and the watchdog had not caught it yet."""
        w = self.watched.pop(gpu, None)
        if w is None or w.cgroup is None:
            return None
        cg = self.cgroup
        assert cg is not None  # it made w.cgroup
        hit = not w.breached and cg.oom_killed(w.cgroup)
        cg.remove(w.cgroup)
        if not hit:
            return None
        return self._breach(w, max(w.samples, default=0), "cgroup", time.monotonic())

    def poll(self, now: float | None = None) -> list[Breach]:
        """Every `rule.poll_s`: sample each watched worker, return those newly over their
        grant; SIGKILL those still alive `rule.grace_s` after their breach."""
        now = time.monotonic() if now is None else now
        for w in self.watched.values():
            if now >= w.kill_at:
                w.kill_at = float("inf")
                if w.proc.poll() is None:
                    self.log.warning("worker.killed", gpu=w.gpu, pid=w.proc.pid, reason="over_memory_cap")
                    w.proc.kill()
        if not self.watched or now < self.next_poll:
            return []
        self.next_poll = now + self.rule.poll_s
        live = [w for w in self.watched.values() if not w.breached]
        rss = self.sample(w.proc.pid for w in live) if live else {}
        out = []
        for w in live:
            if w.proc.pid not in rss:
                continue  # gone: the executor reaps it
            w.samples.append(rss[w.proc.pid])
            if over_cap(w.samples, w.cap_bytes, self.rule):
                out.append(self._breach(w, rss[w.proc.pid], "watchdog", now))
        return out

    def _breach(self, w: _Watched, rss: int, by: str, now: float) -> Breach:
        w.breached = True
        w.kill_at = now + self.rule.grace_s
        OVER_CAP.inc(by=by)
        self.log.warning(
            "worker.over_memory_cap",
            gpu=w.gpu,
            pid=w.proc.pid,
            rss_bytes=rss,
            cap_bytes=w.cap_bytes,
            samples=list(w.samples),
            by=by,
            grace_s=self.rule.grace_s,
        )
        return Breach(w.gpu, w.proc.pid, rss, w.cap_bytes, by)
