"""What the co-served device's CPU core did: its line of /proc/stat, read at each window's edges
(rose.demo.phases), and the split of a window's time on the core into idle time, serving's time
and the leased rollout's time.

On CPU the demo pins the measured device (the serving engine) and the workers leased on it to
one core. The kernel counts each tick of a core's time in one column: `user` and `system` for
a task at niceness 0 or below (serving), `nice` for user time of a task at positive niceness (the
leased workers run at `executor.worker_nice`, and SCHED_IDLE keeps that niceness), `idle` and
`iowait` when nothing ran, `irq` / `softirq` for interrupts, `steal` for time a hypervisor gave
elsewhere. So over a window:

- idle_s    = idle + iowait: what nobody used, the time a lease could still have harvested;
- serving_s = user + system + irq + softirq: the nice-0 work on the core, the serving engine
  (and the kernel time of every task there, rollout's system calls included);
- rollout_s = nice: what the leased workers took;
- counted_s = their sum (steal left out), about the window's length.

serving_s counts every nice-0 task the kernel ran there, so what is not the device stays off the
core: the demo moves itself and, once its server runs, the device's own load generator and
telemetry to the host's cores (`pin_process`), as a GPU node keeps its clients off the GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


@dataclass(frozen=True)
class CoreSample:
    """One core's cumulative times since boot, in seconds."""

    cpu: int
    user: float
    nice: float
    system: float
    idle: float
    iowait: float
    irq: float
    softirq: float
    steal: float


def parse(text: str, cpu: int, hz: float | None = None) -> CoreSample:
    """The `cpuN` line of a /proc/stat text as seconds (`hz` ticks a second: the kernel's
    USER_HZ, os.sysconf('SC_CLK_TCK'), by default); ValueError if the text has no such line."""
    hz = hz or os.sysconf("SC_CLK_TCK")
    name = f"cpu{cpu}"
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == name:
            ticks = [int(x) for x in parts[1 : 1 + len(FIELDS)]]
            ticks += [0] * (len(FIELDS) - len(ticks))  # older kernels print fewer columns
            return CoreSample(cpu, *(t / hz for t in ticks))
    raise ValueError(f"/proc/stat: no line for {name}")


def read_core(cpu: int, path: str = "/proc/stat") -> CoreSample:
    """CPU `cpu`'s times now."""
    with open(path, encoding="ascii") as f:
        return parse(f.read(), cpu)


def split(a: CoreSample, b: CoreSample) -> dict:
    """The core's time between samples `a` and `b` (b later), in seconds: idle_s, serving_s,
    rollout_s and counted_s (the module docstring says what each holds)."""
    if a.cpu != b.cpu:
        raise ValueError(f"samples of two CPUs: {a.cpu} and {b.cpu}")
    d = {f: getattr(b, f) - getattr(a, f) for f in FIELDS}
    idle = d["idle"] + d["iowait"]
    serving = d["user"] + d["system"] + d["irq"] + d["softirq"]
    rollout = d["nice"]
    return {
        "idle_s": round(idle, 2),
        "serving_s": round(serving, 2),
        "rollout_s": round(rollout, 2),
        "counted_s": round(idle + serving + rollout, 2),
    }


def add(splits: list[dict]) -> dict:
    """Several windows' splits summed, with how many there were."""
    keys = ("idle_s", "serving_s", "rollout_s", "counted_s")
    return {**{k: round(sum(s[k] for s in splits), 2) for k in keys}, "windows": len(splits)}


def pin_process(cpus: set[int], pid: int = 0) -> set[int]:
    """Run every thread of process `pid` (0: this one) on `cpus` only; threads it starts later
    inherit it. (sched_setaffinity acts on one thread, so each of /proc/PID/task is moved.)
    Returns the CPUs its main thread had, to pin it back with."""
    pid = pid or os.getpid()
    before = os.sched_getaffinity(pid)
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass  # the thread ended meanwhile
    return before
