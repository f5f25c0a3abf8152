"""The executor reads `executor.max_clock_skew_s`: a command whose record is stamped further
ahead of the executor's wall clock than that (transit only adds age, so this clock is behind the
scheduler's by at least as much, and a lease could end here later than its bound) is logged as
`executor.clock_skew` and counted; a command within the bound is not. Real executor process,
real broker. Planted bugs it catches: the bound read by nothing (no line for the command 10 s
ahead), or not applied (a line for the command 1.5 s ahead, within the 2 s bound)."""

from __future__ import annotations

import time

import pytest

from rose.contract.wire import encode
from rose.kafka.producer import make_producer
from rose.obs.tracing import inject_headers
from tests.examples import command_example
from tests.test_executor import GPU, ExecutorProc, env_for

pytestmark = pytest.mark.stack


def _revoke_stamped(cfg, producer, cid: str, ahead_s: float) -> None:
    """A revoke for a GPU with no lease (harmless), its record stamped `ahead_s` from now."""
    now = time.time()
    cmd = command_example(
        kind="revoke", gpu=GPU, epoch=1, command_id=cid, lease_id=f"{GPU}#1", ts=now, expires_at=now + 30
    )
    producer.produce(
        cfg.kafka.commands_topic,
        encode(cmd),
        GPU,
        headers=inject_headers(),
        timestamp=int((now + ahead_s) * 1000),
    )
    assert producer.flush(10) == 0


def test_a_command_stamped_beyond_the_skew_bound_is_logged(cfg, tmp_path):
    ex = ExecutorProc(env_for(cfg, tmp_path, ROSE_EXECUTOR__WORKER="placeholder"))
    try:
        p = make_producer(cfg.kafka)
        _revoke_stamped(cfg, p, "a" * 32, 1.5)  # within the bound: read first (same partition), no line
        _revoke_stamped(cfg, p, "b" * 32, 10.0)
        line = ex.wait_log("executor.clock_skew", 60, gpu=GPU)
        assert 8.0 < line["ahead_s"] <= 10.0 and line["max_clock_skew_s"] == 2.0
        assert [ln for ln in ex.lines if ln.get("event") == "executor.clock_skew"] == [line]
    finally:
        ex.stop()
