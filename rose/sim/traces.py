"""Request traces of LLM serving, read into compact numpy arrays.

Formats (docs/contract.md §7), detected from the header or first line:

* Azure LLM inference CSV: ``TIMESTAMP,ContextTokens,GeneratedTokens`` with wall-clock
  timestamps ``YYYY-MM-DD HH:MM:SS.fffffff`` (Splitwise traces).
* BurstGPT CSV, v1 (``Timestamp,Model,Request tokens,Response tokens,...``) and v3 (adds
  ``Session ID`` and ``Elapsed time``): columns are found by name, timestamps are seconds.
  Rows with zero request and zero response tokens are failed requests and are dropped.
* Mooncake JSONL: one object a line with ``timestamp`` (ms), ``input_length``,
  ``output_length``.

Arrivals are seconds from the first request (the trace's own clock is irrelevant to a
replay), sorted stably. Malformed input raises TraceError with one line naming the file
and line. Parsing is csv/orjson + numpy, no pandas: the 19k-row Azure file loads in tens
of milliseconds.
"""

from __future__ import annotations

import csv
import datetime as _dt
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

_MAX_TOKENS = 1 << 24  # 16M tokens in one request is corrupt input, not a prompt


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Trace:
    """Requests of one trace: arrival time (s from trace start), prompt and output tokens."""

    name: str
    fmt: str
    arrival_s: np.ndarray  # float64, non-decreasing, arrival_s[0] == 0
    prompt_tokens: np.ndarray  # int32
    output_tokens: np.ndarray  # int32

    def __len__(self) -> int:
        return int(self.arrival_s.shape[0])

    @property
    def duration_s(self) -> float:
        """Time from the first to the last arrival."""
        return float(self.arrival_s[-1]) if len(self) else 0.0

    def scaled(self, speed: float) -> Trace:
        """The same requests played `speed` times faster (speed 60 turns 1 h into 1 min)."""
        if not speed > 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        return Trace(self.name, self.fmt, self.arrival_s / speed, self.prompt_tokens, self.output_tokens)

    def until(self, t_s: float) -> Trace:
        """Requests arriving before `t_s`."""
        n = int(np.searchsorted(self.arrival_s, t_s, side="left"))
        return Trace(self.name, self.fmt, self.arrival_s[:n], self.prompt_tokens[:n], self.output_tokens[:n])


def load_trace(path: str | Path) -> Trace:
    """Read a trace file of any supported format (detected automatically)."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise TraceError(f"{p}: cannot read: {e.strerror}") from None
    return parse_trace(data, name=p.name, source=str(p))


def parse_trace(data: bytes, name: str = "trace", source: str | None = None) -> Trace:
    """Parse trace bytes (the body of load_trace; `source` names the input in errors)."""
    src = source or name
    text = data.decode("utf-8-sig", errors="replace")
    first = text.lstrip()[:1]
    if not text.strip():
        raise TraceError(f"{src}: empty file")
    if first == "{":
        fmt, (t, p, o) = "mooncake", _parse_mooncake(text, src)
    else:
        fmt, (t, p, o) = _parse_csv(text, src)
    if t.size == 0:
        raise TraceError(f"{src}: no requests")
    order = np.argsort(t, kind="stable")
    t = t[order]
    return Trace(
        name=name,
        fmt=fmt,
        arrival_s=t - t[0],
        prompt_tokens=p[order].astype(np.int32),
        output_tokens=o[order].astype(np.int32),
    )


def _tokens(raw: str, src: str, line: int, col: str) -> int:
    try:
        v = int(raw)
    except ValueError:
        try:
            f = float(raw)
        except ValueError:
            raise TraceError(f"{src}:{line}: {col}: expected an integer, got {raw!r}") from None
        if not f.is_integer():
            raise TraceError(f"{src}:{line}: {col}: expected an integer, got {raw!r}") from None
        v = int(f)
    if v < 0 or v > _MAX_TOKENS:
        raise TraceError(f"{src}:{line}: {col}: {v} outside [0, {_MAX_TOKENS}]")
    return v


def _seconds(raw: str, src: str, line: int, col: str) -> float:
    try:
        v = float(raw)
    except ValueError:
        raise TraceError(f"{src}:{line}: {col}: expected seconds, got {raw!r}") from None
    if not np.isfinite(v):
        raise TraceError(f"{src}:{line}: {col}: must be finite, got {raw!r}")
    return v


_day_cache: dict[str, float] = {}


def _wallclock(raw: str, src: str, line: int) -> float:
    """`YYYY-MM-DD HH:MM:SS[.f…]` (any number of fraction digits) -> unix seconds (UTC)."""
    try:
        day, clock = raw.strip().replace("T", " ").split(" ")
        base = _day_cache.get(day)
        if base is None:
            base = _dt.datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=_dt.UTC).timestamp()
            _day_cache[day] = base
        h, m, s = clock.split(":")
        hh, mm, ss = int(h), int(m), float(s)
        if not (0 <= hh < 24 and 0 <= mm < 60 and 0 <= ss < 61):
            raise ValueError
        return base + hh * 3600 + mm * 60 + ss
    except ValueError:
        raise TraceError(f"{src}:{line}: TIMESTAMP: expected 'YYYY-MM-DD HH:MM:SS.fff', got {raw!r}") from None


def _parse_csv(text: str, src: str):
    rows = csv.reader(io.StringIO(text))
    try:
        header = next(rows)
    except (StopIteration, csv.Error):
        raise TraceError(f"{src}:1: cannot read a CSV header") from None
    cols = {c.strip().lower(): i for i, c in enumerate(header)}
    if {"timestamp", "contexttokens", "generatedtokens"} <= cols.keys():
        fmt = "azure"
        it, ip, io_ = cols["timestamp"], cols["contexttokens"], cols["generatedtokens"]
        names = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    elif {"timestamp", "request tokens", "response tokens"} <= cols.keys():
        fmt = "burstgpt"
        it, ip, io_ = cols["timestamp"], cols["request tokens"], cols["response tokens"]
        names = ("Timestamp", "Request tokens", "Response tokens")
    else:
        raise TraceError(
            f"{src}:1: unrecognised trace header {','.join(header)[:120]!r} (expected Azure LLM "
            "'TIMESTAMP,ContextTokens,GeneratedTokens', BurstGPT 'Timestamp,…,Request tokens,Response tokens,…' "
            "or Mooncake JSONL)"
        )
    width = len(header)
    need = max(it, ip, io_)
    ts: list[float] = []
    ps: list[int] = []
    os_: list[int] = []
    line = 1
    try:
        for row in rows:
            line = rows.line_num
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if len(row) != width or len(row) <= need:
                raise TraceError(f"{src}:{line}: expected {width} columns, got {len(row)}")
            if fmt == "azure":
                t = _wallclock(row[it], src, line)
            else:
                t = _seconds(row[it], src, line, names[0])
            p = _tokens(row[ip], src, line, names[1])
            o = _tokens(row[io_], src, line, names[2])
            if fmt == "burstgpt" and p == 0 and o == 0:
                continue  # a failed request (BurstGPT logs them with zero tokens)
            ts.append(t)
            ps.append(p)
            os_.append(o)
    except csv.Error as e:
        raise TraceError(f"{src}:{rows.line_num}: {e}") from None
    return fmt, (np.asarray(ts, dtype=np.float64), np.asarray(ps, dtype=np.int64), np.asarray(os_, dtype=np.int64))


def _parse_mooncake(text: str, src: str):
    ts: list[float] = []
    ps: list[int] = []
    os_: list[int] = []
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            d = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise TraceError(f"{src}:{n}: invalid JSON: {e}") from None
        if not isinstance(d, dict):
            raise TraceError(f"{src}:{n}: expected a JSON object, got {type(d).__name__}")
        vals = []
        for key in ("timestamp", "input_length", "output_length"):
            v = d.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                what = "missing" if v is None else f"expected a number, got {v!r}"
                raise TraceError(f"{src}:{n}: {key}: {what}")
            vals.append(v)
        t, p, o = vals
        if not np.isfinite(t):
            raise TraceError(f"{src}:{n}: timestamp: must be finite")
        ts.append(t / 1000.0)
        ps.append(_tokens(str(p), src, n, "input_length"))
        os_.append(_tokens(str(o), src, n, "output_length"))
    return np.asarray(ts, dtype=np.float64), np.asarray(ps, dtype=np.int64), np.asarray(os_, dtype=np.int64)
