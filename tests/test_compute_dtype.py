"""`rollout.dtype = "native"`: bfloat16 only where the CPU's flags say it does bf16 arithmetic (or
on a GPU), float32 elsewhere; the flags read from a /proc/cpuinfo text; other dtypes untouched."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rose.rollout.compute_dtype import NATIVE_BF16_FLAGS, cpu_flags, native_dtype, resolve_dtype

AVX2_ONLY = (
    "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t: x\n"
)
flag = st.from_regex(r"[a-z0-9_]{2,12}", fullmatch=True)


def test_flags_are_the_first_processors():
    assert cpu_flags(AVX2_ONLY) == {"fpu", "sse2", "avx", "avx2", "fma"}
    assert cpu_flags("processor : 0\nmodel name : x\n") == frozenset()


@given(st.frozensets(flag))
def test_bf16_only_with_a_bf16_arithmetic_flag(flags):
    got = native_dtype("cpu", flags)
    assert got == ("bfloat16" if flags & NATIVE_BF16_FLAGS else "float32")
    assert native_dtype("cpu", flags | {"avx512_bf16"}) == "bfloat16"
    assert (
        native_dtype("cpu", flags - NATIVE_BF16_FLAGS | {"avx512f", "avx512bw"}) == "float32"
    )  # AVX-512 alone is not bf16
    assert native_dtype("cuda:0", flags) == "bfloat16"


@given(st.sampled_from(["float32", "bfloat16", "float16", "auto"]), st.sampled_from(["cpu", "cuda:0"]))
def test_a_named_dtype_is_kept(dtype, device):
    assert resolve_dtype(dtype, device) == dtype
