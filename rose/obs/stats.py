"""Summaries of sample lists (latencies, durations): one percentile definition for every report,
bench and live view."""

from __future__ import annotations

import math
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
