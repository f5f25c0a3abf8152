"""The executor benches run end to end on the local stack (quick mode) and report their
figures; timings are reported, never asserted."""

import pytest

pytestmark = pytest.mark.stack


def test_revoke_bench_reports_every_figure(cfg):
    from rose.bench import revoke

    out = revoke.run(cfg, quick=True)
    for k in ("kafka_worker_paused_ms", "kafka_revoked_published_ms", "guard_worker_paused_ms", "guard_flag_raised_ms"):
        assert out[k]["n"] > 0 and out[k]["p50_ms"] is not None and out[k]["p99_ms"] is not None
    assert out["path"] == "command→executor"
    assert out["memory_freed_fraction"] == 1.0
    assert "kafka_paused_p99_over_goal" in out and "guard_paused_p99_over_goal" in out


def test_interference_bench_reports_three_phases(cfg):
    from rose.bench import interference

    out = interference.run(cfg, quick=True)
    for k in ("alone_ms", "unprotected_ms", "protected_ms"):
        assert out[k]["n"] > 0 and out[k]["p99_ms"] > 0
    assert out["unprotected_ms"]["rollout_loop_iters_per_s"] > 0  # the rollout worker really ran
    assert {"unprotected_p99_over_alone", "protected_p99_over_alone", "goal_protected_p99_over_alone"} <= set(out)
