"""GPU utilisation and memory through NVML (`pynvml` from nvidia-ml-py), a thin adapter.

Rollout memory is the sum of the per-process GPU memory of the rollout processes, matched
by PID. The PIDs come from a file with one PID a line (the executor writes its workers'
PIDs there; `rose agent --rollout-pids FILE`), re-read at every sample so workers that
start or stop are followed. NVML averages utilisation over 1/6 s to 1 s depending on the
GPU, so sampling faster than `MIN_PERIOD_S` would only repeat values.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MIN_PERIOD_S = 0.1


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here (no driver, no GPU, no library); one-line reason."""


@dataclass(frozen=True)
class GpuSample:
    util: float  # 0..1
    mem_total_bytes: int
    mem_used_bytes: int
    rollout_mem_bytes: int


def read_pids(path: str | Path | None) -> set[int]:
    """PIDs listed in `path` (one a line; blanks and junk ignored); empty if no file."""
    if not path:
        return set()
    try:
        text = Path(path).read_text()
    except OSError:
        return set()
    return {int(x) for x in text.split() if x.isdigit()}


class Nvml:
    """An initialised NVML session over this node's GPUs."""

    def __init__(self):
        try:
            import pynvml
        except ImportError:
            raise NvmlUnavailable("NVML Python bindings missing (pip install nvidia-ml-py)") from None
        self._nv = pynvml
        try:
            pynvml.nvmlInit()
            n = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as e:
            raise NvmlUnavailable(f"NVML unavailable: {e} (no NVIDIA driver or GPU on this machine?)") from None
        if n == 0:
            raise NvmlUnavailable("NVML found no GPU on this machine")
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]

    def __len__(self) -> int:
        return len(self.handles)

    def sample(self, index: int, rollout_pids: set[int]) -> GpuSample:
        nv, h = self._nv, self.handles[index]
        util = nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        rollout = 0
        if rollout_pids:
            for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid in rollout_pids and p.usedGpuMemory:  # None when the driver hides it
                    rollout += int(p.usedGpuMemory)
        used = int(mem.used)
        return GpuSample(min(1.0, max(0.0, util)), int(mem.total), used, min(rollout, used))

    def close(self) -> None:
        try:
            self._nv.nvmlShutdown()
        except self._nv.NVMLError:
            pass
