"""The GPU check (deploy/gpu-check.sh, rose.bench._gpu_check) and its CUDA measurements
(rose.bench._cuda): the plan and the skips on a machine without a GPU, the packages each part
declares are all it needs beside torch, and the measurement logic on the CPU; on a GPU, the
interference bench's result calibrates the simulator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from rose.bench import _cuda, _gpu_check
from rose.sim.engine import calibration

TINY = _cuda.Shape(d_model=32, d_ff=64, layers=2, serving_batch=2, rollout_batch=4, rollout_burst=2)


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(_gpu_check.REPO / "deploy" / "gpu-check.sh"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable},  # the interpreter with the project's packages
    )


def test_dry_run_writes_the_plan_and_runs_nothing(tmp_path):
    p = _check(str(tmp_path / "out"), "--dry-run")
    assert p.returncode == 0, p.stderr
    plan = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert plan["dry_run"] is True and plan["environment"]["torch"] != "imported"
    assert set(plan["parts"]) == {
        "cuda-tests",
        "interference",
        "interference-profile",
        "pause",
        "weights",
        "nvml-agent",
    }
    for name, part in plan["parts"].items():
        assert part["needs"][0] == "torch" and "status" not in part, name
        assert part["would_run"] == (not part["missing"]), name
    assert "revoke-kafka" in plan["not_run"]
    ifp = plan["parts"]["interference-profile"]["plan"]  # the GPU machine's plan, MPS looked for
    assert set(ifp["shapes"]) == {"1b", "8b"} and ifp["shares"] == [0.1, 0.25, 0.5, 1.0]
    assert "estimated" in p.stderr and "8b: 32 layers" in p.stderr
    assert _gpu_check.cuda_test_files() and all(f.startswith("tests/") for f in _gpu_check.cuda_test_files())


def test_bad_part_is_one_line(tmp_path):
    p = _check(str(tmp_path), "--only", "nope")
    assert p.returncode == 2 and "--only" in p.stderr and "Traceback" not in p.stderr


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_has_cuda(), reason="checks the skips of a machine without a GPU")
def test_without_a_gpu_nothing_is_measured_and_the_check_fails_in_one_line(tmp_path):
    p = _check(str(tmp_path))
    assert p.returncode == _gpu_check.NOTHING_MEASURED != 0, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: nothing was measured (no CUDA GPU"), p.stderr
    s = json.loads((tmp_path / "gpu-check.json").read_text())
    assert s["environment"]["cuda_available"] is False and s["measured"] == []
    assert all(e["status"] == "skipped" and "CUDA" in e["reason"] for e in s["parts"].values())


@pytest.mark.skipif(_has_cuda(), reason="on a GPU the CUDA tests run")
def test_cuda_tests_all_skipped_are_not_reported_as_passed(tmp_path):
    """The cuda-tests part run for real on a machine without a GPU: every test skips, and the
    part says skipped with the counts from its junit xml, never ok."""
    r = _gpu_check.run_cuda_tests(tmp_path, full=False)
    assert r["tests"] == r["skipped"] > 0
    assert (r["passed"], r["failed"], r["status"]) == (0, 0, "skipped"), r
    assert r["reason"] == f"no CUDA test passed ({r['skipped']} skipped)"


def test_junit_counts_tell_passed_skipped_and_failed_apart(tmp_path):
    """A real pytest run's junit xml with one test of each outcome (and an error in setup)."""
    (tmp_path / "test_mixed.py").write_text(
        textwrap.dedent("""
            import pytest

            @pytest.fixture
            def broken():
                raise RuntimeError("setup")

            def test_passes():
                pass

            def test_fails():
                assert False

            @pytest.mark.skip(reason="skipped")
            def test_skipped():
                pass

            def test_errors(broken):
                pass
        """)
    )
    xml = tmp_path / "out.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path), f"--junitxml={xml}"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    counts = _gpu_check.junit_counts(xml)
    assert counts == {"tests": 4, "passed": 1, "skipped": 1, "failed": 2}
    assert _gpu_check.tests_status(p.returncode, counts) == "failed"
    assert _gpu_check.tests_status(0, {"tests": 2, "passed": 0, "skipped": 2, "failed": 0}) == "skipped"
    assert _gpu_check.tests_status(0, {"tests": 2, "passed": 1, "skipped": 1, "failed": 0}) == "ok"
    assert _gpu_check.tests_status(0, {}) == "failed"  # no readable xml: the run broke


def test_wheels_are_unpacked_onto_the_path(tmp_path):
    import zipfile

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "carried-1.0-py3-none-any.whl", "w") as z:
        z.writestr("carried_mod/__init__.py", "VALUE = 7\n")
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from rose.bench import _gpu_check
        print(_gpu_check.add_wheels(Path({str(wheels)!r}), Path({str(tmp_path / "site")!r})))
        import carried_mod
        print(carried_mod.VALUE)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=_gpu_check.REPO)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["['carried-1.0-py3-none-any.whl']", "7"]


@pytest.mark.parametrize(
    "name", ["cuda-tests", "interference", "interference-profile", "pause", "weights", "nvml-agent"]
)
def test_each_part_needs_only_torch_and_its_declared_packages(name):
    """In a process where every third-party module but PRESENT (torch, transformers and their
    requirements) and the part's declared packages fails to import, the part's modules import."""
    part = next(p for p in _gpu_check.parts() if p.name == name)
    allowed = sorted({*_gpu_check.PRESENT, *part.packages})
    code = textwrap.dedent(f"""
        import importlib, importlib.abc, importlib.util, sys
        allowed = set({allowed!r}) | set(sys.stdlib_module_names) | set(sys.builtin_module_names)

        def absent(fullname):
            top = fullname.split(".")[0]
            return not (top in allowed or top in ("rose", "tests") or top.startswith("_"))

        class Only(importlib.abc.MetaPathFinder):
            def find_spec(self, fullname, path, target=None):
                if absent(fullname):
                    raise ModuleNotFoundError(f"not on the GPU machine: {{fullname}}", name=fullname.split(".")[0])
                return None

        # an optional-dependency probe (importlib.util.find_spec, as transformers makes for accelerate)
        # sees such a module as not installed, as it would on the GPU machine, instead of an error
        probe = importlib.util.find_spec
        importlib.util.find_spec = lambda name, package=None: None if absent(name) else probe(name, package)
        sys.meta_path.insert(0, Only())
        for m in {list(part.modules)!r}:
            importlib.import_module(m)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=_gpu_check.REPO)
    assert p.returncode == 0, p.stderr[-2000:]


def test_alpha_fit_is_the_least_squares_slope_through_the_origin():
    assert _cuda.fit_alpha([(0.25, 1.05), (0.5, 1.1), (1.0, 1.2)]) == pytest.approx(0.2)
    assert _cuda.fit_alpha([(0.5, 0.9)]) == 0.0  # faster beside rollout: no negative slowdown
    assert _cuda.fit_alpha([]) is None


def test_measurements_run_on_the_cpu_and_calibrate_the_simulator():
    r = _cuda.interference("cpu", shape=TINY, steps=20, shares=(0.5, 1.0), processes=False)
    assert set(r["phases"]) == {"alone", "low_priority_share_0.5", "low_priority_share_1", "same_priority_share_1"}
    for k, ph in r["phases"].items():
        assert ph["n"] == 20 and ph["p99_ms"] > 0, k
    assert r["alpha_per_share"] is not None and r["alpha_per_share"] >= 0
    assert r["unprotected_p99_over_alone"] == r["phases"]["same_priority_share_1"]["p99_over_alone"]
    cal = calibration({**r, "_source": "x.json"}, None)
    assert cal["alpha"] == pytest.approx(r["alpha_per_share"]) and "priority streams" in cal["alpha_source"]
    lat = _cuda.pause_latency("cpu", shape=TINY, n=3)
    assert lat["n"] == 3 and lat["p99_ms"] >= 0


def test_codec_on_a_device_reproduces_the_target_and_reports_against_memcpy():
    r = _cuda.codec_on_device("cpu", params=1_000_000)  # raises if apply does not give the target bytes
    assert r["bytes"] == 2_000_000 and 0 < r["changed_fraction"] < 0.2
    assert 0 < r["bytes_ratio_per_step"] < 0.05
    assert r["encode_ms"] > r["encode_scan_ms"] * 0.5 > 0 and r["apply_ms"] > 0
    assert r["encode_over_device_memcpy"] > 0 and r["goal_over_memcpy"] == 0.5


@pytest.mark.cuda
def test_cuda_interference_bench_gives_a_calibration_file(tmp_path):
    r = _cuda.interference("cuda", quick=True, steps=50, processes=False)
    assert r["device"] == "cuda" and r["gpu_name"]
    assert r["phases"]["low_priority_share_1"]["rollout_steps_per_s"] > 0
    f = tmp_path / "interference.json"
    f.write_text(json.dumps(r))
    # a trace of its own: the GPU check carries this repository, not the shared traces
    trace = tmp_path / "burst.csv"
    rows = (f"{i * 0.25},ChatGPT,{200 + i % 7 * 50},{100 + i % 5 * 40},0,Conversation log" for i in range(240))
    trace.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n" + "\n".join(rows) + "\n")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "rose",
            "simulate",
            "--trace",
            str(trace),
            "--gpus",
            "4",
            "--duration",
            "30",
            "--interference-bench",
            str(f),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["config"]["interference_alpha"] == pytest.approx(r["alpha_per_share"])


@pytest.mark.cuda
def test_cuda_pause_drains_the_rollout_stream_quickly():
    lat = _cuda.pause_latency("cuda", quick=True, n=10)
    assert lat["n"] == 10 and lat["p99_ms"] < 100  # a layer's kernels, not a whole step queue
