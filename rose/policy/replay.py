"""Event logs for debugging: read a `rose record` log (or plain telemetry NDJSON), re-run the
lease policy over its telemetry, compare with the commands it recorded, explain decisions.

Offline by design (no Kafka client here): a log from production can be replayed on a laptop.
Replay feeds the log through `rose.policy.core.SchedulingCore.apply`, the very fold the
scheduler runs: telemetry admitted by the scheduler's rule, in log order, and the executors' lease
states placed by their Kafka record time. So on a log recorded after the scheduler caught up,
the replayed commands equal the recorded ones byte for byte. The one thing a log cannot tell
exactly is when the live scheduler saw a lease state relative to the telemetry it was deciding
on; if an executor's `expired`/`rejected` raced a decision, `--diff` points at it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import orjson

from rose.config import GiB, PolicyConfig
from rose.contract.events import (
    COMMAND_SCHEMA,
    LEASE_STATE_SCHEMA,
    TELEMETRY_SCHEMA,
    Command,
    Event,
    InvalidEvent,
    LeaseState,
    Telemetry,
)
from rose.contract.wire import load_object
from rose.policy.core import Batch, SchedulingCore, check_admission
from rose.policy.lease_policy import Decision, GpuView

_PLAIN: dict[str, type[Event]] = {TELEMETRY_SCHEMA: Telemetry, COMMAND_SCHEMA: Command, LEASE_STATE_SCHEMA: LeaseState}
_KIND_BY_TYPE: dict[type[Event], str] = {Telemetry: "telemetry", Command: "command", LeaseState: "lease state"}

OnError = Callable[[int, str], None]


@dataclass
class Log:
    """What a log holds, each item with its 1-based line number."""

    telemetry: list[tuple[int, Telemetry]] = field(default_factory=list)
    commands: list[tuple[int, Command]] = field(default_factory=list)  # recorded, for --diff
    lease_states: list[tuple[int, LeaseState]] = field(default_factory=list)
    record_ms: dict[int, int] = field(default_factory=dict)  # line -> Kafka record time, `rose record` lines
    skipped: int = 0  # malformed or not admitted lines, each reported through on_error


def _topic_type(topic: str) -> type[Event] | None:
    if topic.endswith("telemetry"):
        return Telemetry
    if topic.endswith("commands"):
        return Command
    if topic.endswith("lease-state"):
        return LeaseState
    return None  # dlq, scheduler state, anything else recorded: not ours to replay


def parse_line(line: bytes, cfg: PolicyConfig) -> tuple[Telemetry | Command | LeaseState, int | None] | None:
    """One log line: a `rose record` line or a plain event, with the Kafka record time in ms
    (None for a plain line). None for a line that holds nothing to replay (blank, a
    tombstone, another topic). InvalidEvent.reason is a whole sentence naming the field."""
    if not line.strip():
        return None
    d = load_object(line)
    if "topic" in d and ("value" in d or "value_raw" in d):
        topic = d["topic"]
        if not isinstance(topic, str):
            raise InvalidEvent("topic", f"topic: expected string, got {type(topic).__name__}")
        typ = _topic_type(topic)
        if typ is None:
            return None
        if "value_raw" in d:
            raise InvalidEvent("value", f"value: the {topic} message value is not JSON")
        if d["value"] is None:
            return None
        ev = _typed(typ, d["value"])
        ts_ms = d.get("timestamp_ms")
        ts_ms = ts_ms if isinstance(ts_ms, int) and not isinstance(ts_ms, bool) else None
        if isinstance(ev, Telemetry):  # typ is Telemetry
            key = d.get("key")
            try:
                check_admission(ev, ts_ms, key if isinstance(key, str) else None, cfg)
            except InvalidEvent as e:
                raise InvalidEvent(
                    e.field, f"telemetry not admitted (the scheduler sends it to the dlq): {e.field}: {e.reason}"
                ) from None
        return ev, ts_ms
    schema = d.get("schema", TELEMETRY_SCHEMA)
    typ = _PLAIN.get(schema) if isinstance(schema, str) else None
    if typ is None:
        raise InvalidEvent("schema", f"schema: unknown schema {schema!r}")
    return _typed(typ, d), None


def _typed(typ: type[Event], value: object) -> Event:
    try:
        return typ.from_dict(value)
    except InvalidEvent as e:
        raise InvalidEvent(e.field, f"invalid {_KIND_BY_TYPE[typ]}: {e.field}: {e.reason}") from None


def read_log(lines: Iterable[bytes], cfg: PolicyConfig, on_error: OnError) -> Log:
    """Parse every line; a bad one is reported as (line number, message) and skipped."""
    log = Log()
    for lineno, line in enumerate(lines, 1):
        try:
            parsed = parse_line(line, cfg)
        except InvalidEvent as e:
            log.skipped += 1
            on_error(lineno, e.reason)
            continue
        if parsed is None:
            continue
        ev, ts_ms = parsed
        if ts_ms is not None:
            log.record_ms[lineno] = ts_ms
        if type(ev) is Telemetry:
            log.telemetry.append((lineno, ev))
        elif type(ev) is Command:
            log.commands.append((lineno, ev))
        else:
            assert isinstance(ev, LeaseState)  # parse_line gives one of the three event types
            log.lease_states.append((lineno, ev))
    return log


def replay(
    telemetry: Iterable[tuple[int, Telemetry]],
    cfg: PolicyConfig,
    on_decision: Callable[[int, Telemetry, GpuView | None, Decision], None] | None = None,
    lease_states: Iterable[tuple[int, LeaseState]] = (),
    record_ms: dict[int, int] | None = None,
    on_lease_state: Callable[[int, LeaseState, GpuView | None, GpuView], None] | None = None,
) -> tuple[list[Command], dict[str, GpuView]]:
    """Run the telemetry through the scheduling core in order; the commands in decision order,
    and the final views. `on_decision(lineno, event, view_before, decision)` sees every step,
    `on_lease_state(lineno, state, view_before, view_after)` every lease state folded, each
    with the view the GPU's next decision meets before and after it.

    A lease state reaches the core as it reached the scheduler: before the first telemetry
    event of its GPU that was recorded at or after it (Kafka record times, `record_ms`); for
    plain lines, that comes later in the file. (GPUs are independent, so placing a state per
    GPU is placing it in time.)"""
    record_ms = record_ms or {}
    pending: dict[str, list[tuple[int, LeaseState]]] = {}
    for n, ls in sorted(lease_states, key=lambda x: (record_ms.get(x[0], -1), x[0])):
        pending.setdefault(ls.gpu, []).append((n, ls))
    core = SchedulingCore(cfg)
    out: list[Command] = []
    for lineno, ev in telemetry:
        seen = _seen_lease_states(pending, ev.gpu, lineno, record_ms) if pending and ev.gpu in pending else []
        a = core.apply(Batch(lease_states=[ls for _, ls in seen], telemetry=(ev,)))
        if on_lease_state is not None:
            for (n, ls), (before, after) in zip(seen, a.folded, strict=True):
                on_lease_state(n, ls, before, after)
        d = a.decisions[0]
        if d.commands:
            out.extend(d.commands)
        if on_decision is not None:
            on_decision(lineno, ev, a.met[0], d)
    return out, core.views


def _seen_lease_states(
    pending: dict[str, list[tuple[int, LeaseState]]], gpu: str, lineno: int, record_ms: dict[int, int]
) -> list[tuple[int, LeaseState]]:
    """Take from `pending` the lease states of `gpu` that the scheduler had seen before telemetry line `lineno`."""
    queue = pending[gpu]
    t = record_ms.get(lineno)
    i = 0
    for n, _ in queue:
        ls_ms = record_ms.get(n)
        seen = ls_ms <= t if (t is not None and ls_ms is not None) else n < lineno
        if not seen:
            break
        i += 1
    taken = queue[:i]
    if i:
        del queue[:i]
        if not queue:
            del pending[gpu]
    return taken


def encode_commands(commands: Iterable[Command]) -> bytes:
    """NDJSON, one docs/contract.md §2 command a line: the byte-identical replay output."""
    return b"".join(orjson.dumps(c.to_dict()) + b"\n" for c in commands)


@dataclass(frozen=True)
class Divergence:
    gpu: str
    index: int  # position among that GPU's commands, 0-based
    recorded: Command | None
    replayed: Command | None
    recorded_line: int | None

    def describe(self, lease_states: Iterable[tuple[int, LeaseState]] = ()) -> str:
        rec = orjson.dumps(self.recorded.to_dict()).decode() if self.recorded else "(none)"
        rep = orjson.dumps(self.replayed.to_dict()).decode() if self.replayed else "(none)"
        where = f" (log line {self.recorded_line})" if self.recorded_line else ""
        lines = [
            f"first divergence on gpu {self.gpu}, its command #{self.index + 1}{where}:",
            f"  recorded: {rec}",
            f"  replayed: {rep}",
        ]
        if self.recorded and self.replayed:
            a, b = self.recorded.to_dict(), self.replayed.to_dict()
            lines.append("  differs in: " + ", ".join(k for k in a if a[k] != b[k]))
        elif self.recorded is None:
            lines.append("  the log has no such command (was the scheduler behind when it was recorded?)")
        else:
            lines.append("  replay decided no such command")
        ended = [(n, s) for n, s in lease_states if s.gpu == self.gpu and s.state in ("expired", "rejected")]
        for n, s in ended[:3]:
            lines.append(
                f"  note: line {n}: the executor reported lease {s.lease_id} {s.state} at {s.ts:.3f}; "
                "if the live scheduler saw that at another point than its record time, it decided "
                "on another view"
            )
        return "\n".join(lines)


def first_divergence(recorded: Iterable[tuple[int, Command]], replayed: Iterable[Command]) -> Divergence | None:
    """Compare per GPU, in order; the earliest (by command time) first mismatch, or None."""
    rec: dict[str, list[tuple[int, Command]]] = {}
    for n, c in recorded:
        rec.setdefault(c.gpu, []).append((n, c))
    rep: dict[str, list[Command]] = {}
    for c in replayed:
        rep.setdefault(c.gpu, []).append(c)
    found: list[tuple[float, str, Divergence]] = []
    for gpu in set(rec) | set(rep):
        a, b = rec.get(gpu, []), rep.get(gpu, [])
        for i in range(max(len(a), len(b))):
            ra = a[i] if i < len(a) else None
            rb = b[i] if i < len(b) else None
            if ra is None or rb is None or ra[1] != rb:
                ts = min(c.ts for c in (ra[1] if ra else None, rb) if c is not None)
                found.append((ts, gpu, Divergence(gpu, i, ra[1] if ra else None, rb, ra[0] if ra else None)))
                break
    return min(found, key=lambda f: (f[0], f[1]))[2] if found else None


def explain_lease_state(lineno: int, ls: LeaseState, before: GpuView | None, after: GpuView) -> str:
    """One folded lease state, for --explain."""
    change = (
        "view unchanged"
        if before == after
        else (
            f"view lease {before.lease_id if before else None} -> {after.lease_id}, epoch floor {after.epoch}, "
            f"cooldown until {after.cooldown_until:.3f}"
        )
    )
    return f"line {lineno} lease state {ls.lease_id} epoch {ls.epoch} {ls.state} at {ls.ts:.3f}: {change}"


def explain_step(lineno: int, ev: Telemetry, before: GpuView | None, d: Decision) -> str:
    """Human-readable account of one decision: the event, the view it met, why."""
    x = d.explain
    lines = [f"line {lineno} ts={ev.ts:.3f} event={ev.event_id}: {x.action.upper()}: {x.reason}"]
    if x.headroom:
        hr = " ".join(f"{k}={v:.3f}" for k, v in x.headroom.items())
        ph = " ".join(f"{k}={v:.3f}" for k, v in x.predicted_headroom.items())
        serving = ev.mem_used_bytes - ev.rollout_mem_bytes
        lines.append(
            f"  headroom {hr} | predicted {ph} | serving {serving / GiB:.2f} GiB, "
            f"free {x.free_mem_bytes / GiB:.2f} GiB of {ev.mem_total_bytes / GiB:.2f} GiB, "
            f"util {ev.gpu_util:.2f}"
        )
    lines.append("  view before: " + (orjson.dumps(before.to_dict()).decode() if before else "(none: first event)"))
    for c in d.commands:
        lines.append(
            f"  -> {c.kind} {c.lease_id} epoch {c.epoch} mem {c.mem_bytes / GiB:.2f} GiB "
            f"share {c.compute_share:.3f} until {c.expires_at:.3f} id {c.command_id}"
        )
    return "\n".join(lines)
