"""`rose demo`: the report's arithmetic (pure), the trainer's loss inputs, the co-served
device's latency windows, and one short end-to-end run on the real stack."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rose.demo import report
from rose.demo.coserve import CoserveSpec, LatencyWindow, calibrated_slo, scaled_lengths
from rose.demo.observed import Observed
from rose.demo.trainer import advantages, reward, sequence_and_mask, staleness
from rose.obs.stats import percentile


def _ls(gpu, lid, state, ts, cid="c", epoch=1):
    return {
        "gpu": gpu,
        "lease_id": lid,
        "epoch": epoch,
        "state": state,
        "ts": ts,
        "rollout_mem_bytes": 0,
        "command_id": cid,
        "_record_ms": int(ts * 1000),
    }


def test_lease_intervals_open_close_and_still_open():
    states = [
        _ls("g", "g#1", "active", 10),
        _ls("g", "g#1", "revoking", 15),
        _ls("g", "g#1", "revoked", 15.2),
        _ls("g", "g#2", "active", 30, epoch=2),
        _ls("h", "h#1", "active", 5),
    ]
    iv = report.lease_intervals(states, t_end=40)
    assert iv["g"] == [(10, 15), (30, 40)]
    assert iv["h"] == [(5, 40)]


def test_slo_attainment_counts_windows_of_every_gpu_inside_the_run():
    obs = Observed()
    row = lambda ts, ttft, tpot: (ts, ttft, tpot, 100.0, 10.0, 0.5, 0, 1, 0, 0)  # noqa: E731
    obs.telemetry = {"a": [row(1, 50, 5), row(2, 150, 5), row(99, 500, 50)], "b": [row(1, 50, 11), row(2, 10, 1)]}
    s = report.slo_attainment(obs, t0=0, t_end=10, intervals={"a": [(1.5, 3)]})
    assert s["windows"] == 4 and s["overall"] == 0.5
    assert s["per_gpu"]["a"]["attainment"] == 0.5
    assert s["while_leased"] == 0.0 and s["windows_while_leased"] == 1


def test_revoke_latency_matches_lease_states_by_command_id():
    obs = Observed()
    obs.event_ms = {"ev1": 990}
    obs.commands = [
        {"kind": "grant", "command_id": "g1", "_record_ms": 500},
        {"kind": "revoke", "command_id": "r1", "cause_event_id": "ev1", "_record_ms": 1000},
    ]
    obs.lease_states = [_ls("g", "g#1", "revoking", 1.02, "r1"), _ls("g", "g#1", "revoked", 1.25, "r1")]
    rv = report.revoke_latency(obs)
    assert rv["revokes"] == 1 and rv["p50"] == 250 and rv["p99"] == 250
    assert rv["to_revoking_ms"]["p50"] == 20
    assert rv["telemetry_to_revoke_command_ms"]["p50"] == 10


def test_throughput_phases_and_sources():
    obs = Observed()
    obs.episodes = [{"finished_at": 1.0 + i * 0.1, "dedicated": True, "gpu": "rollout/0"} for i in range(10)] + [
        {"finished_at": 20.0 + i * 0.1, "dedicated": i % 2 == 0, "gpu": "sim/0"} for i in range(40)
    ]
    tp = report.throughput(obs, t0=0.0, t1=10.0, t_end=30.0)
    assert tp["dedicated_only"] == 60.0  # 10 episodes in 10 s
    assert tp["with_leases"] == 120.0  # 40 in 20 s
    assert tp["phase2_by_leased"] == 60.0 and tp["gain"] == 2.0


@given(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=200))
def test_p99_is_an_observed_value_at_or_above_99_percent_of_them(xs):
    v = percentile(xs, 0.99)
    assert v in xs
    assert sum(1 for x in xs if x <= v) >= 0.99 * len(xs)


def test_latency_window_holds_the_last_value_when_idle():
    w = LatencyWindow(lookback_s=2.0)
    for i in range(10):
        w.add(float(i) * 0.1, 10.0 + i)
    assert w.p99(1.0) == 19.0
    assert w.p99(100.0) == 19.0  # nothing in the lookback: no traffic does not look faster
    w.add(100.0, 3.0)
    assert w.p99(100.5) == 3.0


def test_calibrated_slo_and_scaled_lengths():
    spec = CoserveSpec(trace="x", slo_factor=3.0, min_slo_ttft_ms=20.0, min_slo_tpot_ms=10.0)
    assert calibrated_slo([10.0] * 50, [1.0] * 50, spec) == (30.0, 10.0)
    import numpy as np

    p, o = scaled_lengths(np.array([0, 1600, 10**6]), np.array([0, 80, 10**6]), spec)
    assert p.tolist() == [4, 100, spec.max_prompt] and o.tolist() == [2, 10, spec.max_output]


def _traj(actions, obs=(7, 7), versions=(1,), dedicated=False):
    return {
        "prompt": [1, 2, 3],
        "turns": [{"action": list(a), "observation": list(obs)} for a in actions],
        "versions": list(versions),
        "dedicated": dedicated,
    }


def test_reward_and_loss_mask():
    t = _traj([[ord("a"), ord("Z")], [ord("q"), 0]])
    assert reward(t) == 0.5
    toks, mask = sequence_and_mask(t)
    assert toks == [1, 2, 3, 97, 90, 7, 7, 113, 0, 7, 7]
    assert [x for x, m in zip(toks, mask) if m] == [97, 90, 113, 0]
    assert advantages([1.0, 0.0]) == [0.5, -0.5]
    assert staleness([_traj([[1]], versions=(3, 4)), _traj([[1]], versions=(-1, 5))], version=6) == 3


def test_demo_workers_get_the_stock_config_with_slots_cpus_and_the_weights_key():
    from rose.config import Config, SecurityConfig
    from rose.demo.executor_node import demo_worker_config
    from rose.executor.lease_machine import Start

    cfg = dataclasses.replace(Config(), security=SecurityConfig(weights_hmac_key="wk"))
    start = Start(gpu="real/0", lease_id="real/0#3", epoch=3, mem_bytes=1 << 30, compute_share=0.5, paused=False)
    wc = demo_worker_config(4, (1,))(cfg, start, "flag", "cpu", 1)
    assert wc.max_batch == 4 and wc.cpus == (1,) and wc.gpu == "real/0" and wc.pause_flag == "flag"
    assert wc.redis == cfg.redis and wc.weights_hmac_key == "wk"


def test_demo_hands_its_children_the_run_config_in_a_private_file(tmp_path, monkeypatch):
    import os

    from rose.config import Config, SecurityConfig, load_config
    from rose.demo.orchestrator import Demo, DemoOptions

    monkeypatch.setenv("ROSE_REDIS__KEY_PREFIX", "from-the-environment:")
    cfg = dataclasses.replace(Config(), security=SecurityConfig(weights_hmac_key="wk", command_hmac_key="ck"))
    d = Demo(cfg, DemoOptions(report_dir=str(tmp_path)))
    try:
        env = d._env()
        path = env["ROSE_CONFIG"]
        assert os.stat(path).st_mode & 0o777 == 0o600 and os.stat(d.config_dir).st_mode & 0o777 == 0o700
        assert not [k for k in env if k.startswith("ROSE_") and "__" in k]
        assert "wk" not in json.dumps(env)
        got = load_config(path, env={})
        assert got == d.cfg and got.security.weights_hmac_key == "wk"
        assert got.executor.worker_weights == "follow" and got.redis.key_prefix.startswith("rose:demo-")
        assert d._argv()["dedicated"].weights_hmac_key == "wk"
    finally:
        import shutil

        shutil.rmtree(d.config_dir, ignore_errors=True)


@pytest.mark.stack
def test_demo_end_to_end(stack, base_cfg, tmp_path):
    """A 40 s run: contract keys with sane values, a lease granted, weights published and applied,
    non-empty plots, nothing left running."""
    import psutil

    from rose.demo.orchestrator import DemoOptions, run_demo

    cfg = dataclasses.replace(
        base_cfg,
        kafka=dataclasses.replace(base_cfg.kafka, bootstrap=stack.kafka_bootstrap),
        redis=dataclasses.replace(base_cfg.redis, url=stack.redis_url),
    )
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    rep = run_demo(cfg, DemoOptions(duration_s=40, report_dir=str(tmp_path), live=False), echo=lambda s: None)
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["serving_slo_attainment"] == rep["serving_slo_attainment"]
    assert 0.0 <= rep["serving_slo_attainment"] <= 1.0
    assert rep["episodes_per_min"]["dedicated_only"] > 0
    assert rep["episodes_per_min"]["with_leases"] > 0
    assert set(rep["revoke_latency_ms"]) >= {"p50", "p99"}
    assert 0.0 < rep["weight_bytes_ratio"] <= 1.0
    assert rep["leases"]["grants"] >= 1
    assert rep["weights"]["versions_published"] >= 2
    assert rep["weights"]["max_version_in_trajectories"] >= 2  # a trained version reached rollout
    assert "real/0" in rep["slo"]["per_gpu"] and rep["slo"]["per_gpu"]["real/0"]["windows"] > 0
    for name in ("serving_p99.png", "throughput.png", "revoke_latency.png", "weight_bytes.png"):
        assert (tmp_path / name).stat().st_size > 10_000, name
    assert "serving SLO attainment" in (tmp_path / "report.md").read_text()
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not left, f"processes left running: {left}"
