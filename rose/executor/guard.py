"""The executor's local fast guard: it watches the node's own serving latency at high frequency
and raises the rollout pause flag the moment headroom collapses, before the scheduler's revoke
can arrive through Kafka. The lease revoke that follows frees the memory; the guard only pauses.

The latency signal is an interface, `LatencySource = Callable[[gpu], LatencySample | None]`.
The one ROSE ships is a file per GPU in a local directory (default `/dev/shm/rose-latency`, a
RAM-backed tmpfs): the node's agent (real or simulated) writes the newest window there with
`write_latency` (write-then-rename, so a reader never sees half a file), and the guard reads it
only when its mtime changes. Why a file: it is local to the node like the pause flag (no
network hop, no broker), it works across processes and languages (a serving engine's sidecar can
write it), costs one stat() per poll, and survives either side restarting. The format is one
JSON object with `ts`, `latency_ms` and `slo_ms` (a whole rose.telemetry.v1 event qualifies).

Hysteresis: trip below `trip_headroom` (the policy's revoke threshold, 0.10), clear at or above
`clear_headroom` (the grant threshold, 0.30), so the pause does not flap around one threshold.
"""

from __future__ import annotations

import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import orjson

from rose.contract.events import InvalidEvent, Latency


@dataclass(frozen=True, slots=True)
class LatencySample:
    ts: float
    latency_ms: Latency
    slo_ms: Latency

    @property
    def headroom(self) -> float:
        """The smallest headroom over the SLO metrics: 1 - p99/SLO (negative when violated)."""
        worst: float = min(1.0 - getattr(self.latency_ms, m) / getattr(self.slo_ms, m) for m in Latency.METRICS)
        return worst

    def to_dict(self) -> dict[str, Any]:
        return {
            "ts": self.ts,
            "latency_ms": {m: getattr(self.latency_ms, m) for m in Latency.METRICS},
            "slo_ms": {m: getattr(self.slo_ms, m) for m in Latency.METRICS},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LatencySample:
        if not isinstance(d, dict):
            raise InvalidEvent("$", "expected JSON object")
        ts = d.get("ts", 0.0)
        if isinstance(ts, bool) or not isinstance(ts, (int, float)):
            raise InvalidEvent("ts", "expected number")
        return cls(
            float(ts),
            Latency.from_dict(d.get("latency_ms"), "latency_ms.", positive=False),
            Latency.from_dict(d.get("slo_ms"), "slo_ms.", positive=True),
        )


LatencySource = Callable[[str], "LatencySample | None"]


def default_latency_dir() -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / "rose-latency"


def latency_path(directory: str | Path, gpu: str) -> Path:
    return Path(directory) / (quote(gpu, safe="") + ".json")


def write_latency(directory: str | Path, gpu: str, sample: LatencySample) -> None:
    """Publish the newest latency window of `gpu` for the local guard (atomic replace)."""
    path = latency_path(directory, gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_bytes(orjson.dumps(sample.to_dict()))
    os.replace(tmp, path)


class FileLatencySource:
    """Reads `write_latency` files; re-reads a file only when its mtime or size changed."""

    def __init__(self, directory: str | Path | None = None):
        self.directory = Path(directory) if directory else default_latency_dir()
        self._cache: dict[str, tuple[tuple[int, int], LatencySample | None]] = {}

    def __call__(self, gpu: str) -> LatencySample | None:
        path = latency_path(self.directory, gpu)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        stamp = (st.st_mtime_ns, st.st_size)
        hit = self._cache.get(gpu)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        sample: LatencySample | None
        try:
            sample = LatencySample.from_dict(orjson.loads(path.read_bytes()))
        except (OSError, orjson.JSONDecodeError, InvalidEvent):
            sample = hit[1] if hit else None  # a torn or bad write: keep the last good window
        self._cache[gpu] = (stamp, sample)
        return sample


def tripped_next(tripped: bool, headroom: float | None, trip_headroom: float, clear_headroom: float) -> bool:
    """The hysteresis rule (pure): trip below `trip_headroom`; once tripped, stay tripped below
    `clear_headroom` (needs trip_headroom <= clear_headroom); no signal keeps the current state.
    Also elementwise over numpy arrays (`rose simulate` runs it for a whole fleet)."""
    if headroom is None:
        return tripped
    return (headroom < trip_headroom) | (tripped & (headroom < clear_headroom))


@dataclass(frozen=True, slots=True)
class GuardEvent:
    gpu: str
    tripped: bool
    headroom: float
    at_ns: int  # monotonic, when the guard saw it


class Guard:
    """Polls `source` for each GPU every `period_s` on a daemon thread. On a trip it calls
    `on_trip(gpu)` at once (the executor raises the pause flag there, no queue in between) and
    then reports a GuardEvent on `events` for the executor's state machine; clears likewise."""

    def __init__(
        self,
        gpus: Iterable[str],
        source: LatencySource,
        on_trip: Callable[[str], None],
        trip_headroom: float = 0.10,
        clear_headroom: float = 0.30,
        period_s: float = 0.0005,
        on_clear: Callable[[str], None] | None = None,
    ):
        if not 0 <= trip_headroom <= clear_headroom:
            raise ValueError("guard: need 0 <= trip_headroom <= clear_headroom")
        self.gpus = list(gpus)
        self.source = source
        self.on_trip = on_trip
        self.on_clear = on_clear
        self.trip_headroom = trip_headroom
        self.clear_headroom = clear_headroom
        self.period_s = period_s
        self.events: queue.SimpleQueue[GuardEvent] = queue.SimpleQueue()
        self.tripped: dict[str, bool] = {g: False for g in self.gpus}
        self.trips = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> None:
        for gpu in self.gpus:
            try:
                sample = self.source(gpu)
            except Exception:  # noqa: BLE001 - a broken signal must not kill the guard
                sample = None
            headroom = sample.headroom if sample is not None else None
            was = self.tripped[gpu]
            now = tripped_next(was, headroom, self.trip_headroom, self.clear_headroom)
            if now == was:
                continue
            assert headroom is not None  # no signal keeps the state (tripped_next)
            self.tripped[gpu] = now
            if now:
                self.on_trip(gpu)
                self.trips += 1
            elif self.on_clear is not None:
                self.on_clear(gpu)
            self.events.put(GuardEvent(gpu, now, headroom, time.monotonic_ns()))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            time.sleep(self.period_s)

    def start(self) -> Guard:
        self._thread = threading.Thread(target=self._run, name="rose-guard", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
