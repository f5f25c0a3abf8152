"""Golden replay: two recorded logs (`rose record` lines) and the commands `rose replay` derives
from them, stored under tests/data/golden/. Each log exercises every command kind (grant,
renew, throttle to share 0 and back, revoke), lease states folded at their record time, and
lines and events the policy ignores or the reader skips; `gang` runs with `policy.group_size`
2 (granted all or none, paused, resumed and revoked together, a member ending its gang).

The replayed commands must equal the stored ones byte for byte: command ids are hashes of
their cause (event id, kind, GPU, epoch), times are the events' own, so nothing varies between
runs. The stored logs are what `build_log` writes; after an intended change of the policy,
`python -m tests.test_golden_replay` rewrites the expected commands (and the logs).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from typer.testing import CliRunner

from rose.cli import app
from rose.config import GiB, PolicyConfig
from rose.contract.events import Latency, Telemetry
from rose.policy.core import Arrival, Batch, SchedulingCore
from rose.policy.replay import encode_commands, read_log, replay
from tests.policy_examples import lease_state_record

DATA = Path(__file__).parent / "data" / "golden"
T0 = 1_750_000_000.0
SLO = Latency(ttft_p99=1000.0, tpot_p99=100.0)
TOPIC = "rose.telemetry"
STATES = "rose.lease-state"


class LogBuilder:
    """`rose record` lines in time order: telemetry, lease states, recorded commands, and lines
    the reader skips. Event ids are `<gpu>-<n>` with n counting that GPU's events."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self.count: Counter[str] = Counter()
        self.offsets: Counter[str] = Counter()
        self.last_ts: dict[str, float] = {}

    def record(self, topic: str, value: dict | None, ts: float, key: str | None, **extra: object) -> None:
        line: dict[str, object] = {
            "topic": topic,
            "partition": 0,
            "offset": self.offsets[topic],
            "timestamp_ms": int(round(ts * 1000)),
            "key": key,
            "headers": {},
        }
        line.update(extra)
        if "value_raw" not in extra:
            line["value"] = value
        self.offsets[topic] += 1
        self.lines.append(orjson.dumps(line))

    def telemetry(
        self,
        gpu: str,
        ts: float,
        lat: float = 0.2,
        mem_gib: float = 30,
        total_gib: float = 80,
        rollout_gib: float = 0,
        event_id: str | None = None,
        **value_edits: object,
    ) -> dict:
        """One window: p99 at `lat` of the SLO (tpot at half that), serving memory `mem_gib`."""
        if event_id is None:
            event_id = f"{gpu}-{self.count[gpu]}"
            self.count[gpu] += 1
        total, rollout = int(total_gib * GiB), int(rollout_gib * GiB)
        value = Telemetry(
            event_id=event_id,
            ts=ts,
            node=gpu.split("/")[0],
            gpu=gpu,
            pool="serving",
            gpu_util=0.5,
            mem_total_bytes=total,
            mem_used_bytes=int(mem_gib * GiB) + rollout,
            rollout_mem_bytes=rollout,
            latency_ms=Latency(SLO.ttft_p99 * lat, SLO.tpot_p99 * lat / 2),
            slo_ms=SLO,
            rps=4.0,
            queue_depth=2,
        ).to_dict()
        value.update(value_edits)
        self.record(TOPIC, value, ts, gpu)
        self.last_ts[gpu] = ts
        return value

    def lease_state(self, gpu: str, epoch: int, state: str, ts: float) -> None:
        self.record(STATES, lease_state_record(gpu, epoch, state, ts, f"cmd-{gpu}-{epoch}"), ts, gpu)

    def calm(self, gpus: list[str], ts: float, n: int, step: float = 0.5, **kw: Any) -> float:
        """n windows of every GPU in `gpus`, interleaved; the time after the last."""
        for _ in range(n):
            for g in gpus:
                self.telemetry(g, ts, **kw)
            ts += step
        return ts

    def noise(self, ts: float) -> None:
        """Lines `rose replay` skips or does not decide on: each one is reported, none changes a view."""
        self.lines.append(b"")
        self.lines.append(b"{not json")
        self.lines.append(b"[1, 2, 3]")
        self.record("rose.dlq", {"reason": "anything"}, ts, "x/0")  # another topic: not replayed
        self.record(TOPIC, None, ts, "x/0")  # a tombstone
        self.record(TOPIC, None, ts, "x/0", value_raw="AAEC")  # a value that is not JSON
        bad = Telemetry(
            event_id="bad-1",
            ts=ts,
            node="x",
            gpu="x/0",
            pool="serving",
            gpu_util=0.5,
            mem_total_bytes=80 * GiB,
            mem_used_bytes=90 * GiB,  # more than the total: the decoder rejects it
            rollout_mem_bytes=0,
            latency_ms=Latency(1.0, 1.0),
            slo_ms=SLO,
            rps=1.0,
            queue_depth=0,
        ).to_dict()
        self.record(TOPIC, bad, ts, "x/0")


def build_solo() -> LogBuilder:
    """One-GPU leases (group_size 1) on GPUs a/0, a/1, b/0, b/1, z/9."""
    b = LogBuilder()
    t = T0
    b.lease_state("z/9", 7, "active", t - 30)  # an executor already held epoch 7 on a GPU not seen yet
    b.lease_state("y/5", 3, "revoked", t - 20)  # a GPU that never reports telemetry
    b.noise(t)
    # a/0: calm -> grant, renews; a spike pauses (throttle 0), calm resumes (throttle > 0)
    t = b.calm(["a/0", "a/1"], t, 10)
    b.telemetry("a/0", t, lat=0.95)  # pause
    b.telemetry("a/1", t, rollout_gib=12)
    b.telemetry("a/0", t, lat=0.2, event_id=f"a/0-{b.count['a/0'] - 1}")  # the same event again: duplicate
    b.telemetry("a/0", t - 1.0, lat=0.2)  # out of order: stale
    b.telemetry("a/0", t, lat=0.2)  # same time as the last: stale
    t = b.calm(["a/0", "a/1"], t + 0.5, 6, rollout_gib=12)
    # the reader's rules: unusual but valid numbers take the checked path; inadmissible records are skipped
    b.telemetry("a/1", t, mem_total_bytes=float(80 * GiB), kv_cache_usage=0.25)
    t += 0.5
    skew = b.telemetry("a/0", t)
    b.record(TOPIC, dict(skew, event_id="a/0-skewed"), t + 3600, "a/0")  # record time an hour away: dlq
    b.record(TOPIC, dict(skew, event_id="a/0-wrong-key"), t, "a/1")  # key of another GPU: dlq
    t += 0.5
    # a/0: memory pressure revokes (cooldown 10 s); calm in the cooldown grants nothing, then a re-grant
    b.telemetry("a/0", t, mem_gib=78)
    t = b.calm(["a/0"], t + 0.5, 30)
    # a/0: a rising trend pauses before the SLO is crossed; paused 60 s, it is revoked
    for lat in (0.3, 0.45, 0.62):
        b.telemetry("a/0", t, lat=lat)
        t += 0.5
    t = b.calm(["a/0"], t, 125, lat=0.85)
    # a/0: KV growth revokes
    t = b.calm(["a/0"], t, 40)
    for mem in (30, 36, 42):
        b.telemetry("a/0", t, mem_gib=mem)
        t += 0.5
    # a/1: its executor rejects lease a/1#1, then reports a revoke the view did not know of: cooldown
    b.lease_state("a/1", 1, "active", T0 + 1.2)
    b.lease_state("a/1", 1, "rejected", t)
    t = b.calm(["a/1"], t + 0.25, 4)
    b.lease_state("a/1", 2, "revoked", t)
    t = b.calm(["a/1"], t + 0.25, 30)
    # b/0: a lease expires without renewal (telemetry stops for 8 s); its executor's word comes later
    t = b.calm(["b/0"], t, 4)
    t = b.calm(["b/0"], t + 8, 4)
    b.lease_state("b/0", 1, "expired", t)
    t = b.calm(["b/0"], t, 2)
    # b/1: too little memory to lend; z/9 starts from its executor's epoch floor
    t = b.calm(["b/1"], t, 5, mem_gib=71)
    t = b.calm(["z/9"], t, 4)
    b.noise(t)
    return b


def build_gang() -> LogBuilder:
    """Gang leases of 2 GPUs (group_size 2) on nodes g (3 GPUs), h (1 GPU) and k (2 GPUs)."""
    b = LogBuilder()
    t = T0
    b.noise(t)
    # g/0 + g/1 granted together; h/0 alone never is; g/2 qualifies too but has no free partner
    t = b.calm(["g/0", "g/1", "h/0"], t, 4)
    t = b.calm(["g/0", "g/1", "g/2", "h/0"], t, 6)
    # a spike on g/1 pauses both; calm on g/0 alone resumes nothing (it renews while it waits)
    b.telemetry("g/1", t, lat=0.95)
    b.telemetry("g/1", t, lat=0.2, event_id=f"g/1-{b.count['g/1'] - 1}")  # duplicate
    b.telemetry("g/1", t - 0.5, lat=0.2)  # stale
    t += 0.5
    for _ in range(8):
        b.telemetry("g/0", t)
        b.telemetry("g/1", t, lat=0.95)
        t += 0.5
    # once both would resume, both resume at one share
    t = b.calm(["g/0", "g/1"], t, 6)
    # memory pressure on g/0 revokes both; the cooldown keeps them out, g/2 still has no partner
    b.telemetry("g/0", t, mem_gib=78)
    t = b.calm(["g/0", "g/1", "g/2"], t + 0.5, 8)
    t = b.calm(["g/0", "g/1", "g/2"], t, 20)
    # g/2's lease ends without renewal (its telemetry stops): its next event ends the gang
    t = b.calm(["g/0", "g/1"], t, 14)
    t = b.calm(["g/0", "g/1", "g/2"], t, 8)
    # k: two GPUs at different loads share the smaller share; a trend pause, then a pause long
    # enough to revoke (the member revoked ends its partner's lease too)
    t = b.calm(["k/0"], t, 1)
    for _ in range(4):
        b.telemetry("k/0", t)
        b.telemetry("k/1", t, lat=0.6)
        t += 0.5
    t = b.calm(["k/0", "k/1"], t, 4)
    for lat in (0.3, 0.45, 0.62):
        b.telemetry("k/1", t, lat=lat)
        b.telemetry("k/0", t)
        t += 0.5
    t = b.calm(["k/0", "k/1"], t, 62, step=1.0, lat=0.85)
    t = b.calm(["k/0", "k/1"], t, 30)
    # the executor rejects a member's lease: the next event of the other revokes its own, and the gang forms again
    b.lease_state("k/0", 2, "rejected", t)
    t = b.calm(["k/0", "k/1"], t + 0.25, 10)
    b.telemetry("k/1", t, lat=0.95)
    t = b.calm(["k/0", "k/1"], t + 0.5, 10)
    # g's leases ran out while it was silent; its executor reports g/1 revoked: g/0 and g/2 pair up
    b.lease_state("g/1", 2, "revoked", t)
    t = b.calm(["g/0", "g/1", "g/2"], t + 0.25, 6)
    b.noise(t)
    return b


# serving's memory peak held 5 s, not 120: the logs' memory-pressure events are followed by
# re-grants after the cooldown, which a peak held longer would rule out for the rest of a log
SCENARIOS: dict[str, tuple[PolicyConfig, Callable[[], LogBuilder]]] = {
    "solo": (PolicyConfig(kv_peak_hold_s=5.0), build_solo),
    "gang": (PolicyConfig(group_size=2, kv_peak_hold_s=5.0), build_gang),
}

# what each log exercises, pinned so a change of the builder cannot quietly drop a case:
# commands per kind (throttle split into pause and resume), telemetry lines skipped by the
# reader, and events decide() ignored (stale or duplicate)
COVERAGE = {
    "solo": {"grant": 9, "renew": 25, "pause": 2, "resume": 1, "revoke": 3, "gangs": 0, "skipped": 10, "ignored": 3},
    "gang": {"grant": 14, "renew": 58, "pause": 6, "resume": 4, "revoke": 6, "gangs": 7, "skipped": 8, "ignored": 2},
}


def log_path(name: str) -> Path:
    return DATA / f"{name}.log.ndjson"


def commands_path(name: str) -> Path:
    return DATA / f"{name}.commands.ndjson"


def replayed(name: str) -> tuple[bytes, Counter[str]]:
    """The commands `rose replay` derives from the stored log, and what it counted on the way."""
    cfg = SCENARIOS[name][0]
    seen: Counter[str] = Counter()
    log = read_log(log_path(name).read_bytes().splitlines(), cfg, lambda n, m: seen.update(["skipped"]))
    commands, views = replay(log.telemetry, cfg, None, log.lease_states, log.record_ms)
    for c in commands:
        seen[c.kind if c.kind != "throttle" else "pause" if c.compute_share == 0.0 else "resume"] += 1
    seen["gangs"] = len({c.group_id for c in commands if c.group_id})
    seen["ignored"] = sum(v.ignored_stale for v in views.values())
    return encode_commands(commands), seen


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_stored_log_is_the_builders(name):
    lines = SCENARIOS[name][1]().lines
    assert log_path(name).read_bytes() == b"\n".join(lines) + b"\n"


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_replay_is_byte_identical_to_the_stored_commands(name):
    data, seen = replayed(name)
    expected = commands_path(name).read_bytes()
    if data != expected:
        got, want = data.splitlines(), expected.splitlines()
        i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        pytest.fail(
            f"{name}: {len(got)} commands replayed, {len(want)} stored; first difference at command #{i + 1}:\n"
            f"  replayed: {got[i] if i < len(got) else b'(none)'!r}\n  stored:   {want[i] if i < len(want) else b'(none)'!r}"
        )
    assert {k: seen[k] for k in COVERAGE[name]} == COVERAGE[name]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_held_batches_as_the_scheduler_applies_them_give_the_stored_bytes(name):
    """The stored log through `SchedulingCore.apply` the scheduler's way: each event admitted
    by its record time and key and decided in a held batch, its views handed back as committed,
    every lease state in the batch of its GPU's first event recorded at or after it."""
    cfg = SCENARIOS[name][0]
    log = read_log(log_path(name).read_bytes().splitlines(), cfg, lambda n, m: None)
    pending = sorted(log.lease_states, key=lambda x: log.record_ms[x[0]])
    core = SchedulingCore(cfg)
    commands = []
    for lineno, ev in log.telemetry:
        t = log.record_ms[lineno]
        seen = [ls for n, ls in pending if ls.gpu == ev.gpu and log.record_ms[n] <= t]
        pending = [(n, ls) for n, ls in pending if not (ls.gpu == ev.gpu and log.record_ms[n] <= t)]
        applied = core.apply(Batch(lease_states=seen, telemetry=(Arrival(ev, t, ev.gpu.encode()),), hold=True))
        assert applied.admitted == (ev,)
        core.apply(Batch(committed=applied.views))
        commands += applied.commands
    assert encode_commands(commands) == commands_path(name).read_bytes()


def test_rose_replay_cli_writes_the_same_bytes(tmp_path):
    toml = tmp_path / "gang.toml"
    toml.write_text("[policy]\ngroup_size = 2\nkv_peak_hold_s = 5.0\n")
    out = tmp_path / "out.ndjson"
    r = CliRunner().invoke(app, ["replay", str(log_path("gang")), "--config", str(toml), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert out.read_bytes() == commands_path("gang").read_bytes()


def write_golden() -> None:
    """Rewrite the stored logs and, from the current policy, their expected commands."""
    DATA.mkdir(parents=True, exist_ok=True)
    for name, (_, build) in SCENARIOS.items():
        log_path(name).write_bytes(b"\n".join(build().lines) + b"\n")
        data, seen = replayed(name)
        commands_path(name).write_bytes(data)
        print(f"{name}: {dict(seen)}", file=sys.stderr)


if __name__ == "__main__":
    write_golden()
