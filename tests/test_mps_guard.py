"""A CUDA worker fails closed (rose.rollout.gemm_check, rose.rollout.mps,
rose.rollout.worker_process.check_device): its lease's share and memory become its MPS limits;
with an MPS share it refuses the lease when a GEMM is off the CPU float32 reference beyond the
bound (a defective kernel injected here, as cuBLAS picked one at 56 SMs on an H200: relative
error 0.92), when MPS is meant and it is not attached, or when a check cannot run. On a machine
without a GPU the worker process itself refuses a CUDA lease with exit 5 and one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rose.config import RedisConfig
from rose.executor.workers import refused_why
from rose.rollout import gemm_check as gc
from rose.rollout import mps
from rose.rollout.launcher import EXIT_DEVICE_CHECK, WorkerConfig
from rose.rollout.worker_process import check_device

SMALL = ((1, 512, 256), (32, 1024, 256))  # small enough for a test, K as large as a few heads


def defective(a, b):
    """A kernel that drops most of the reduction (a wrong split-K), off by about 0.97."""
    k = a.shape[1] // 16
    return a[:, :k] @ b[:k]


def _cpu_check(matmul=None):
    return lambda device, dtypes: gc.gemm_check("cpu", dtypes, matmul=matmul, shapes=SMALL)


def _config(**kw) -> WorkerConfig:
    base = dict(gpu="n/0", worker_id="w", redis=RedisConfig(), job="j", model="m", device="cuda:1")
    return WorkerConfig(**{**base, "compute_share": 0.5, "mem_bytes": 3 << 30, **kw})


def test_the_bound_is_four_unit_roundoffs_between_normal_and_defective():
    import torch

    assert gc.bound(torch.bfloat16) == 2.0**-6  # 0.0156: normal 0.003 below, defective 0.92 far above
    assert gc.bound(torch.float16) == 2.0**-9
    assert gc.bound(torch.float32) == 2.0**-9  # as TF32


def test_a_sound_gemm_passes_and_its_error_is_the_dtypes_rounding():
    results = gc.gemm_check("cpu", ("bfloat16", "float32"), shapes=SMALL)
    assert [(r.dtype, r.shape) for r in results] == [(d, s) for d in ("bfloat16", "float32") for s in SMALL]
    bf16 = [r.rel_err for r in results if r.dtype == "bfloat16"]
    assert all(1e-4 < e < 2.0**-8 for e in bf16), bf16  # the output's bf16 rounding, measured
    assert gc.first_failure(results) is None


def test_a_defective_kernel_fails_the_check_with_its_dtype_and_shape():
    results = gc.gemm_check("cpu", ("bfloat16",), matmul=defective, shapes=SMALL)
    assert all(r.rel_err > 0.9 and not r.ok for r in results)
    why = gc.first_failure(results)
    assert why is not None and why.startswith("bfloat16 GEMM 1x512x256 on the device is off") and "bound 0.0156" in why
    nan = gc.GemmResult("bfloat16", (1, 1, 1), float("nan"), 0.01)
    assert not nan.ok


def test_the_lease_sets_the_mps_limits_and_a_defective_gemm_refuses_it():
    env: dict[str, str] = {}
    why = check_device(_config(), env, gemm=_cpu_check(defective), clients=lambda d: set())
    assert why is not None and why.startswith("bfloat16 GEMM")
    assert env == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "1=3072M"}
    assert check_device(_config(), {}, gemm=_cpu_check(), clients=lambda d: set()) is None  # no MPS meant here


def test_a_check_that_cannot_run_refuses():
    def broken(device, dtypes):
        raise RuntimeError("no CUDA")

    why = check_device(_config(), {}, gemm=broken)
    assert why == "the GEMM check could not run on cuda:1: RuntimeError: no CUDA"
    # the whole GPU and no MPS: nothing to check, the limits are still set
    env: dict[str, str] = {}
    assert check_device(_config(compute_share=1.0), env, gemm=broken) is None
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
    cpu: dict[str, str] = {}
    assert check_device(_config(device="cpu"), cpu, gemm=broken) is None and cpu == {}


def test_mps_meant_but_not_attached_refuses(tmp_path):
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    sound = _cpu_check()
    assert "no MPS control pipe" in check_device(_config(compute_share=1.0), dict(env), gemm=sound)
    os.mkfifo(tmp_path / "control")
    others = check_device(_config(), dict(env), gemm=sound, clients=lambda d: {1})
    assert others is not None and others.startswith("not attached to the MPS server: NVML lists 1 MPS client(s)")
    assert check_device(_config(), dict(env), gemm=sound, clients=lambda d: {os.getpid()}) is None

    def no_nvml(device):
        raise OSError("libnvidia-ml.so.1 not found")

    why = check_device(_config(), dict(env), gemm=sound, clients=no_nvml)
    assert (
        why
        == "could not ask NVML whether this process is an MPS client of cuda:1: OSError: libnvidia-ml.so.1 not found"
    )
    assert mps.meant({}) is None or os.path.exists("/tmp/nvidia-mps/control")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_has_cuda(), reason="on a GPU the check runs for real")
def test_the_worker_process_refuses_a_cuda_lease_it_cannot_check():
    """The real worker process, given a CUDA lease with an MPS share on a machine without CUDA:
    the check cannot run, so it exits 5 with one line, before building its engine (no Redis)."""
    cfg = _config(device="cuda:0", redis=RedisConfig(url="redis://127.0.0.1:1/0"))
    p = subprocess.run(
        [sys.executable, "-m", "rose.rollout.worker_process"],
        input=cfg.to_json(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == EXIT_DEVICE_CHECK, p.stderr
    # the executor reads that exit as a refusal: the lease ends with this reason, no restart
    assert "device check refused the lease" in refused_why(p.returncode) and refused_why(0) == refused_why(1) == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "rose-worker: refusing the lease: the GEMM check could not run on cuda:0"
    )
