"""A CUDA worker as an MPS client: the environment that gives it its lease's share and memory,
and the check that it really is one.

MPS reads CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (the SMs a client may use) and
CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (the device memory it may pin) when the client's CUDA context
starts, so both are set before anything touches the device. A client that does not reach the
MPS server runs with neither and time-slices the whole GPU with serving instead, silently: so
where MPS is meant (CUDA_MPS_PIPE_DIRECTORY is set, or the default pipe directory holds a
`control` pipe) the worker checks that the control pipe is there and that NVML lists its process
among the device's MPS clients, and refuses the lease otherwise (docs/executor.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

PIPE_DEFAULT = "/tmp/nvidia-mps"


def client_env(device: str, compute_share: float, mem_bytes: int) -> dict[str, str]:
    """The MPS variables for a worker on `device` ("cuda:N") with this share and memory."""
    index = device.partition(":")[2] or "0"
    return {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(max(1, min(100, int(compute_share * 100)))),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{index}={max(1, mem_bytes >> 20)}M",
    }


def meant(env: Mapping[str, str] = os.environ) -> str | None:
    """The pipe directory where MPS is meant (set explicitly, or its default holding a control pipe)."""
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY")
    if pipe:
        return pipe
    return PIPE_DEFAULT if Path(PIPE_DEFAULT, "control").exists() else None


def nvml_clients(device: str) -> set[int]:
    """PIDs NVML lists as MPS clients of `device` (torch's index, matched by UUID)."""
    import pynvml
    import torch

    props = torch.cuda.get_device_properties(torch.device(device))
    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{props.uuid}")
        return {p.pid for p in pynvml.nvmlDeviceGetMPSComputeRunningProcesses(h)}
    finally:
        pynvml.nvmlShutdown()


def not_attached(
    device: str,
    env: Mapping[str, str] = os.environ,
    clients: Callable[[str], set[int]] = nvml_clients,
    pid: int | None = None,
) -> str | None:
    """Why this process is not an MPS client of `device` although MPS is meant; None if it is or
    MPS is not meant. Call it once the process's CUDA context has started."""
    pipe = meant(env)
    if pipe is None:
        return None
    if not Path(pipe, "control").exists():
        return f"MPS is meant (pipe directory {pipe}) but no MPS control pipe is there: no MPS server to attach to"
    try:
        listed = clients(device)
    except Exception as e:  # noqa: BLE001 - whatever stops the check refuses, it must not pass
        return f"could not ask NVML whether this process is an MPS client of {device}: {type(e).__name__}: {e}"
    me = os.getpid() if pid is None else pid
    if me not in listed:
        return (
            f"not attached to the MPS server: NVML lists {len(listed)} MPS client(s) of {device} and not this "
            f"process ({me}); it would time-slice the GPU with serving"
        )
    return None
