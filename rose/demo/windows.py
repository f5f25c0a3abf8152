"""The demo's alternating windows: leases off, on, off, on, ... over the measured run; the
episodes each window started. The mean of the windows of each kind and its 95 % Student t
interval over those windows: rose.obs.stats.mean_ci95.

One leases-off stretch against one leases-on stretch would compare two parts of the run that
differ in more than the leases (the trace's load at that time, the policy's progress, what
else the machine was doing); several of each, alternated, give a spread over windows, and the
interval says how far the difference could be that spread. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def plan(duration_s: float, window_s: float) -> list[tuple[float, float, bool]]:
    """The windows of a run of `duration_s` as (start, end, leases) offsets from its start: an
    even number of equal windows, as close to `window_s` long as that allows and at least four
    (two of each kind, the fewest a spread can be taken over), leases off first."""
    if not duration_s > 0 or not window_s > 0:
        raise ValueError(f"duration_s and window_s must be > 0, got {duration_s}, {window_s}")
    n = max(4, 2 * round(duration_s / (2 * window_s)))
    length = duration_s / n
    return [(i * length, (i + 1) * length, i % 2 == 1) for i in range(n)]


def started_at(episode: Mapping, started: Mapping[str, float]) -> float:
    """When the episode was first taken by a worker; an episode never seen waiting (taken and
    finished between two looks at the queue) started within one look of its finish."""
    return started.get(episode.get("task_id") or "", episode["finished_at"])


def window_rates(episodes: Iterable[Mapping], started: Mapping[str, float], windows: Sequence[Mapping]) -> list[dict]:
    """Per window: the episodes that started in it (whenever they finished), in total, on the
    dedicated worker and on leased ones, and the episodes per minute they make."""
    out = [
        {**w, "episodes": 0, "by_dedicated": 0, "by_leased": 0, "start_seen": 0, "episodes_per_min": None}
        for w in windows
    ]
    for e in episodes:
        t = started_at(e, started)
        for w in out:
            if w["start"] <= t < w["end"]:
                w["episodes"] += 1
                w["by_dedicated" if e["dedicated"] else "by_leased"] += 1
                w["start_seen"] += (e.get("task_id") or "") in started
                break
    for w in out:
        minutes = (w["end"] - w["start"]) / 60.0
        if minutes > 0:
            w["episodes_per_min"] = w["episodes"] / minutes
    return out
