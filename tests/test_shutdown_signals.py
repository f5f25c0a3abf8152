"""rose.shutdown's answer to a repeated signal: by default it ends the process at once; with
`repeat_ends=False` (the rollout worker, whose parent's death can deliver its SIGTERM twice) the
graceful stop goes on, bounded by the deadline."""

from __future__ import annotations

import signal

import pytest

from rose.shutdown import Shutdown


def _signalled_twice(repeat_ends: bool, monkeypatch) -> tuple[Shutdown, list[str], list[str]]:
    s, exits, hooked = Shutdown(grace_s=600, name="t", repeat_ends=repeat_ends), [], []
    monkeypatch.setattr(s, "_exit", exits.append)
    s.hooks.append(lambda: hooked.append("stop"))
    s._on_signal(signal.SIGTERM, None)
    s._on_signal(signal.SIGTERM, None)
    s.cancel()
    return s, exits, hooked


def test_a_second_signal_ends_the_process_at_once_by_default(monkeypatch):
    s, exits, hooked = _signalled_twice(True, monkeypatch)
    assert exits == ["second SIGTERM"] and hooked == ["stop"] and s.stop.is_set()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_repeated_signal_leaves_the_graceful_stop_to_its_deadline(signum, monkeypatch):
    s, exits, hooked = _signalled_twice(False, monkeypatch)
    assert exits == [] and hooked == ["stop"] and s.stop.is_set() and s.requested
    s._on_signal(signum, None)
    assert exits == [] and hooked == ["stop"]
