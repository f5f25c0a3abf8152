"""Serving latency from a serving engine's Prometheus endpoint: parse, then window.

Parses the text exposition format (version 0.0.4: ``# HELP``/``# TYPE`` comments,
``name{label="v",...} value [timestamp]`` samples, ``_bucket{le=...}``/``_sum``/``_count``
histogram series) and turns two scrapes into one window: p99 TTFT and TPOT from the
histogram bucket deltas (linear interpolation inside the bucket, as PromQL's
``histogram_quantile``), requests/s from a counter's delta, queue depth from a gauge, KV-cache
usage (0..1) from a gauge.

Series are summed over all labels but ``le`` (one engine may report per model or per
finish reason); a ratio gauge (KV-cache usage) is read as its largest value over label sets
(`Scrape.peaks`: the fullest of several engines behind one page, never their sum), and a value
outside 0..1 (a percentage under a configured name) as absent. A counter or histogram whose
value went down was reset (the engine restarted): the window then counts what the new process
has seen since it started, as PromQL's ``rate`` does. A window without a figure yields None,
never 0: a latency histogram that gained no observation (no request finished: an idle engine,
or the first scrape, which has nothing to compare with) has no p99, and 0 ms would read as full
headroom; `ServingWindow.missing` names the latency roles whose histogram is not on the page at
all (a misconfigured metric name). What the agent publishes for such windows: rose.node.agent.

Metric names per engine are configuration (`ENGINES`, overridable per role through
``[telemetry.metrics]``), so other engines fit without code. Per role the current name of an
engine comes first and the names of its older releases follow as fallbacks: vLLM 0.32 reports
``vllm:inter_token_latency_seconds`` and ``vllm:kv_cache_usage_perc`` (older releases
``vllm:time_per_output_token_seconds`` and ``vllm:gpu_cache_usage_perc``); SGLang reports the
share of its KV token pool in use as ``sglang:token_usage``.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

# role -> candidate metric names, first present wins (current names first, older releases' after)
ENGINES: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {
        "ttft": ("vllm:time_to_first_token_seconds",),
        "tpot": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
        "running": ("vllm:num_requests_running",),
        "waiting": ("vllm:num_requests_waiting",),
        "requests": ("vllm:request_success_total",),
        "kv_cache": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    },
    "sglang": {
        "ttft": ("sglang:time_to_first_token_seconds",),
        "tpot": ("sglang:time_per_output_token_seconds", "sglang:inter_token_latency_seconds"),
        "running": ("sglang:num_running_reqs",),
        "waiting": ("sglang:num_queue_reqs",),
        "requests": ("sglang:num_requests_total",),
        "kv_cache": ("sglang:token_usage",),
    },
}
ROLES = ("ttft", "tpot", "running", "waiting", "requests", "kv_cache")


class ExpositionError(ValueError):
    """Text that is not the Prometheus exposition format; names the line."""


def metric_names(engine: str = "auto", overrides: Mapping[str, str] | None = None) -> dict[str, tuple[str, ...]]:
    """Candidate names per role for an engine ('vllm', 'sglang' or 'auto' = both);
    `overrides` maps a role to comma-separated names that replace the engine's."""
    if engine == "auto":
        names = {r: ENGINES["vllm"][r] + ENGINES["sglang"][r] for r in ROLES}
    elif engine in ENGINES:
        names = dict(ENGINES[engine])
    else:
        raise ValueError(f"telemetry.engine: unknown engine {engine!r} (known: auto, {', '.join(ENGINES)})")
    for role, value in (overrides or {}).items():
        if role not in ROLES:
            raise ValueError(f"telemetry.metrics.{role}: unknown role (known: {', '.join(ROLES)})")
        names[role] = tuple(n.strip() for n in str(value).split(",") if n.strip())
    return names


def all_names(names: Mapping[str, tuple[str, ...]]) -> frozenset[str]:
    """Every metric name of a role mapping (the `keep` set for `parse`)."""
    return frozenset(n for ns in names.values() for n in ns)


@dataclass
class Histogram:
    """Cumulative bucket counts by upper bound (+Inf last), summed over label sets."""

    bounds: list[float] = field(default_factory=list)
    cumulative: list[float] = field(default_factory=list)
    count: float = 0.0
    sum: float = 0.0


@dataclass
class Scrape:
    """One parse: plain samples summed by metric name, histograms by base name, and each plain
    sample's largest value over its label sets (`peaks`: how a ratio gauge aggregates)."""

    values: dict[str, float]
    histograms: dict[str, Histogram]
    peaks: dict[str, float] = field(default_factory=dict)


def _unescape(v: str) -> str:
    return v.replace("\\\\", "\x00").replace('\\"', '"').replace("\\n", "\n").replace("\x00", "\\")


_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')


def _labels(text: str, lineno: int) -> dict[str, str]:
    out: dict[str, str] = {}
    pos, n = 0, len(text.rstrip())
    while pos < n:
        m = _LABEL.match(text, pos)
        if m is None:
            raise ExpositionError(f"line {lineno}: malformed labels {{{text}}}")
        v = m.group(2)
        out[m.group(1)] = _unescape(v) if "\\" in v else v
        pos = m.end()
    return out


def _number(raw: str, lineno: int) -> float:
    try:
        return float(raw)  # accepts NaN, +Inf, -Inf as the format does
    except ValueError:
        raise ExpositionError(f"line {lineno}: value {raw!r} is not a number") from None


@functools.lru_cache(maxsize=4096)
def _wanted_base(name: str, keep: frozenset[str]) -> bool:
    if name in keep:
        return True
    for suffix in ("_bucket", "_count", "_sum"):
        if name.endswith(suffix) and name[: -len(suffix)] in keep:
            return True
    return False


def parse(text: str, keep: frozenset[str] | None = None) -> Scrape:
    """Parse exposition text; ExpositionError names the first malformed line.

    `keep` (a frozenset of names, e.g. `all_names(metric_names(...))`) skips every other series before its labels
    are parsed: a serving engine's page has hundreds of samples and the agent needs six."""
    values: dict[str, float] = {}
    peaks: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace >= 0 and (space < 0 or brace < space):
            if keep is not None and not _wanted_base(line[:brace], keep):
                continue
            close = line.rfind("}")
            if close < brace:
                raise ExpositionError(f"line {lineno}: unbalanced braces")
            name, labels, rest = line[:brace], _labels(line[brace + 1 : close], lineno), line[close + 1 :]
        else:
            if space < 0:
                raise ExpositionError(f"line {lineno}: sample without a value")
            name, labels, rest = line[:space], None, line[space:]
            if keep is not None and not _wanted_base(name, keep):
                continue
        parts = rest.split()
        if not parts or len(parts) > 2:
            raise ExpositionError(f"line {lineno}: expected 'value [timestamp]' after {name}")
        v = _number(parts[0], lineno)
        if math.isnan(v):
            continue
        if name.endswith("_bucket") and labels is not None and "le" in labels:
            le = _number(labels["le"], lineno)
            b = buckets.setdefault(name[:-7], {})
            b[le] = b.get(le, 0.0) + v
        elif name in values:
            values[name] += v
            if v > peaks[name]:
                peaks[name] = v
        else:
            values[name] = peaks[name] = v
    hists = {}
    for base, b in buckets.items():
        bounds = sorted(b)
        hists[base] = Histogram(
            bounds, [b[x] for x in bounds], values.get(base + "_count", b[bounds[-1]]), values.get(base + "_sum", 0.0)
        )
    return Scrape(values, hists, peaks)


def _delta_hist(now: Histogram, prev: Histogram | None) -> list[float] | None:
    """Per-window cumulative bucket counts; None when there is nothing to compare."""
    if prev is None or prev.bounds != now.bounds:
        return None
    d = [a - b for a, b in zip(now.cumulative, prev.cumulative)]
    if any(x < 0 for x in d) or now.count < prev.count:
        return list(now.cumulative)  # reset: everything since the restart
    return d


def quantile(q: float, bounds: list[float], cumulative: list[float]) -> float | None:
    """histogram_quantile: linear interpolation within the bucket holding rank q·total."""
    if not bounds or cumulative[-1] <= 0:
        return None
    total = cumulative[-1]
    rank = q * total
    lower, below = 0.0, 0.0
    for ub, c in zip(bounds, cumulative):
        if c >= rank:
            if math.isinf(ub):
                finite = [b for b in bounds if not math.isinf(b)]
                return finite[-1] if finite else None
            if c == below:
                return ub
            return lower + (ub - lower) * (rank - below) / (c - below)
        lower, below = ub, c
    return bounds[-1] if not math.isinf(bounds[-1]) else None


@dataclass(frozen=True)
class ServingWindow:
    """What one window of the engine's metrics says (None: metric absent or no samples)."""

    ttft_p99_ms: float | None
    tpot_p99_ms: float | None
    rps: float | None
    queue_depth: int | None
    running: int | None
    missing: tuple[str, ...] = ()  # latency roles ("ttft", "tpot") whose histogram the page lacks
    kv_cache_usage: float | None = None  # 0..1 at the newer scrape, the fullest label set (None: absent, outside 0..1)


def _first(d: Mapping, names: tuple[str, ...]):
    for n in names:
        if n in d:
            return d[n]
    return None


def window(now: Scrape, prev: Scrape | None, dt_s: float, names: Mapping[str, tuple[str, ...]]) -> ServingWindow:
    """The window between two scrapes `dt_s` apart (`prev` None: the first scrape)."""
    out, missing = {}, []
    for role in ("ttft", "tpot"):
        h = _first(now.histograms, names[role])
        if h is None:
            missing.append(role)
        ph = _first(prev.histograms, names[role]) if prev else None
        d = _delta_hist(h, ph) if h is not None else None
        q = quantile(0.99, h.bounds, d) if d is not None else None
        out[role] = q * 1000.0 if q is not None else None
    req = _first(now.values, names["requests"])
    preq = _first(prev.values, names["requests"]) if prev else None
    rps = None
    if req is not None and preq is not None and dt_s > 0:
        rps = (req - preq if req >= preq else req) / dt_s
    waiting = _first(now.values, names["waiting"])
    running = _first(now.values, names["running"])
    kv = _first(now.peaks, names.get("kv_cache", ()))
    return ServingWindow(
        out["ttft"],
        out["tpot"],
        rps,
        None if waiting is None else max(0, int(round(waiting))),
        None if running is None else max(0, int(round(running))),
        tuple(missing),
        kv if kv is not None and 0.0 <= kv <= 1.0 else None,
    )
