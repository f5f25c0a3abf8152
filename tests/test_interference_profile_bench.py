"""The interference-profile part of the GPU check (rose.bench.interference_profile): its plan
and time on an H200, what it skips and why (no CUDA, no MPS daemon; MPS is only looked for),
the launch bound's config key, and the measurement itself on the CPU with the tiny shape: a
rollout process beside real decode steps, written as profiles the simulator reads."""

from __future__ import annotations

import os
import stat

import pytest

from rose.bench import interference_decode as idec
from rose.bench import interference_profile as ip
from rose.sim.interference import read_profile


def test_the_cuda_plan_measures_both_model_sizes_at_every_share_in_about_8_minutes():
    p = ip.plan(cuda=True, mps=None)
    assert set(p["shapes"]) == {"1b", "8b"} and p["shares"] == [0.1, 0.25, 0.5, 1.0]
    for name, s in p["shapes"].items():
        assert s["serving_steps_per_phase"] == 500, name
        assert [m for m, e in s["mechanisms"].items() if "skipped" not in e] == [
            "separate_process",
            "separate_process_bounded_launch",
        ]
    assert (p["shapes"]["1b"]["model"]["hidden"], p["shapes"]["8b"]["model"]["layers"]) == (2048, 32)
    assert 5 * 60 <= p["estimated_s"] <= 8.5 * 60
    assert p["goal"]["serving_p99_ratio_at_most"] == 1.05 and p["goal"]["rollout_fraction_at_least"] == 0.3
    with_mps = ip.plan(cuda=True, mps="/tmp/nvidia-mps")
    assert all("runs" in s["mechanisms"]["separate_process_mps"] for s in with_mps["shapes"].values())
    assert with_mps["estimated_s"] > p["estimated_s"]


def test_without_cuda_the_cuda_shapes_skip_and_without_mps_that_mechanism_does():
    p = ip.plan(cuda=False, mps=None)
    why = ip.skips(p)
    assert set(why) == {"1b", "8b"} and all("no CUDA GPU" in r for r in why.values())
    assert p["estimated_s"] == 0
    on_gpu = ip.skips(ip.plan(cuda=True, mps=None))
    assert set(on_gpu) == {"1b/separate_process_mps", "8b/separate_process_mps"}
    assert all("no MPS daemon" in r and "never started" in r for r in on_gpu.values())
    tiny = ip.plan(("tiny",), cuda=False, mps="/tmp/nvidia-mps")
    assert ip.skips(tiny) == {"tiny/separate_process_mps": "MPS is a CUDA mechanism"}


def test_mps_is_found_by_its_control_pipe_or_asked_only_whether_it_answers(tmp_path):
    pipe = tmp_path / "mps"
    pipe.mkdir()
    empty = tmp_path / "bin"
    empty.mkdir()
    assert ip.mps_daemon({"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "PATH": str(empty)}) is None
    (pipe / "control").touch()
    assert ip.mps_daemon({"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "PATH": str(empty)}) == str(pipe)
    # a control tool on PATH: it is asked one read-only question, nothing that sets or starts
    asked = tmp_path / "asked"
    tool = empty / "nvidia-cuda-mps-control"
    tool.write_text(f"#!/bin/sh\ncat >> {asked}\necho 100\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "none"), "PATH": f"{empty}:{os.environ['PATH']}"}
    assert ip.mps_daemon(env) == str(tmp_path / "none")
    assert asked.read_text().split() == ["get_default_active_thread_percentage"]


def test_the_launch_bound_is_the_bench_parameter_not_an_executor_setting():
    """No worker bounds its launches, so the executor offers no setting that claims one."""
    from rose.config import ConfigError, load_config

    assert ip.MAX_LAUNCH_US == 2000
    with pytest.raises(ConfigError, match="executor.max_launch_us: unknown setting"):
        load_config(env={"ROSE_EXECUTOR__MAX_LAUNCH_US": "500"})


def test_the_tiny_shape_on_the_cpu_writes_profiles_the_simulator_reads(tmp_path):
    mechs = ("separate_process", "separate_process_bounded_launch")
    bound = 1500  # not the default, so that the sizing shows it reached the rollout process
    r = ip.measure("tiny", "cpu", mechs, shares=(0.5, 1.0), steps=30, max_launch_us=bound, solo_s=0.3)
    assert r["device"] == "cpu" and r["serving_alone"]["n"] == 30
    sized = r["mechanisms"]["separate_process_bounded_launch"]["launch_sizing"]
    # what the run reports of its own launches agrees with the bound it was given
    assert sized["max_launch_us"] == bound
    assert sized["bound_met"] == (max(sized["decode_launch_us"], sized["prefill_launch_us"]) <= bound)
    assert r["mechanisms"]["separate_process"]["launch_sizing"] == {}
    files = ip.write_profiles(r, tmp_path)
    assert set(files) == set(mechs)
    for mech, path in files.items():
        m = r["mechanisms"][mech]
        assert m["rollout_tokens_per_s_solo"] > 0
        prof = read_profile(path)
        assert prof.mechanism == mech and "torch" in prof.source and "shape tiny" in prof.source
        assert [p.share for p in prof.points] == [0.5, 1.0]
        for p in prof.points:
            assert p.serving_p99_ratio > 0 and p.serving_mean_ratio > 0 and 0 <= p.rollout_fraction <= 1
        assert all(isinstance(ph["meets_goal"], bool) for ph in m["phases"].values())
    lines = ip.summary({"results": {"tiny": r}})
    assert set(lines) == {f"tiny/{m}" for m in mechs} and "goal" in lines["tiny/separate_process"]["0.5"]


@pytest.mark.cuda
def test_the_1b_shape_on_cuda_writes_a_profile(tmp_path):
    r = ip.measure("1b", "cuda", ("separate_process",), shares=(0.5,), steps=40, solo_s=1.0)
    assert r["gpu_name"]
    files = ip.write_profiles(r, tmp_path)
    prof = read_profile(files["separate_process"])
    assert prof.device == r["gpu_name"] and prof.points[0].rollout_fraction > 0


def test_launches_are_halved_until_one_fits_the_bound_or_stops_shortening():
    """The sizing rule on a known cost: 1 ms per row fits a 2.5 ms bound at 2 rows; a launch
    whose fixed cost dominates (10 ms + 0.01 ms per row) is left as it is, over the bound."""
    seen: list[int] = []

    def per_row(n: int) -> float:
        seen.append(n)
        return n * 1e-3

    assert idec._halve(64, per_row, 2.5e-3) == (2, 2e-3)
    assert seen == [64, 32, 16, 8, 4, 2]
    rows, t = idec._halve(64, lambda n: 10e-3 + n * 1e-5, 2.5e-3)
    assert rows == 64 and t > 2.5e-3
    assert idec._halve(8, per_row, 1.0) == (8, 8e-3)  # within the bound at once: nothing halved


def test_warm_up_decodes_a_whole_batch_to_its_full_context():
    """Every size the growing KV cache takes is allocated before a timed phase: a whole prefill
    and `context` decode steps of the whole batch (a short warm-up let the first timed phase
    pay for first allocations, on an H200 several times a warm step)."""
    from rose.bench._cuda import _Device

    d = ip.Decoder(ip.SHAPES["tiny"], _Device("cpu"), batch=3, seed=0)
    rows: list[tuple[int, int]] = []
    launch = d.launch
    d.launch = lambda ids, cache: (rows.append(tuple(ids.shape)), launch(ids, cache))[1]  # type: ignore[method-assign]
    ip.warm_up(d)
    shape = ip.SHAPES["tiny"]
    assert rows[0] == (3, shape.prompt) and rows[1:] == [(3, 1)] * shape.context
