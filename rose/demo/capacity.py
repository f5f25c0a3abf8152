"""What one serving replica of the demo can carry, and the trace scaled to it.

A trace recorded on a GPU fleet says nothing of what vLLM on one CPU core serves: replayed as
recorded, the demo's device was overloaded with or without leases, so nothing was idle to lend.
So before the measured run the device measures its capacity: closed-loop clients (1, 2, 4, ...
at once) send requests with the trace's (scaled) token counts back to back; at each level the
completed requests per second and the p99 of TTFT and of TPOT, judged on the server's own metrics
where a `meter` is given (the figures the telemetry carries), else on the client's timings. The
capacity is the highest rate of a level whose p99s both meet the configured SLO (where even one
client alone misses it, one client's rate, and the report names the figure that misses). The trace
is then played at its recorded pace (or, with `replay_s`, its whole course compressed into the run)
and its requests thinned, so its peak rate is `fraction` of that capacity: the peak over bins of
`bin_s` of the trace as recorded (bins that hold hundreds of requests, so the peak is the trace's
rate and not its noise). The demo's fraction is 1 / (1 + the pool's headroom): the load a replica
carries at the forecast peak when the fleet is provisioned as the pool decision provisions it
(docs/policy.md "Pool decisions"). Nothing is tuned after the fact.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from rose.obs.stats import percentile

# (prompt token ids, answer tokens) -> (TTFT ms, mean TPOT ms) of one request, timed by the client
ServeOne = Callable[[list[int], int], tuple[float, float]]
# a level's p99s as the SLO is judged on them: a call at the level's start, and one after its last
# request, which returns the (TTFT, TPOT) p99 in ms of the window between the two (None: none measured)
Meter = Callable[[], tuple[float | None, float | None]]


@dataclass(frozen=True)
class Level:
    """One closed-loop level of the capacity measurement."""

    clients: int
    requests: int  # completed within the level
    seconds: float
    rps: float
    ttft_p99_ms: float | None
    tpot_p99_ms: float | None

    def meets(self, slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
        return (
            self.requests > 0
            and self.ttft_p99_ms is not None
            and self.tpot_p99_ms is not None
            and self.ttft_p99_ms <= slo_ttft_ms
            and self.tpot_p99_ms <= slo_tpot_ms
        )


def capacity_rps(levels: Sequence[Level], slo_ttft_ms: float, slo_tpot_ms: float) -> float:
    """The highest rate among the levels that meet the SLO, 0 when none does."""
    return max((lv.rps for lv in levels if lv.meets(slo_ttft_ms, slo_tpot_ms)), default=0.0)


def peak_rps(arrival_s: np.ndarray, bin_s: float) -> float:
    """The highest arrivals per second over bins of `bin_s` from the first arrival (0 without any)."""
    if len(arrival_s) == 0:
        return 0.0
    a = np.asarray(arrival_s, dtype=float)
    counts = np.bincount(((a - a.min()) // bin_s).astype(np.int64))
    return float(counts.max()) / bin_s


def replay_plan(capacity: float, peak: float, fraction: float, compress: float) -> tuple[float, float]:
    """(speed, keep): the replay plays the trace `speed` times faster than recorded and keeps each
    request with probability `keep`, so its peak rate, `peak` × speed × keep, is `fraction` of the
    capacity. The speed is `compress` (the trace's span over the replay's, so the run sees the
    trace's whole course of troughs and peaks), and the requests are thinned to the rate; a trace
    too light for that is played faster instead, every request kept."""
    if capacity <= 0 or peak <= 0 or compress <= 0 or not 0 < fraction <= 1:
        raise ValueError(
            f"need capacity > 0, peak > 0, compress > 0 and 0 < fraction <= 1; got {capacity}, {peak}, {compress}, "
            f"{fraction}"
        )
    target = fraction * capacity
    if peak * compress <= target:
        return target / peak, 1.0
    return compress, target / (peak * compress)


def replayed(n: int, keep: float, seed: int) -> np.ndarray:
    """Which of the trace's `n` requests the replay sends: a seeded thinning with probability `keep`."""
    return np.random.default_rng(seed).random(n) < keep


def measure(
    serve_one: ServeOne,
    prompts: Sequence[int] | np.ndarray,
    outputs: Sequence[int] | np.ndarray,
    clients: Sequence[int] | np.ndarray,
    level_s: float,
    slo: tuple[float, float],
    seed: int = 0,
    progress: Callable[[Level], None] | None = None,
    meter: Meter | None = None,
) -> list[Level]:
    """Closed-loop levels in `clients` order, stopping after the first that misses the SLO (more
    clients only queue more). Each client draws (prompt, answer) token counts from the trace's
    pairs; a request counts in the level when it finishes before the level's end, and the level
    waits for the requests still running before the next starts. With a `meter` the level's p99s
    are the server's over the level (the telemetry's figures, which the SLO is judged on: vLLM's
    TPOT is per token, the client's per request); without, the client's."""
    levels: list[Level] = []
    for i, c in enumerate(clients):
        lv = _level(serve_one, prompts, outputs, c, level_s, np.random.default_rng(seed + i), meter)
        levels.append(lv)
        if progress is not None:
            progress(lv)
        if not lv.meets(*slo):
            break
    return levels


def _level(
    serve_one: ServeOne,
    prompts: Sequence[int] | np.ndarray,
    outputs: Sequence[int] | np.ndarray,
    c: int,
    level_s: float,
    rng,
    meter: Meter | None = None,
) -> Level:
    picks = rng.integers(0, len(prompts), size=(c, 10_000))
    ids = [np.random.default_rng(rng.integers(1 << 31) + k) for k in range(c)]  # random prompts: no prefix hits
    t0 = time.monotonic()
    end = t0 + level_s
    done: list[tuple[float, float]] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        for j in picks[k]:
            if time.monotonic() >= end:
                return
            p, n = int(prompts[j]), int(outputs[j])
            ttft, tpot = serve_one(ids[k].integers(1, 256, p).tolist(), n)
            if time.monotonic() <= end:
                with lock:
                    done.append((ttft, tpot))

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(c)]
    if meter is not None:
        meter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    p99 = meter() if meter is not None else (
        percentile([d[0] for d in done], 0.99, 3), percentile([d[1] for d in done], 0.99, 3)
    )  # fmt: skip
    return Level(c, len(done), round(level_s, 3), round(len(done) / level_s, 4), *p99)


@dataclass(frozen=True)
class ScaledLoad:
    """What the device measured and how the trace was scaled: the report's `serving_load`."""

    capacity_rps: float  # the highest rate within the SLO; where none met it, one client's rate
    slo_met_alone: bool  # False: one client alone missed the SLO, so no load of the trace keeps it
    fraction: float
    speed: float  # the replay's clock against the trace's recorded one
    keep: float  # the fraction of the trace's requests the replay sends
    bin_s: float
    trace_peak_rps: float  # this device's share of the trace, as recorded
    trace_mean_rps: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    solo_ttft_p99_ms: float | None  # one client alone
    solo_tpot_p99_ms: float | None
    levels: tuple[Level, ...]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["levels"] = [asdict(lv) for lv in self.levels]
        return d

    def held_back(self, slo: tuple[float, float]) -> str | None:
        """Where one client alone missed the SLO, which measured figure missed it and by how much."""
        if self.slo_met_alone:
            return None
        over = [
            f"{name} p99 {v:g} ms against {limit:g} ms (×{v / limit:.2f})"
            for name, v, limit in (("TTFT", self.solo_ttft_p99_ms, slo[0]), ("TPOT", self.solo_tpot_p99_ms, slo[1]))
            if v is not None and v > limit
        ]
        return "one client alone misses the SLO: " + ("; ".join(over) or "no request finished in the level")


def scaled_load(
    levels: Sequence[Level], arrival_s: np.ndarray, prompts: np.ndarray, outputs: np.ndarray,
    slo: tuple[float, float], fraction: float, bin_s: float, replay_s: float = 0.0,
) -> ScaledLoad:  # fmt: skip
    """The scale of the trace from the measured levels. Where no level met the SLO (one client
    alone included), no load of this trace keeps it on this device: the trace is scaled to the
    rate of one client alone instead, so the run still shows what leases cost, and `held_back`
    names the figure."""
    if not levels or levels[0].requests == 0:
        raise ValueError("the serving replica finished no request with one client alone: see its log")
    cap = capacity_rps(levels, *slo)
    met = cap > 0
    cap = cap if met else levels[0].rps
    peak = peak_rps(arrival_s, bin_s)
    span = float(arrival_s.max() - arrival_s.min()) if len(arrival_s) > 1 else math.nan
    speed, keep = replay_plan(cap, peak, fraction, span / replay_s if replay_s > 0 and span > 0 else 1.0)
    return ScaledLoad(
        round(cap, 4), met, round(fraction, 4), round(speed, 6), round(keep, 6), bin_s, round(peak, 4),
        round(len(arrival_s) / span, 4) if span and span > 0 else 0.0,
        round(float(np.mean(prompts)), 1), round(float(np.mean(outputs)), 1),
        levels[0].ttft_p99_ms, levels[0].tpot_p99_ms, tuple(levels),
    )  # fmt: skip
