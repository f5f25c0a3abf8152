"""The engines' compute dtype on CPU, chosen from the processor's flags (`rollout.dtype =
"native"`). CPUs differ: some do bf16 arithmetic in hardware (AVX-512 BF16, AMX), others (AVX2
only) convert every bf16 operand to float32 and back, which costs time instead of saving it. So
"native" is bfloat16 where a flag says the CPU has bf16 arithmetic, else float32; on a GPU it is
bfloat16. `rose bench decode` measures both dtypes on the machine at hand beside this choice
(docs/engines.md, docs/measured/cpu/bench-decode.json)."""

from __future__ import annotations

from pathlib import Path

# /proc/cpuinfo flags of bf16 arithmetic (Linux's names): AVX-512 BF16 and AMX's bf16 tiles
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
NATIVE = "native"


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The flags of the first processor in a /proc/cpuinfo text (empty when it lists none)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def this_cpu_flags() -> frozenset[str]:
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:  # not Linux: no flags known, so no bf16 arithmetic assumed
        return frozenset()


def native_dtype(device: str, flags: frozenset[str]) -> str:
    """bfloat16 on a GPU or a CPU with bf16 arithmetic, else float32."""
    if device != "cpu":
        return "bfloat16"
    return "bfloat16" if flags & NATIVE_BF16_FLAGS else "float32"


def resolve_dtype(dtype: str, device: str) -> str:
    """`rollout.dtype` as the engine takes it: "native" chosen for this device, others as given."""
    return native_dtype(device, this_cpu_flags() if device == "cpu" else frozenset()) if dtype == NATIVE else dtype
