"""Summaries of sample lists (latencies, durations, per-seed figures): one percentile definition
and one 95 % interval for every report, bench and live view."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def percentile(samples: Sequence[float], q: float, ndigits: int | None = None) -> float | None:
    """Nearest-rank q-quantile (0 <= q <= 1) of `samples`: the smallest sample with at least a
    fraction q of them at or below it, so always an observed value (q = 1 is the maximum).
    None for no samples; `ndigits` rounds the result."""
    if not len(samples):
        return None
    s = sorted(samples)
    v = float(s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))])
    return v if ndigits is None else round(v, ndigits)


def _t_within(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with `df` (an integer >= 1) degrees of freedom, in closed form:
    Abramowitz & Stegun, Handbook of Mathematical Functions, 26.7.3 (odd df) and 26.7.4 (even)."""
    theta = math.atan(t / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2:
        if df == 1:
            return 2.0 * theta / math.pi
        term = total = math.cos(theta)
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        return 2.0 / math.pi * (theta + s * total)
    term = total = 1.0
    for k in range(1, df // 2):
        term *= c2 * (2 * k - 1) / (2 * k)
        total += term
    return s * total


def t_975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (the half-width factor of a
    two-sided 95 % interval), by bisection on the closed-form distribution."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    lo, hi = 0.0, 64.0  # df = 1 needs 12.71; the quantile falls as df grows
    for _ in range(80):
        mid = (lo + hi) / 2
        if _t_within(mid, df) < 0.95:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def mean_ci95(xs: Sequence[float]) -> tuple[float | None, list[float] | None]:
    """The mean of `xs` and its two-sided 95 % Student t interval [low, high] (None for fewer than
    two values: no spread to take)."""
    if not xs:
        return None, None
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, None
    half = t_975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return m, [m - half, m + half]
