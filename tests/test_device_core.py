"""rose.demo.device_core: a core's /proc/stat line parsed into seconds, the split of a window's
time into idle, serving and rollout, and a real read of CPU 0."""

from __future__ import annotations

import os
import time

import pytest

from rose.demo import device_core
from rose.demo.device_core import CoreSample, parse, read_core, split

STAT = """cpu  9000 300 2000 50000 120 10 20 0 0 0
cpu0 4000 100 1000 25000 60 5 10 0 0 0
cpu1 5000 200 1000 25000 60 5 10 7 0 0
intr 123456 0 0
ctxt 987654
"""


def test_the_line_of_the_core_asked_for_is_read_in_seconds():
    c = parse(STAT, 1, hz=100)
    assert c == CoreSample(
        1, user=50.0, nice=2.0, system=10.0, idle=250.0, iowait=0.6, irq=0.05, softirq=0.1, steal=0.07
    )
    assert parse(STAT, 0, hz=100).user == 40.0  # cpu0, not the aggregate `cpu` line nor cpu1
    with pytest.raises(ValueError, match="cpu2"):
        parse(STAT, 2, hz=100)


def test_a_short_line_of_an_older_kernel_reads_the_missing_columns_as_zero():
    c = parse("cpu3 100 0 100 800\n", 3, hz=100)
    assert (c.user, c.system, c.idle, c.iowait, c.steal) == (1.0, 1.0, 8.0, 0.0, 0.0)


def test_the_split_puts_nice_time_on_rollout_and_the_rest_of_the_work_on_serving():
    a = CoreSample(0, user=10, nice=5, system=2, idle=100, iowait=1, irq=0.5, softirq=0.5, steal=3)
    b = CoreSample(0, user=13, nice=9, system=3, idle=101, iowait=1.5, irq=0.75, softirq=1.0, steal=4)
    s = split(a, b)
    assert s == {"idle_s": 1.5, "serving_s": 4.75, "rollout_s": 4.0, "counted_s": 10.25}  # steal left out
    assert device_core.add([s, s]) == {
        "idle_s": 3.0,
        "serving_s": 9.5,
        "rollout_s": 8.0,
        "counted_s": 20.5,
        "windows": 2,
    }
    with pytest.raises(ValueError, match="two CPUs"):
        split(a, CoreSample(1, *[0.0] * 8))


def test_cpu_0_counts_the_time_of_a_busy_loop_run_there():
    if not os.path.exists("/proc/stat") or not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs Linux's /proc/stat")
    own = os.sched_getaffinity(0)
    if 0 not in own:
        pytest.skip("CPU 0 is not ours to run on")
    os.sched_setaffinity(0, {0})
    try:
        a = read_core(0)
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            pass
        b = read_core(0)
    finally:
        os.sched_setaffinity(0, own)
    s = split(a, b)
    # the core was counted for about the loop's 0.3 s (ticks of 1/USER_HZ), and busy for some of it
    assert 0.15 <= s["counted_s"] <= 0.6
    assert s["serving_s"] + s["rollout_s"] > 0


def test_pin_process_moves_every_thread_of_a_process_and_its_later_threads_and_back():
    """sched_setaffinity acts on one thread: a process with a thread running already has each of
    its threads moved, and a thread it starts afterwards inherits the CPUs."""
    import subprocess
    import sys

    cpus = sorted(os.sched_getaffinity(0))  # the child starts on all of them
    code = (
        "import threading, time, sys\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('up', flush=True); sys.stdin.readline()\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('again', flush=True); sys.stdin.readline()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        assert device_core.pin_process({cpus[0]}, child.pid) == set(cpus)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "again"
        tasks = os.listdir(f"/proc/{child.pid}/task")
        assert len(tasks) >= 3, tasks  # the main thread, the first and the later one
        for tid in tasks:
            assert os.sched_getaffinity(int(tid)) == {cpus[0]}, tid
        device_core.pin_process(set(cpus), child.pid)  # and back, every thread
        assert all(os.sched_getaffinity(int(t)) == set(cpus) for t in os.listdir(f"/proc/{child.pid}/task"))
    finally:
        child.kill()
        child.wait(10)
