"""`rose demo`: the report's arithmetic (pure: windows, their intervals, the measured device),
the trainer's loss inputs, the co-served device's latency windows, when tasks start, and one
short end-to-end run on the real stack."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rose.contract.records import Heartbeat
from rose.demo import report, report_files, windows
from rose.demo.coserve_device import CoserveSpec, LatencyWindow, latency_summary, scaled_lengths
from rose.demo.observed import ClaimClock, Observed
from rose.demo.run_setup import DemoOptions
from rose.demo.trainer import advantages, reward, sequence_and_mask, staleness
from rose.obs import stats
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


def _windows(*spans):
    return [{"start": a, "end": b, "leases": on} for a, b, on in spans]


def test_throughput_counts_each_episode_in_the_window_it_started_in():
    obs = Observed()
    # window 1 (off, 0-10 s): 10 dedicated episodes; window 2 (on, 10-20 s): 20, half leased; one of
    # them started at 9.5 s and finished in window 2: it counts for window 1
    obs.episodes = [
        {"task_id": f"a{i}", "finished_at": 1.0 + i * 0.5, "dedicated": True, "gpu": "rollout/0"} for i in range(9)
    ]
    obs.episodes += [{"task_id": "late", "finished_at": 11.0, "dedicated": True, "gpu": "rollout/0"}]
    obs.episodes += [
        {"task_id": f"b{i}", "finished_at": 10.5 + i * 0.4, "dedicated": i % 2 == 0, "gpu": "sim/0"} for i in range(20)
    ]
    obs.started = {"late": 9.5}
    tl = {
        "t0": 0.0,
        "t_end": 40.0,
        "windows": _windows((0, 10, False), (10, 20, True), (20, 30, False), (30, 40, True)),
    }
    tp = report.throughput(obs, tl, {"sim/0": [(12.0, 20.0)]})
    w = tp["windows"]
    assert [x["episodes"] for x in w] == [10, 20, 0, 0]
    assert w[0]["episodes_per_min"] == 60.0 and w[1]["episodes_per_min"] == 120.0
    assert w[1]["by_leased"] == 10 and w[1]["lease_gpu_seconds"] == 8.0 and w[1]["first_lease_after_s"] == 2.0
    assert w[0]["start_seen"] == 1
    assert tp["dedicated_only"] == 30.0 and tp["with_leases"] == 60.0  # means over two windows each
    lo, hi = tp["ci95_dedicated_only"]
    assert lo <= 30.0 <= hi and hi - lo == pytest.approx(2 * 12.706 * 30.0, abs=0.05)  # t(1) × s / √2, s = 30 √2
    assert tp["gain"] == 2.0 and tp["episodes_in_run"] == 30


def test_windows_alternate_off_first_in_equal_even_halves():
    p = windows.plan(180, 20)
    assert len(p) == 8 and [on for *_, on in p] == [False, True] * 4
    assert p[0][0] == 0 and p[-1][1] == 180 and all(b - a == pytest.approx(22.5) for a, b, _ in p)
    assert len(windows.plan(30, 20)) == 4  # at least two of each kind


@pytest.mark.parametrize(
    "df,t", [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (5, 2.571), (9, 2.262), (10, 2.228), (30, 2.042)]
)
def test_student_t_quantile_matches_the_tables(df, t):
    # two-sided 95 % critical values, NIST/SEMATECH e-Handbook of Statistical Methods, table 1.3.6.7.2
    assert stats.t_975(df) == pytest.approx(t, abs=5e-4)


@given(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=2, max_size=30))
def test_mean_ci95_holds_the_mean(xs):
    m, (lo, hi) = stats.mean_ci95(xs)
    assert lo <= m + 1e-9 and m <= hi + 1e-9
    assert stats.mean_ci95([5.0]) == (5.0, None) and stats.mean_ci95([]) == (None, None)


class _TaskStream:
    """The two reads ClaimClock makes of Redis, over an in-memory stream."""

    def __init__(self):
        self.entries: list[tuple[bytes, dict]] = []
        self.delivered = b"0-0"

    def xrange(self, name, min="-", count=None):
        lo = (0, 0) if min == "-" else tuple(map(int, min.lstrip("(").split("-")))
        strict = min.startswith("(")
        out = []
        for eid, f in self.entries:
            k = tuple(map(int, eid.decode().split("-")))
            if k > lo or (k == lo and not strict):
                out.append((eid, f))
        return out[:count]

    def xinfo_groups(self, name):
        return [{"name": b"rollout", "last-delivered-id": self.delivered}]


def test_claim_clock_stamps_a_task_when_the_group_has_handed_it_out():
    from rose.config import RedisConfig

    r = _TaskStream()
    clock = ClaimClock(r, RedisConfig(), "job")
    obs = Observed()
    r.entries = [(b"100-0", {b"task_id": b"ep-0"}), (b"100-1", {b"task_id": b"ep-1"})]
    r.delivered = b"100-0"
    clock.poll(obs, now=1.0)
    assert obs.started == {"ep-0": 1.0}
    r.entries.append((b"200-0", {b"task_id": b"ep-0"}))  # ep-0's continuation, same task
    r.delivered = b"200-0"
    clock.poll(obs, now=2.0)
    assert obs.started == {"ep-0": 1.0, "ep-1": 2.0}
    assert windows.started_at({"task_id": "ep-9", "finished_at": 3.0}, obs.started) == 3.0  # never seen waiting


def test_measured_device_splits_requests_of_the_run_by_lease():
    obs = Observed()
    rows = [[5.0, 10.0, 1.0, 0]] * 50 + [[6.0, 30.0, 3.0, 1]] * 50 + [[99.0, 999.0, 99.0, 1]]  # the last: after t_end
    obs.coserve = {"requests": json.dumps(rows), "slo_ttft_ms": "1000.0", "slo_tpot_ms": "100.0"}
    slo = {"per_gpu": {"real/0": {"attainment": 0.75}}}
    md = report.measured_device(obs, 0.0, 50.0, "real/0", slo)
    assert md["gpu"] == "real/0" and md["slo_attainment"] == 0.75
    assert md["p99_alone_ms"] == {"ttft": 10.0, "tpot": 1.0} and md["p99_leased_ms"] == {"ttft": 30.0, "tpot": 3.0}
    assert (
        md["requests_alone"] == 50 and md["requests_leased"] == 50 and md["slo_ms"] == {"ttft": 1000.0, "tpot": 100.0}
    )
    assert latency_summary([])["with_rollout"]["ttft_p99_ms"] is None


def test_the_measured_device_attainment_is_taken_per_kind_of_window():
    obs = Observed()
    row = lambda ts, ttft: (ts, ttft, 5.0, 100.0, 10.0, 0.5, 0, 1, 0, 0)  # noqa: E731
    # off windows 0-10 and 20-30: 3 of 4 rows within the SLO; on window 10-20: 1 of 2; 30+ outside every window
    obs.telemetry = {
        "real/0": [row(1, 50), row(5, 150), row(21, 50), row(29, 50), row(11, 50), row(19, 500), row(35, 500)],
        "sim/0": [row(12, 500)],
    }
    wins = _windows((0, 10, False), (10, 20, True), (20, 30, False))
    assert report.attainment_by_window_kind(obs, wins, "real/0") == {"dedicated_only": 0.75, "with_leases": 0.5}
    assert report.attainment_by_window_kind(obs, wins, "real/9") == {"dedicated_only": None, "with_leases": None}


def _core(idle, serving, rollout):
    return {"idle_s": idle, "serving_s": serving, "rollout_s": rollout, "counted_s": idle + serving + rollout}


def test_the_device_core_is_summed_per_kind_of_window_and_printed_beside_it():
    wins = [
        {**w, "core": c}
        for w, c in zip(
            _windows((0, 10, False), (10, 20, True), (20, 30, False), (30, 40, True)),
            [_core(6.0, 4.0, 0.0), _core(1.0, 4.0, 5.0), _core(5.0, 5.0, 0.0), _core(2.0, 3.0, 5.0)],
        )
    ]
    core = report.core_by_window_kind(wins)
    assert core == {
        "dedicated_only": {"idle_s": 11.0, "serving_s": 9.0, "rollout_s": 0.0, "counted_s": 20.0, "windows": 2},
        "with_leases": {"idle_s": 3.0, "serving_s": 7.0, "rollout_s": 10.0, "counted_s": 20.0, "windows": 2},
    }
    assert report.core_by_window_kind(_windows((0, 10, False), (10, 20, True))) is None  # no core sampled
    rows = report_files._core_rows(core)
    assert "| device core idle (idle + iowait), core-s | 11.0 | 3.0 |" in rows
    assert "| device core rollout (nice: the leased workers), core-s | 0.0 | 10.0 |" in rows
    assert report_files._core_rows(None) == ["| device core | not sampled (no CPU core of its own) | |"]
    assert (report_files._yes(True), report_files._yes(False), report_files._yes(None)) == ("yes", "no", "n/a")


def _promise_report(by_window, ci_on, off_mean, core):
    md = {"gpu": "real/0", "slo_attainment_by_window": by_window, "core": core}
    episodes = {"dedicated_only": off_mean, "with_leases": None, "ci95_with_leases": ci_on}
    return {"measured_device": md, "promise": report.promise(md, episodes)}


def test_the_promise_holds_when_serving_keeps_its_slo_and_leases_add_episodes():
    core = {"dedicated_only": _core(11.0, 9.0, 0.0), "with_leases": _core(3.0, 7.0, 10.0)}
    rep = _promise_report({"dedicated_only": 0.95, "with_leases": 0.94}, [30.0, 40.0], 25.0, core)
    p = rep["promise"]
    assert p["measured_slo_with_leases_within_0_01"] and p["episodes_ci95_above_leases_off_mean"] and p["held"]
    lines = "\n".join(report_files._promise_lines(rep))
    assert "| both | yes |" in lines and "Not held" not in lines
    assert "(0.9400 against 0.9500) | yes |" in lines and "([30.0, 40.0] against 25.0) | yes |" in lines


def test_the_promise_fails_on_either_half_and_then_shows_the_idle_time_left():
    core = {"dedicated_only": _core(11.0, 9.0, 0.0), "with_leases": _core(3.5, 7.0, 9.5)}
    # serving lost 0.02 of attainment under leases: not within 0.01
    rep = _promise_report({"dedicated_only": 0.95, "with_leases": 0.93}, [30.0, 40.0], 25.0, core)
    p = rep["promise"]
    assert not p["measured_slo_with_leases_within_0_01"] and p["episodes_ci95_above_leases_off_mean"]
    assert not p["held"] and p["core_idle_s_with_leases"] == 3.5 and p["core_rollout_s_with_leases"] == 9.5
    lines = "\n".join(report_files._promise_lines(rep))
    assert "| both | no |" in lines
    assert (
        "device core was idle for 3.5 core-s of 20.0 core-s, and the leased workers took 9.5 core-s: "
        "the idle time is what the leases left unharvested" in lines
    )
    # a core serving kept busy (idle under 5 % of the time) had next to nothing to harvest
    busy = {"dedicated_only": _core(0.0, 20.0, 0.0), "with_leases": _core(0.5, 19.0, 0.5)}
    rep = _promise_report({"dedicated_only": 0.0, "with_leases": 0.0}, [10.0, 40.0], 25.0, busy)
    assert "idle for 0.5 core-s of 20.0 core-s" in "\n".join(report_files._promise_lines(rep))
    assert "serving kept the core busy" in "\n".join(report_files._promise_lines(rep))
    # little idle left because the leases took it
    took = {"dedicated_only": _core(11.0, 9.0, 0.0), "with_leases": _core(0.5, 9.0, 10.5)}
    rep = _promise_report({"dedicated_only": 1.0, "with_leases": 0.98}, [10.0, 40.0], 25.0, took)
    assert "the leases took nearly all the time serving left" in "\n".join(report_files._promise_lines(rep))
    # no lease ran on the measured device: its halves differ by load alone, so serving's half is untested
    p = report.promise(rep["measured_device"], {"dedicated_only": 30.0, "ci95_with_leases": [31.0, 40.0]}, 0.0)
    assert p["measured_slo_with_leases_within_0_01"] is None and p["episodes_ci95_above_leases_off_mean"]
    assert not p["held"]
    rows = "\n".join(report_files._promise_lines({"measured_device": rep["measured_device"], "promise": p}))
    assert "(0.9800 against 1.0000) | untested: no lease ran on it |" in rows
    # the interval with leases reaches down to the leases-off mean: not above it
    p = report.promise(rep["measured_device"], {"dedicated_only": 30.0, "ci95_with_leases": [30.0, 40.0]})
    assert not p["episodes_ci95_above_leases_off_mean"] and not p["held"]
    # no interval (fewer than two windows) or no attainment: not shown to hold
    md = {"slo_attainment_by_window": {"dedicated_only": None, "with_leases": 1.0}}
    p = report.promise(md, {"dedicated_only": 30.0, "ci95_with_leases": None})
    assert p == {**p, "measured_slo_with_leases_within_0_01": False, "episodes_ci95_above_leases_off_mean": False}
    lines = "\n".join(report_files._promise_lines({"measured_device": {"gpu": "real/0", **md}, "promise": p}))
    assert "not sampled" in lines and "its idle time is not known" in lines


def test_report_builds_and_prints_from_a_small_run():
    obs = Observed()
    row = lambda ts: (ts, 50.0, 5.0, 1000.0, 100.0, 0.5, 0, 1, 0, 0)  # noqa: E731
    obs.telemetry = {"sim/0": [row(t) for t in range(40)], "real/0": [row(t) for t in range(40)]}
    obs.episodes = [
        {"task_id": f"e{i}", "finished_at": i * 0.25, "dedicated": i % 3 > 0, "gpu": "rollout/0", "v_max": 1}
        for i in range(160)
    ]
    obs.versions = [{"version": 1, "keyframe": True, "bytes_sent": 100, "bytes_full": 100, "reward_mean": None}]
    obs.trainer = {"lr": "0.003", "master_dtype": "float32", "publish_dtype": "bfloat16"}
    obs.coserve = {"requests": json.dumps([[1.0, 10.0, 1.0, 0], [30.0, 20.0, 2.0, 1]]), "slo_ttft_ms": "1000.0"}
    obs.lease_states = [_ls("real/0", "real/0#1", "active", 29.0), _ls("real/0", "real/0#1", "revoked", 31.0)]
    tl = {
        "t0": 0.0,
        "t_end": 40.0,
        "windows": _windows((0, 10, False), (10, 20, True), (20, 30, False), (30, 40, True)),
    }
    meta = {
        "run_id": "x",
        "host": {"cpus": 2, "cuda": False},
        "trace": "t.csv",
        "speed": 0.5,
        "real_replicas": 4,
        "gpus": 1,
        "real_gpu": "real/0",
        "real_device": "cpu",
        "problems": [],
        "interference": {"profile": "p.json", "mechanism": "separate_process", "source": "bench"},
    }
    rep = report.build(obs, tl, meta)
    assert rep["trainer_lr"] == 0.003 and rep["measured_device"]["p99_leased_ms"]["ttft"] == 20.0
    assert set(rep["episodes_per_min"]) == {"dedicated_only", "with_leases", "ci95_dedicated_only", "ci95_with_leases"}
    md = report_files.markdown({**rep, "plots": []})
    assert "leases on (mean of 2 windows, 95 % CI)" in md and "trainer lr 0.003" in md and "rose bench weights" in md
    assert rep["engine"] == {"name": None, "version": None, "device": None} and rep["rl"]["reward_by_step"] == []
    assert rep["measured_device"]["slo_attainment_by_window"] == {"dedicated_only": 1.0, "with_leases": 1.0}
    assert rep["measured_device"]["core"] is None and rep["promise"]["measured_slo_with_leases_within_0_01"]
    assert rep["promise"]["measured_device_lease_s"] == 2.0 == rep["leases"]["lease_seconds_by_gpu"]["real/0"]
    assert "## Serving's SLO and the device core, leases off against on" in md
    assert "default interference profile (`p.json`, mechanism separate_process: bench)" in md
    assert "at its recorded rate as one of 4 replicas: 1/4 of its requests)" in md


def _steps(rewards):
    return [{"version": i + 2, "t_s": 10.0 * i, "reward_mean": r, "batch": 16} for i, r in enumerate(rewards)]


def test_learning_is_shown_only_by_thirds_whose_intervals_part_from_a_start_in_the_band():
    rising = report.learning(_steps([0.2, 0.25, 0.2, 0.3, 0.45, 0.5, 0.55, 0.5, 0.6]))
    assert rising["steps_per_third"] == 3 and rising["step_s"] == 10.0
    assert rising["first_third"]["mean"] == 0.2167 and rising["last_third"]["mean"] == 0.55
    assert rising["learned"] and rising["start_in_band"] and rising["held"]
    # the same rise from a start below the band: learned, but the start leaves groups no variance
    low = report.learning(_steps([0.0, 0.05, 0.02, 0.3, 0.45, 0.5, 0.55, 0.5, 0.6]))
    assert low["learned"] and not low["start_in_band"] and not low["held"]
    # a noisy rise whose intervals overlap is not learning
    noisy = report.learning(_steps([0.0, 0.5, 0.1, 0.2, 0.3, 0.2, 0.1, 0.6, 0.3]))
    assert noisy["last_third"]["mean"] > noisy["first_third"]["mean"] and not noisy["learned"]
    # fewer than two steps a third: no interval, nothing shown
    few = report.learning(_steps([0.1, 0.2, 0.9, 0.9, 0.9]))
    assert few["first_third"]["ci95"] is None and not few["held"]
    lines = "\n".join(report_files._learning_lines(few))
    assert "5 steps are too few for an interval over a third" in lines and "one every 10.0 s" in lines
    assert report.learning([])["steps"] == 0 and report_files._learning_lines({"steps": 0}) == [
        "No training step in the run."
    ]
    assert "What holds it back: the intervals overlap" in "\n".join(report_files._learning_lines(noisy))
    assert "What holds it back" not in "\n".join(report_files._learning_lines(rising))


@given(st.lists(st.floats(0.0, 1.0), min_size=0, max_size=40))
def test_learning_claims_a_rise_only_where_the_last_third_is_higher(rewards):
    g = report.learning(_steps(rewards))
    assert g["steps"] == len(rewards) and g["steps_per_third"] == len(rewards) // 3
    if g["learned"]:
        assert g["last_third"]["ci95"][0] > g["first_third"]["ci95"][1]
        assert g["last_third"]["mean"] > g["first_third"]["mean"]
    assert g["held"] == (g["learned"] and g["start_in_band"])


def test_report_names_the_engine_and_shows_samples_and_reward_by_step():
    obs = Observed()
    obs.workers = {"w1": Heartbeat("w1", "running", 0.0, engine="vllm", engine_library="0.32.0", device="cpu")}
    obs.versions = [
        {"version": 1, "reward_mean": None, "ts": 100.0},
        {"version": 2, "reward_mean": 0.0, "ts": 110.0, "batch": 16},
        {"version": 3, "reward_mean": 0.25, "ts": 125.0, "batch": 16},
    ]
    sample = {"question": "What is 12 + 30?", "answer": "42|x", "reward": 1.0, "version": 2, "gpu": "sim/0"}
    obs.trainer = {"task": "addition", "group": "8", "samples": json.dumps([sample]), "trained": json.dumps({})}
    r = report.rl(obs, t0=100.0)
    assert r["reward_by_step"] == [
        {"version": 2, "t_s": 10.0, "reward_mean": 0.0, "batch": 16},
        {"version": 3, "t_s": 25.0, "reward_mean": 0.25, "batch": 16},
    ]
    assert r["samples"] == [sample] and r["group"] == 8
    assert report.engine(obs, {}) == {"name": "vllm", "version": "0.32.0", "device": "cpu"}
    meta = {"rollout": {"engine": "vllm", "engine_version": "0.32", "device": "cpu"}}
    assert report.engine(Observed(), meta)["name"] == "vllm"  # no heartbeat left: the run's configuration
    lines = "\n".join(report_files._rl_lines({"engine": report.engine(obs, {}), "model": "m", "rl": r}))
    assert "Engine `vllm` 0.32.0 on `cpu`" in lines and "`42\\|x`" in lines and "What is 12 + 30?" in lines


def test_math_task_reward_and_group_advantages():
    import random

    from rose.rollout import addition_task as mt

    p = mt.Problem(47, 38)
    assert p.question == "What is 47 + 38?" and p.answer == 85
    assert mt.reward("85", p) == 1.0 and mt.reward(" 85.\nuser", p) == 1.0
    assert mt.reward("47 + 38 = 85", p) == 0.0 and mt.reward("eighty-five", p) == 0.0
    assert mt.first_int("x -3 4") == -3 and mt.first_int("") is None
    assert mt.group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0] and mt.group_advantages([1.0]) == [0.0]
    a = mt.group_advantages([1.0, 0.0, 0.0, 0.0])
    assert a[0] > 0 > a[1] and abs(sum(a)) < 1e-9
    rng = random.Random(0)
    for task in mt.TASKS:
        assert all(task.lo <= x <= task.hi for _ in range(100) for x in dataclasses.astuple(mt.problem(rng, task)))
        m = mt.messages(p, task)
        assert m[0]["role"] == "system" and m[-1] == {"role": "user", "content": "What is 47 + 38?"}
        assert [x["content"] for x in m[1:-1]] == [t for e in task.examples for t in (e.question, str(e.answer))]
    assert {x for _ in range(200) for x in dataclasses.astuple(mt.problem(rng))} == set(range(1, 10))  # the demo's


def test_hf_trainer_trains_the_last_layers_and_the_final_norm():
    from rose.demo.hf_trainer import trainable

    names = [f"model.layers.{i}.mlp.weight" for i in range(4)] + ["model.norm.weight", "model.embed_tokens.weight"]
    assert trainable(names, 4, 1) == {"model.layers.3.mlp.weight", "model.norm.weight"}
    assert trainable(names, 4, 2) == {"model.layers.2.mlp.weight", "model.layers.3.mlp.weight", "model.norm.weight"}


def test_the_trainers_step_on_a_checkpoint_moves_only_the_last_layer_toward_the_rewarded_sample(tiny_checkpoint):
    """`reinforce_step` as the HF trainer and `rose bench learning` take it, on a real (tiny)
    transformers checkpoint: the frozen parameters stay bit-equal, the rewarded sequence's action
    tokens gain log-probability and the unrewarded one's lose it; a batch whose advantages are all
    0 takes no step."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    from rose.rollout import addition_task as mt

    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32)
    trained, params = mt.trainable_parameters(model, 1)
    n_layers = int(model.config.num_hidden_layers)
    assert trained and all(n.startswith((f"model.layers.{n_layers - 1}.", "model.norm.")) for n in trained)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.Adam(params, lr=1e-2)
    good, bad = [5, 6, 7, 8, 9], [5, 6, 7, 10, 11]  # a shared prompt, then two different answers
    mask = [False, False, False, True, True]
    seqs = [(good, mask), (bad, mask)]

    def answer_logp(s: list[int]) -> float:
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([s])).logits[0, :-1].float(), -1)
        return float(sum(logp[i - 1, s[i]] for i in range(3, len(s))))

    assert mt.reinforce_step(model, opt, seqs, [0.0, 0.0], pad=0) == 0.0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    g0, b0 = answer_logp(good), answer_logp(bad)
    for _ in range(3):
        mt.reinforce_step(model, opt, seqs, mt.group_advantages([1.0, 0.0]), pad=0)
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], before[n]) for n in before if n not in trained)
    assert any(not torch.equal(after[n], before[n]) for n in trained)
    assert answer_logp(good) > g0 and answer_logp(bad) < b0


def test_demo_with_a_checkpoint_engine_configures_rollout_and_the_trainer(tmp_path):
    from rose.config import Config
    from rose.demo.run_setup import DemoSetup
    from rose.demo.trainer import TrainerSpec

    d = DemoSetup(Config(), DemoOptions(engine="vllm", model=str(tmp_path), max_batch=8))
    ro = d.cfg.rollout
    assert (ro.engine, ro.model, ro.dtype, ro.max_model_len) == ("vllm", str(tmp_path.resolve()), "native", 512)
    spec = TrainerSpec.from_json(d._trainer_spec().to_json())
    assert (spec.engine, spec.checkpoint, spec.max_turns, spec.obs_tokens) == ("vllm", ro.model, 1, 0)
    assert 12 <= spec.tokens_per_turn <= 16 and spec.group > 1
    ref = DemoSetup(Config(), DemoOptions())
    assert ref.cfg.rollout == Config().rollout and ref._trainer_spec().engine == "reference"


def test_demo_cli_refuses_an_engine_without_a_checkpoint(tmp_path):
    from typer.testing import CliRunner

    from rose.cli import app

    run = CliRunner().invoke
    r = run(app, ["demo", "--engine", "vllm"])
    assert r.exit_code == 2 and "--model" in r.output
    r = run(app, ["demo", "--engine", "vllm", "--model", str(tmp_path)])
    assert r.exit_code == 2 and "no config.json" in r.output
    r = run(app, ["demo", "--engine", "tgi", "--model", str(tmp_path)])
    assert r.exit_code == 2 and "--engine" in r.output
    r = run(app, ["demo", "--real-replicas", "0"])
    assert r.exit_code == 2 and "--real-replicas" in r.output


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


def test_scaled_lengths():
    spec = CoserveSpec(trace="x")
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
    assert not wc.sched_idle
    idle = dataclasses.replace(cfg, executor=dataclasses.replace(cfg.executor, worker_sched_idle=True))
    assert demo_worker_config(4, (1,))(idle, start, "flag", "cpu", 1).sched_idle


def test_demo_hands_its_children_the_run_config_in_a_private_file(tmp_path, monkeypatch):
    import os

    from rose.config import Config, SecurityConfig, load_config
    from rose.demo.orchestrator import Demo, DemoOptions

    monkeypatch.setenv("ROSE_REDIS__KEY_PREFIX", "from-the-environment:")
    cfg = dataclasses.replace(Config(), security=SecurityConfig(weights_hmac_key="wk", command_hmac_key="ck"))
    d = Demo(cfg, DemoOptions(report_dir=str(tmp_path), real_replicas=6))
    try:
        env = d._env()
        path = env["ROSE_CONFIG"]
        assert os.stat(path).st_mode & 0o777 == 0o600 and os.stat(d.config_dir).st_mode & 0o777 == 0o700
        assert not [k for k in env if k.startswith("ROSE_") and "__" in k]
        assert "wk" not in json.dumps(env)
        got = load_config(path, env={})
        assert got == d.cfg and got.security.weights_hmac_key == "wk"
        assert got.executor.worker_weights == "follow" and got.redis.key_prefix.startswith("rose:demo-")
        from rose.sim.interference import DEFAULT_PROFILE_PATH

        # the modelled GPUs slow down by the simulator's default profile; the scheduler has no prior
        assert got.telemetry.interference_profile == str(DEFAULT_PROFILE_PATH)
        assert got.policy.interference_profile == ()
        assert d.interference["mechanism"] == "separate_process" and d.interference["source"]
        argv = d._argv()
        assert argv["dedicated"].weights_hmac_key == "wk"
        # on the device's own core the leased workers run under SCHED_IDLE; the trace-driven GPUs' never
        assert ("--worker-sched-idle" in argv["executor-real"]) == bool(d.device_cpus)
        assert "--worker-sched-idle" not in argv["executor-sim"]
        spec = json.loads(argv["coserve"][argv["coserve"].index("--spec") + 1])
        assert spec["replicas"] == 6 and spec["speed"] == 1.0  # real/0: one replica's share, at the recorded rate
    finally:
        import shutil

        shutil.rmtree(d.config_dir, ignore_errors=True)


@pytest.mark.stack
def test_demo_end_to_end(stack, base_cfg, tmp_path):
    """An 80 s run (four 20 s windows, leases off / on / off / on): contract keys with sane values,
    leased workers producing in the leases-on windows, each mean and interval those of its
    windows, the measured device reported, weights published and applied, non-empty plots, nothing left
    running."""
    import psutil

    from rose.demo.orchestrator import DemoOptions, run_demo

    cfg = dataclasses.replace(
        base_cfg,
        kafka=dataclasses.replace(base_cfg.kafka, bootstrap=stack.kafka_bootstrap),
        redis=dataclasses.replace(base_cfg.redis, url=stack.redis_url),
    )
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    cpus = os.sched_getaffinity(0)
    rep = run_demo(cfg, DemoOptions(duration_s=80, report_dir=str(tmp_path), live=False), echo=lambda s: None)
    # the run keeps itself off the device's core while it runs, and gives this process its CPUs back
    assert os.sched_getaffinity(0) == cpus and all(
        os.sched_getaffinity(int(t)) == cpus for t in os.listdir("/proc/self/task")
    )
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["serving_slo_attainment"] == rep["serving_slo_attainment"]
    assert 0.0 <= rep["serving_slo_attainment"] <= 1.0
    epm = rep["episodes_per_min"]
    assert [w["leases"] for w in rep["throughput"]["windows"]] == [False, True, False, True]
    assert epm["dedicated_only"] > 0
    # the loose regression guards: leased workers run in the leases-on windows, and leases do not
    # cost the run its throughput. Not "with leases above dedicated only": on a CPU host every
    # rollout worker shares one core (the other is the measured device's), so a leased worker's
    # episodes come out of the dedicated worker's; on GPUs a lease brings its own compute.
    on = [w for w in rep["throughput"]["windows"] if w["leases"]]
    assert sum(w["by_leased"] for w in on) > 0, on
    assert epm["with_leases"] >= 0.7 * epm["dedicated_only"], epm
    # each kind's mean and 95 % interval are those of its own windows as listed (the windows' rates are
    # rounded to 0.01: with two windows per kind, t(1) = 12.7 scales that to at most 0.07 on the interval)
    for kind, leases_on in (("dedicated_only", False), ("with_leases", True)):
        rows = [w for w in rep["throughput"]["windows"] if w["leases"] is leases_on]
        rates = [w["episodes_per_min"] for w in rows if w["episodes_per_min"] is not None]
        mean, ci = stats.mean_ci95(rates)
        assert epm[kind] == pytest.approx(mean, abs=0.01) and epm[f"ci95_{kind}"] == pytest.approx(ci, abs=0.07), (
            kind,
            rates,
            epm,
        )
    md = rep["measured_device"]
    assert md["gpu"] == "real/0" and 0.0 <= md["slo_attainment"] <= 1.0
    assert set(md) >= {"p99_alone_ms", "p99_leased_ms"} and md["p99_alone_ms"]["ttft"] > 0
    assert md["slo_ms"] == {"ttft": cfg.telemetry.slo_ttft_ms, "tpot": cfg.telemetry.slo_tpot_ms}  # configured
    assert set(rep["revoke_latency_ms"]) >= {"p50", "p99"}
    assert 0.0 < rep["weight_bytes_ratio"] <= 1.0
    assert rep["trainer_lr"] > 0 and rep["weights"]["master_dtype"] == "float32"
    assert rep["weights"]["publish_dtype"] == "bfloat16"
    assert rep["leases"]["grants"] >= 1
    assert rep["weights"]["versions_published"] >= 2
    assert rep["weights"]["max_version_in_trajectories"] >= 2  # a trained version reached rollout
    assert "real/0" in rep["slo"]["per_gpu"] and rep["slo"]["per_gpu"]["real/0"]["windows"] > 0
    assert rep["engine"]["name"] == "reference" and rep["rl"]["reward_by_step"]
    for name in ("serving_p99.png", "throughput.png", "revoke_latency.png", "weight_bytes.png", "reward.png"):
        assert (tmp_path / name).stat().st_size > 10_000, name
    assert "serving SLO attainment" in (tmp_path / "report.md").read_text()
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not left, f"processes left running: {left}"


def test_live_view_shows_the_share_a_throttle_set():
    """A lease throttled to 0 shows paused with share 0; throttled back up to a smaller share, it
    shows that share, not its grant's."""
    from rose.demo.live_view import snapshot

    obs = Observed()
    obs.telemetry["sim/0"] = [(10.0, 100.0, 20.0, 500.0, 50.0, 0.4, 0, 0, 0, 10_000)]

    def command(kind, share, ts):
        obs.commands.append({"kind": kind, "lease_id": "sim/0#1", "gpu": "sim/0", "compute_share": share, "ts": ts})

    def share_and_state(state, ts):
        obs.lease_states.append(_ls("sim/0", "sim/0#1", state, ts))
        row = snapshot(obs, "run", 5.0, 60.0, ts, real_gpu="")["gpus"][0]
        return row["share"], row["state"]

    command("grant", 0.5, 1.0)
    assert share_and_state("active", 1.0) == (0.5, "active")
    command("throttle", 0.0, 2.0)
    assert share_and_state("paused", 2.0) == (0.0, "paused")
    command("throttle", 0.25, 3.0)
    assert share_and_state("active", 3.0) == (0.25, "active")
