"""The shared-memory pause flag: visible across processes, measured latency fields."""

import multiprocessing as mp
import time
import uuid

import pytest

from rose.rollout.pause_flag import PAUSE, RUN, STOP, PauseFlag


def _child(name: str, q) -> None:
    f = PauseFlag(name)
    q.put(("ready", f.get()))
    deadline = time.monotonic() + 10
    while f.beat() != PAUSE and time.monotonic() < deadline:
        pass
    f.mark_paused()
    while f.get() != STOP and time.monotonic() < deadline:
        time.sleep(0.0005)
    q.put(("done", f.get()))
    f.close()


@pytest.fixture
def flag():
    f = PauseFlag(f"rose-test-{uuid.uuid4().hex[:8]}", create=True)
    yield f
    f.close()
    f.unlink()


def test_fresh_flag_runs(flag):
    assert flag.get() == RUN
    assert flag.heartbeat == 0 and flag.paused_seen_ns == 0


def test_set_get_across_processes(flag):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(flag.name, q))
    p.start()
    assert q.get(timeout=30) == ("ready", RUN)
    flag.set(PAUSE)
    deadline = time.monotonic() + 10
    while flag.paused_seen_ns == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert flag.paused_seen_ns >= flag.set_ns > 0  # one monotonic clock for both processes
    assert flag.heartbeat > 0
    flag.set(STOP)
    assert q.get(timeout=10) == ("done", STOP)
    p.join(10)
    assert p.exitcode == 0
    # the child attached and exited: the segment is still there for the owner
    again = PauseFlag(flag.name)
    assert again.get() == STOP
    again.close()


def test_bad_state_rejected(flag):
    with pytest.raises(ValueError, match="state"):
        flag.set(7)
    assert flag.get() == RUN


def test_attach_to_missing_flag_fails():
    with pytest.raises(FileNotFoundError):
        PauseFlag(f"rose-missing-{uuid.uuid4().hex[:8]}")
