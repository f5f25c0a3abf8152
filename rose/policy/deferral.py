"""Which `decide()` calls a caller may hold back without changing any decision (pure).

A GPU whose view holds no lease, on an event with headroom below `grant_headroom` on some
metric, cannot be granted anything: `decide()` issues no command and changes nothing but the
streak (to 0) and the trend history (the last event's time, id, latencies and serving memory,
and the one before it); epoch, cooldown and lease fields stay. So a run of such events leaves
the view exactly as its last `DEFERRED_KEPT` events alone would, and a caller may hold them
back and, before the GPU's next event that is not deferrable, hand `decide()` only those.
Lease states folded meanwhile commute with them (folding touches only epoch, lease and
cooldown). tests/test_lease_policy.py checks the equivalence against `decide()`; docs/policy.md
"Deferring calls" has the argument.
"""

from __future__ import annotations

from typing import Any, overload

import numpy as np
import numpy.typing as npt

from rose.config import PolicyConfig

DEFERRED_KEPT = 2  # the newest deferred events to hand decide() before the next call: its trend history


@overload
def deferrable(
    holds_lease: npt.NDArray[np.bool_], min_headroom: npt.NDArray[Any], cfg: PolicyConfig
) -> npt.NDArray[np.bool_]: ...
@overload
def deferrable(holds_lease: bool, min_headroom: float, cfg: PolicyConfig) -> np.bool_: ...
def deferrable(
    holds_lease: npt.ArrayLike, min_headroom: npt.ArrayLike, cfg: PolicyConfig
) -> npt.NDArray[np.bool_] | np.bool_:
    """Elementwise over numpy arrays (or scalars): True where the event may be held back.
    `holds_lease`: the GPU's view has a lease (`lease_id` set); `min_headroom`: the event's
    smallest headroom over the SLO metrics, `1 - p99 / slo`."""
    held_back: npt.NDArray[np.bool_] | np.bool_ = np.logical_and(
        np.logical_not(holds_lease), np.less(min_headroom, cfg.grant_headroom)
    )
    return held_back
