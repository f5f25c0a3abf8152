"""Enforced memory caps (rose.executor.memory_cap), without brokers: the pure over-cap rule
(examples and properties), the RSS adapter and the watchdog on real processes, cgroup v2
detection and placement on a directory laid out like one (a real OOM kill where this host
delegates a cgroup), the lease machine's path when the executor ends a lease itself, the
workers' fault-injection hook, and the launcher's niceness.
The executor on the real stack: tests/test_executor_memory_cap.py."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rose.config import GiB, load_config
from rose.executor import lease_machine as lm
from rose.executor import memory_cap as mc
from rose.executor.memory_cap import OVER_CAP, CapRule, CgroupCap, MemoryWatchdog, over_cap, tree_rss
from rose.rollout.launcher import spawn
from rose.rollout.worker_process import FAULT_ALLOCATE_BYTES_ENV, _fault_ballast, inject_memory_fault
from tests.examples import command_example

MiB = 1 << 20
RULE = CapRule(poll_s=0.25, samples=2, grace_s=1.0)


# ---- the rule ----------------------------------------------------------------------------------
def test_over_cap_needs_the_last_n_samples_all_above_the_grant():
    cap = GiB
    assert not over_cap([], cap, RULE)
    assert not over_cap([2 * GiB], cap, RULE)  # one sample: maybe a fork's double count
    assert over_cap([2 * GiB, 2 * GiB], cap, RULE)
    assert over_cap([GiB // 2, GiB + 1, GiB + 1], cap, RULE)  # only the last two count
    assert not over_cap([2 * GiB, GiB, 2 * GiB], cap, RULE)  # back under in between
    assert not over_cap([cap, cap], cap, RULE)  # exactly the grant is within it
    assert not over_cap([2 * GiB, 2 * GiB], 0, RULE)  # no grant, no cap
    assert over_cap([GiB + 1], cap, dataclasses.replace(RULE, samples=1))


samples_st = st.lists(st.integers(0, 1 << 40), max_size=12)
cap_st = st.integers(-1, 1 << 40)
rule_st = st.builds(CapRule, poll_s=st.just(0.25), samples=st.integers(1, 5), grace_s=st.just(1.0))


@given(samples_st, cap_st, rule_st)
def test_over_cap_is_exactly_n_consecutive_samples_over_a_positive_cap(samples, cap, rule):
    want = cap > 0 and len(samples) >= rule.samples and min(samples[-rule.samples :]) > cap
    assert over_cap(samples, cap, rule) == want


@given(samples_st, cap_st, rule_st, st.integers(0, 1 << 30), st.integers(0, 1 << 30))
def test_over_cap_is_monotone_in_memory_and_in_the_grant(samples, cap, rule, more, less):
    if over_cap(samples, cap, rule):
        assert over_cap([s + more for s in samples], cap, rule)  # holding more never helps
        assert over_cap(samples, cap - less, rule) or cap - less <= 0  # a smaller grant neither
    else:
        assert not over_cap([max(0, s - more) for s in samples], cap, rule)
        assert not over_cap(samples, cap + less, rule) or cap <= 0  # a grant of 0 caps nothing


@given(samples_st, samples_st, cap_st, rule_st)
def test_over_cap_looks_only_at_the_newest_samples(older, newer, cap, rule):
    if len(newer) >= rule.samples:
        assert over_cap(older + newer, cap, rule) == over_cap(newer, cap, rule)
    if not over_cap(newer, cap, rule) and len(newer) >= rule.samples:
        assert not over_cap(older + newer, cap, rule)


def test_the_rule_comes_from_the_executor_config_and_never_outwaits_the_revoke_deadline():
    cfg = load_config(env={"ROSE_EXECUTOR__MEM_CAP_POLL_S": "0.1", "ROSE_EXECUTOR__MEM_CAP_SAMPLES": "3"})
    assert CapRule.from_config(cfg.executor) == CapRule(0.1, 3, 1.0)
    defaults = load_config(env={}).executor
    assert (defaults.mem_cap_poll_s, defaults.mem_cap_samples, defaults.mem_cap_grace_s) == (0.25, 2, 1.0)
    assert defaults.mem_cap_cgroup == "auto"
    short = dataclasses.replace(defaults, mem_cap_grace_s=5.0, revoke_deadline_s=2.0)
    assert CapRule.from_config(short).grace_s == 2.0
    for bad in (dict(mem_cap_poll_s=-1.0), dict(mem_cap_samples=0), dict(mem_cap_grace_s=-0.1)):
        with pytest.raises(ValueError, match="executor.mem_cap_"):
            CapRule.from_config(dataclasses.replace(defaults, **bad))
    # only CPU rollout workers are watched: on CUDA the grant is device memory
    assert MemoryWatchdog.from_config(defaults, "cpu", None).on
    assert not MemoryWatchdog.from_config(defaults, "cuda:0", None).on
    assert not MemoryWatchdog.from_config(dataclasses.replace(defaults, worker="placeholder"), "cpu", None).on
    assert not MemoryWatchdog.from_config(dataclasses.replace(defaults, mem_cap_poll_s=0.0), "cpu", None).on


# ---- real processes ----------------------------------------------------------------------------
def hog(mib: int, *, ignore_term: bool = False, child_mib: int = 0) -> subprocess.Popen:
    """A python process holding `mib` MiB (touched), optionally with a child holding more,
    optionally deaf to SIGTERM; it prints "ready" once everything is resident."""
    code = textwrap.dedent(
        f"""
        import signal, subprocess, sys, time
        if {ignore_term}:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        kid = None
        if {child_mib}:
            kid = subprocess.Popen([sys.executable, "-c",
                "import sys, time; b = bytearray({child_mib} << 20); print('ok', flush=True); time.sleep(60)"],
                stdout=subprocess.PIPE)
            kid.stdout.readline()
        ballast = bytearray({mib} << 20)
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
    return p


def end(*procs: subprocess.Popen) -> None:
    for p in procs:
        for c in psutil.Process(p.pid).children(recursive=True) if p.poll() is None else []:
            c.kill()
        p.kill()
        p.wait(5)


@pytest.mark.parametrize("proc_children", [True, False], ids=["proc-children", "process-table"])
def test_tree_rss_sums_the_worker_and_its_children(monkeypatch, proc_children):
    if proc_children and not mc._PROC_CHILDREN:
        pytest.skip("this kernel does not list /proc/<pid>/task/<tid>/children")
    monkeypatch.setattr(mc, "_PROC_CHILDREN", proc_children)
    p = hog(40, child_mib=80)
    try:
        kid = psutil.Process(p.pid).children()[0]
        own, kids = psutil.Process(p.pid).memory_info().rss, kid.memory_info().rss
        got = tree_rss([p.pid])[p.pid]
        assert kids >= 80 * MiB and got >= own + kids - 8 * MiB  # both (the two samples differ a little)
        gone = subprocess.Popen(["true"])
        gone.wait()
        assert tree_rss([gone.pid, p.pid]).keys() == {p.pid}  # a process that is gone is left out
        assert tree_rss([]) == {}
    finally:
        end(p)


class Log:
    """Records structured log calls as (event, fields)."""

    def __init__(self):
        self.lines: list[tuple[str, dict]] = []

    def _log(self, event, **kw):
        self.lines.append((event, kw))

    info = warning = _log

    def events(self, name: str) -> list[dict]:
        return [kw for ev, kw in self.lines if ev == name]


def test_the_watchdog_stops_a_worker_over_its_grant_and_kills_it_after_the_grace():
    log = Log()
    dog = MemoryWatchdog(CapRule(poll_s=0.05, samples=2, grace_s=0.3), log, cgroup_setting="off")
    dog.start()
    assert log.events("executor.memory_cap")[0]["cgroup"] is False
    fat = hog(150, ignore_term=True)  # deaf to the drain request: only SIGKILL ends it
    thin = hog(1)
    n0 = OVER_CAP.value(by="watchdog")
    try:
        dog.watch("sim/0", fat, 100 * MiB)
        dog.watch("sim/1", thin, 100 * MiB)
        assert dog.poll() == []  # one sample is not enough
        breaches: list = []
        deadline = time.monotonic() + 5
        while not breaches and time.monotonic() < deadline:
            time.sleep(0.05)
            breaches = dog.poll()
        assert [(b.gpu, b.pid, b.cap_bytes, b.by) for b in breaches] == [("sim/0", fat.pid, 100 * MiB, "watchdog")]
        assert breaches[0].rss_bytes > 150 * MiB
        line = log.events("worker.over_memory_cap")[0]
        assert line["rss_bytes"] > line["cap_bytes"] == 100 * MiB and line["gpu"] == "sim/0"
        assert OVER_CAP.value(by="watchdog") - n0 == 1
        breached_at = time.monotonic()
        fat.terminate()  # what the executor's stop sends; this one ignores it
        while fat.poll() is None and time.monotonic() < breached_at + 3:
            assert dog.poll() == []  # reported once
            time.sleep(0.02)
        assert fat.returncode == -9 and 0.25 <= time.monotonic() - breached_at < 1.5
        assert log.events("worker.killed")[0]["reason"] == "over_memory_cap"
        assert dog.unwatch("sim/0") is None  # no cgroup: nothing more to say
        assert thin.poll() is None and "sim/1" in dog.watched  # under its grant: untouched
    finally:
        end(fat, thin)


# ---- cgroup v2 ---------------------------------------------------------------------------------
def fake_cgroup(root: Path, controllers: str = "cpu memory pids", subtree: str = "memory") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text(subtree + "\n")
    return root


def test_cgroup_detection_says_why_not_and_finds_a_delegated_directory(tmp_path):
    assert CgroupCap.detect("off") == (None, "turned off (executor.mem_cap_cgroup = off)")
    cg, why = CgroupCap.detect(str(tmp_path / "nowhere"))
    assert cg is None and "not a cgroup v2 directory" in why
    cg, why = CgroupCap.detect(str(fake_cgroup(tmp_path / "nomem", controllers="cpu pids")))
    assert cg is None and "memory controller is not available" in why
    cg, why = CgroupCap.detect(str(fake_cgroup(tmp_path / "ok")))
    assert cg is not None and cg.base == tmp_path / "ok" and why == ""
    # memory available but not yet enabled for children: enabled by writing +memory
    cg, why = CgroupCap.detect(str(fake_cgroup(tmp_path / "enable", subtree="")))
    assert cg is not None and (tmp_path / "enable" / "cgroup.subtree_control").read_text() == "+memory"
    # this host, whatever it has: an answer, never an exception
    cg, why = CgroupCap.detect("auto")
    assert (cg is None) == bool(why)


def test_cgroup_mount_and_own_cgroup_are_read_from_proc(tmp_path):
    mi = tmp_path / "mountinfo"
    mi.write_text(
        "30 25 0:26 / /sys/fs/cgroup/memory rw,relatime shared:9 - cgroup cgroup rw,memory\n"
        "35 25 0:31 / /sys/fs/cgroup/unified rw,relatime shared:14 - cgroup2 cgroup2 rw\n"
    )
    assert mc._cgroup2_mount(str(mi)) == Path("/sys/fs/cgroup/unified")
    pc = tmp_path / "cgroup"
    pc.write_text("4:memory:/x\n0::/system.slice/rose.service\n")
    assert mc._own_cgroup(str(pc)) == "/system.slice/rose.service"
    assert mc._cgroup2_mount(str(tmp_path / "missing")) is None and mc._own_cgroup(str(tmp_path / "missing")) is None


def test_a_watched_worker_is_placed_in_its_own_cgroup_and_an_oom_kill_count_in_its_memory_events_is_a_breach(
    tmp_path,
):
    """On a directory laid out like a delegated cgroup v2: the watchdog makes the worker's own
    cgroup (memory.max = the lease, its pid in cgroup.procs), and on unwatch reads its
    memory.events: an `oom_kill` count there is reported as a breach by the cgroup, none as an
    ordinary exit. The kernel kills nothing here: the test writes the `oom_kill` line itself (a
    real kill: test_the_kernel_oom_kills_a_worker_over_its_cgroup_cap_and_it_is_a_breach)."""
    base = fake_cgroup(tmp_path / "cg")
    log = Log()
    dog = MemoryWatchdog(RULE, log, cgroup_setting=str(base))
    dog.start()
    assert log.events("executor.memory_cap")[0]["cgroup_dir"] == str(base)
    p = subprocess.Popen(["sleep", "30"])
    try:
        dog.watch("sim/0", p, GiB)
        path = dog.watched["sim/0"].cgroup
        assert path is not None and path.parent == base and path.name.startswith(CgroupCap.PREFIX)
        assert (path / "memory.max").read_text() == str(GiB)
        assert (path / "cgroup.procs").read_text() == str(p.pid)
        (path / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
        n0 = OVER_CAP.value(by="cgroup")
        b = dog.unwatch("sim/0")
        assert b is not None and (b.gpu, b.pid, b.cap_bytes, b.by) == ("sim/0", p.pid, GiB, "cgroup")
        assert OVER_CAP.value(by="cgroup") - n0 == 1 and log.events("worker.over_memory_cap")[0]["by"] == "cgroup"
        q = subprocess.Popen(["sleep", "30"])
        dog.watch("sim/1", q, GiB)
        assert dog.unwatch("sim/1") is None  # no oom_kill in its memory.events: an ordinary exit
        end(q)
    finally:
        end(p)


def test_the_kernel_oom_kills_a_worker_over_its_cgroup_cap_and_it_is_a_breach():
    """Where this host delegates a cgroup v2 with the memory controller: a worker that allocates
    four times its 64 MiB lease is killed by the kernel at its cgroup's memory.max, and the
    watchdog reports the kill as a breach by the cgroup."""
    cg, why = CgroupCap.detect("auto")
    if cg is None:
        pytest.skip(f"no delegated cgroup v2 memory controller on this host: {why}")
    log = Log()
    dog = MemoryWatchdog(RULE, log, cgroup_setting="auto")
    dog.start()
    cap = 64 * MiB
    grow = "import sys, time; sys.stdin.readline(); b = bytearray(4 * 64 << 20); time.sleep(30)"
    p = subprocess.Popen([sys.executable, "-c", grow], stdin=subprocess.PIPE)
    try:
        dog.watch("sim/0", p, cap)  # in its cgroup before it allocates: it waits for a line
        assert dog.watched["sim/0"].cgroup is not None
        assert p.stdin is not None
        p.stdin.write(b"go\n")
        p.stdin.flush()
        assert p.wait(30) == -9  # SIGKILL from the kernel's OOM killer
        b = dog.unwatch("sim/0")
        assert b is not None and (b.gpu, b.pid, b.cap_bytes, b.by) == ("sim/0", p.pid, cap, "cgroup")
    finally:
        if p.poll() is None:
            end(p)


# ---- the executor's path: the lease machine ends a lease from its own side ---------------------
def test_ending_a_lease_from_the_executor_side_publishes_revoking_then_revoked_after_the_exit():
    """What `Executor._revoke_itself` feeds the machine for a worker over its cap."""
    p = lm.Params(revoke_deadline_s=2.0, restart_backoff_s=1.0)
    grant = command_example(
        kind="grant", gpu="sim/0", epoch=4, command_id="g4", lease_id="sim/0#4", mem_bytes=GiB, ts=0.0, expires_at=30.0
    )
    s, acts = lm.step(lm.initial("sim/0"), lm.Received(grant), 0.0, p)
    assert any(isinstance(a, lm.Start) for a in acts)
    s, acts = lm.step(s, lm.Shutdown(), 1.0, p)
    kinds = [type(a).__name__ for a in acts]
    assert kinds[:2] == ["Pause", "Publish"] and "Stop" in kinds and "Start" not in kinds
    assert [a.record.state for a in acts if isinstance(a, lm.Publish)] == ["revoking"]
    s, acts = lm.step(s, lm.WorkerExited(), 1.5, p)
    pubs = [a.record for a in acts if isinstance(a, lm.Publish)]
    assert [(r.state, r.epoch, r.command_id) for r in pubs] == [("revoked", 4, "g4")]  # the lease's own grant
    s, acts = lm.step(s, lm.Tick(), 10.0, p)
    assert not any(isinstance(a, lm.Start) for a in acts)  # not restarted inside the lease: it is over


# ---- the fault-injection hook and the launcher's niceness --------------------------------------
def test_the_fault_injection_hook_holds_the_bytes_it_is_told_to():
    assert inject_memory_fault({}) == 0
    assert inject_memory_fault({FAULT_ALLOCATE_BYTES_ENV: "lots"}) == 0
    assert inject_memory_fault({FAULT_ALLOCATE_BYTES_ENV: "-5"}) == 0
    before = psutil.Process().memory_info().rss
    try:
        assert inject_memory_fault({FAULT_ALLOCATE_BYTES_ENV: str(64 * MiB)}) == 64 * MiB
        assert psutil.Process().memory_info().rss - before >= 60 * MiB
    finally:
        _fault_ballast.clear()


def test_the_launcher_starts_children_at_the_niceness_it_is_given_and_applying_it_again_changes_nothing():
    own = os.getpriority(os.PRIO_PROCESS, 0)
    code = "import os; from rose.rollout.launcher import apply_nice; apply_nice(7); print(os.getpriority(os.PRIO_PROCESS, 0))"
    p = spawn([sys.executable, "-c", code], nice=7, stdout=subprocess.PIPE)
    out, _ = p.communicate(timeout=30)
    assert int(out) == max(7, own)
    q = spawn(["sleep", "10"], nice=3)
    try:
        assert psutil.Process(q.pid).nice() == max(3, own)
    finally:
        end(q)


# a child that ignores SIGTERM (so it is still there after a stop), starts a thread and says so
_THREADED_CHILD = (
    "import signal, sys, threading, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "if sys.argv[1:] == ['apply']:\n"
    "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    "    from rose.rollout.launcher import apply_sched_idle\n"
    "    apply_sched_idle()\n"
    "else:\n"
    "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def _policies(pid: int) -> dict[int, int]:
    return {int(t): os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def test_a_sched_idle_worker_runs_every_thread_at_sched_idle_until_it_is_stopped():
    import uuid

    from rose.executor.workers import WorkerHandle, stop_worker
    from rose.rollout.pause_flag import STOP, PauseFlag

    # set by the launcher before exec: the main thread and the thread it starts later, niced too
    p = spawn([sys.executable, "-c", _THREADED_CHILD], nice=19, sched_idle=True, stdout=subprocess.PIPE, text=True)
    flag = PauseFlag(f"rose-test-{uuid.uuid4().hex[:8]}", create=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        got = _policies(p.pid)
        assert len(got) == 2 and set(got.values()) == {os.SCHED_IDLE}
        assert psutil.Process(p.pid).nice() == 19  # SCHED_IDLE keeps the niceness (/proc/stat: nice time)
        # stopping it gives every thread SCHED_OTHER and niceness 0 back, so it drains promptly
        logged: list = []

        class Log:
            def warning(self, event, **kw):
                logged.append(event)

        stop_worker(WorkerHandle("real/0", p, flag, 1), Log())
        assert flag.get() == STOP
        assert set(_policies(p.pid).values()) == {os.SCHED_OTHER} and not logged
        assert {os.getpriority(os.PRIO_PROCESS, t) for t in _policies(p.pid)} == {0}
    finally:
        end(p)
        flag.close()
        flag.unlink()


def test_a_worker_started_by_hand_puts_the_threads_it_has_under_sched_idle():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    p = subprocess.Popen([sys.executable, "-c", _THREADED_CHILD, "apply"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        got = _policies(p.pid)
        assert len(got) == 2 and set(got.values()) == {os.SCHED_IDLE}
    finally:
        end(p)


def test_a_stop_refused_the_way_out_of_sched_idle_logs_it_and_still_stops(monkeypatch):
    import uuid

    from rose.executor import workers
    from rose.rollout.pause_flag import STOP, PauseFlag

    p = spawn([sys.executable, "-c", _THREADED_CHILD], sched_idle=True, stdout=subprocess.PIPE, text=True)
    flag = PauseFlag(f"rose-test-{uuid.uuid4().hex[:8]}", create=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"

        def refuse(*_a):
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(workers.os, "sched_setscheduler", refuse)
        logged: list = []

        class Log:
            def warning(self, event, **kw):
                logged.append((event, kw))

        signals: list = []
        monkeypatch.setattr(p, "send_signal", signals.append)
        workers.stop_worker(workers.WorkerHandle("real/0", p, flag, 1), Log())
        assert flag.get() == STOP and signals == [15]  # SIGTERM still sent
        assert logged == [("worker.sched_idle_kept", {"gpu": "real/0", "pid": p.pid, "threads": 2})]
        assert set(_policies(p.pid).values()) == {os.SCHED_IDLE}
    finally:
        monkeypatch.undo()
        end(p)
        flag.close()
        flag.unlink()
