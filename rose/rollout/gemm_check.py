"""The GEMM check a worker with a reduced MPS share runs before it loads weights onto the device.

With fewer SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE below 100) cuBLAS has been seen to pick a
defective BF16 GEMM kernel: a relative error of 0.92 against 0.003 normally (56 SMs on an
H200). A worker that served such products would train the policy on garbage, so it multiplies
seeded matrices on its device in each dtype it uses and compares them with a float32 product of
the same (dtype-rounded) inputs on the CPU; any product beyond the bound refuses the lease.

The bound (`bound`): the inputs are rounded to the dtype on both sides, so the two products differ
by the device's accumulation (float32 in cuBLAS; K * 2^-24, below 3e-4 for K = 4096) and the
rounding of the output to the dtype, at most its unit roundoff u = eps/2 per element (bf16:
2^-8 = 0.0039; measured normal 0.003). The bound is 4u (bf16: 0.0156), room for a split-K
reduction's extra roundings, and 59 times below the defective kernel's 0.92. float32 products
are bounded as TF32 (10 mantissa bits), which cuBLAS may use for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

# (M, K, N): one decode row, a batch of rows, a prefill block; K as a 4096-wide model's
SHAPES: tuple[tuple[int, int, int], ...] = ((1, 4096, 4096), (64, 4096, 4096), (512, 4096, 1024))
TF32_EPS = 2.0**-10


@dataclass(frozen=True)
class GemmResult:
    dtype: str
    shape: tuple[int, int, int]
    rel_err: float  # Frobenius norm of (device - reference) over that of the reference
    bound: float

    @property
    def ok(self) -> bool:
        return self.rel_err <= self.bound  # a NaN is not ok

    def why(self) -> str:
        m, k, n = self.shape
        return (
            f"{self.dtype} GEMM {m}x{k}x{n} on the device is off the CPU float32 reference by "
            f"relative error {self.rel_err:.3g} (bound {self.bound:.3g})"
        )


def bound(dtype: Any) -> float:
    """4 unit roundoffs of the product's dtype (module docstring)."""
    import torch

    eps = TF32_EPS if dtype == torch.float32 else torch.finfo(dtype).eps
    return 4 * eps / 2


def gemm_check(
    device: str,
    dtypes: Iterable[str],
    matmul: Callable[[Any, Any], Any] | None = None,
    shapes: Iterable[tuple[int, int, int]] = SHAPES,
    seed: int = 0,
) -> list[GemmResult]:
    """Each shape in each dtype multiplied on `device` with `matmul` (default torch.matmul)
    against the CPU float32 product of the same dtype-rounded inputs."""
    import torch

    mm = torch.matmul if matmul is None else matmul
    g = torch.Generator().manual_seed(seed)
    out = []
    for name in dict.fromkeys(dtypes):
        dtype = getattr(torch, name)
        for m, k, n in shapes:
            a = torch.randn(m, k, generator=g).to(dtype)
            b = torch.randn(k, n, generator=g).to(dtype)
            want = a.float() @ b.float()
            got = mm(a.to(device), b.to(device)).float().cpu()
            err = float(torch.linalg.norm(got - want) / torch.linalg.norm(want))
            out.append(GemmResult(name, (m, k, n), err, bound(dtype)))
    return out


def first_failure(results: Iterable[GemmResult]) -> str | None:
    """Why the check failed (its first failing product), or None when every product is within bound."""
    return next((r.why() for r in results if not r.ok), None)
