"""`rose replay` on logs built from a real arrival trace: determinism, --diff, --explain,
--config what-ifs, malformed lines."""

from __future__ import annotations

import dataclasses

import numpy as np
import orjson
import pytest
from typer.testing import CliRunner

from rose.cli import app
from rose.config import GiB, PolicyConfig
from rose.contract.events import Latency, Telemetry
from rose.policy.replay import first_divergence, read_log, replay
from tests.conftest import TRACES
from tests.policy_examples import lease_state_record

T0 = 1_750_000_000.0
GPUS = {"az/0": 80, "az/1": 141, "az/2": 48}  # heterogeneous: GiB per GPU
runner = CliRunner()


def trace_telemetry(n_windows: int = 120) -> list[Telemetry]:
    """Telemetry of 3 GPUs serving the Azure conversation trace round robin, 0.5 s windows:
    p99 and KV memory follow the tokens that arrived over the last 2 s on that GPU."""
    from rose.sim.traces import load_trace

    path = TRACES / "azure_llm2023_conv.csv"
    if not path.exists():
        pytest.skip(f"trace {path} not found (set ROSE_TRACES)")
    t = load_trace(path)
    gpus = list(GPUS)
    window = np.floor(t.arrival_s / 0.5).astype(np.int64)
    keep = window < n_windows
    tokens = (t.prompt_tokens + t.output_tokens)[keep].astype(np.float64)
    gpu_of = np.arange(int(keep.sum())) % len(gpus)
    out = []
    for g, gpu in enumerate(gpus):
        per_window = np.bincount(window[keep][gpu_of == g], weights=tokens[gpu_of == g], minlength=n_windows)
        load = np.convolve(per_window, np.ones(4))[:n_windows].tolist()  # tokens of the last 2 s
        total = GPUS[gpu] * GiB
        for w in range(n_windows):
            frac = 0.12 + load[w] / 8000.0
            serving = min(int(total * 0.3 + load[w] * (2 << 20)), total)
            out.append(
                Telemetry(
                    event_id=f"{gpu}-{w}",
                    ts=T0 + 0.5 * w,
                    node=gpu.split("/")[0],
                    gpu=gpu,
                    pool="serving",
                    gpu_util=min(1.0, 0.2 + load[w] / 10000.0),
                    mem_total_bytes=total,
                    mem_used_bytes=serving,
                    rollout_mem_bytes=0,
                    latency_ms=Latency(600.0 * frac, 60.0 * frac * 0.95),
                    slo_ms=Latency(600.0, 60.0),
                    rps=float(load[w] / 1000.0),
                    queue_depth=0,
                )
            )
    out.sort(key=lambda e: (e.ts, e.gpu))
    return out


def record_line(topic: str, offset: int, value: dict, ts_ms: int) -> bytes:
    return orjson.dumps(
        {
            "topic": topic,
            "partition": 0,
            "offset": offset,
            "timestamp_ms": ts_ms,
            "key": value["gpu"],
            "headers": {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"},
            "value": value,
        }
    )


@pytest.fixture(scope="module")
def events():
    return trace_telemetry()


@pytest.fixture(scope="module")
def expected(events):
    cmds, _ = replay(list(enumerate(events, 1)), PolicyConfig())
    kinds = {c.kind for c in cmds}
    assert kinds == {"grant", "renew", "revoke"}, f"the trace should exercise every command kind, got {kinds}"
    return cmds


@pytest.fixture
def plain_log(tmp_path, events):
    p = tmp_path / "telemetry.ndjson"
    p.write_bytes(b"".join(orjson.dumps(e.to_dict()) + b"\n" for e in events))
    return p


def lease_state(epoch: int, state: str, ts: float = T0, gpu: str = "az/0") -> dict:
    return lease_state_record(gpu, epoch, state, ts, "x")


def write_record(path, events, commands, states=(lease_state(0, "expired"),)):
    """Topic by topic, as `rose record` writes it: the record times place lease states."""
    lines = [record_line("rose.telemetry", i, e.to_dict(), int(e.ts * 1000)) for i, e in enumerate(events)]
    lines += [record_line("rose.commands", i, c.to_dict(), int(c.ts * 1000)) for i, c in enumerate(commands)]
    lines += [record_line("rose.lease-state", i, s, int(s["ts"] * 1000)) for i, s in enumerate(states)]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def invoke(*args):
    r = runner.invoke(app, list(map(str, args)))
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r


def test_replay_is_byte_identical_across_runs_and_formats(tmp_path, plain_log, events, expected):
    a, b, c = tmp_path / "a.ndjson", tmp_path / "b.ndjson", tmp_path / "c.ndjson"
    assert invoke("replay", plain_log, "--out", a).exit_code == 0
    assert invoke("replay", plain_log, "--out", b).exit_code == 0
    rec = write_record(tmp_path / "rec.ndjson", events, expected)
    assert invoke("replay", rec, "--out", c).exit_code == 0
    data = a.read_bytes()
    assert data == b.read_bytes() == c.read_bytes()
    lines = data.splitlines()
    assert len(lines) == len(expected)
    assert [orjson.loads(x) for x in lines] == [cmd.to_dict() for cmd in expected]
    r = invoke("replay", plain_log)  # stdout is the same bytes
    assert r.stdout.encode() == data


def test_diff_passes_on_a_consistent_log_and_finds_an_injected_divergence(tmp_path, events, expected):
    ok = write_record(tmp_path / "ok.ndjson", events, expected)
    r = invoke("replay", ok, "--diff")
    assert r.exit_code == 0 and "no divergence" in r.stdout and r.stdout.count("\n") == 1

    bad = list(expected)
    i = next(k for k, c in enumerate(bad) if c.kind == "renew")
    bad[i] = dataclasses.replace(bad[i], mem_bytes=bad[i].mem_bytes + 1)
    r = invoke("replay", write_record(tmp_path / "bad.ndjson", events, bad), "--diff")
    assert r.exit_code == 1
    nth = sum(1 for c in expected[: i + 1] if c.gpu == expected[i].gpu)
    assert f"first divergence on gpu {expected[i].gpu}, its command #{nth}" in r.stdout
    assert "differs in: mem_bytes" in r.stdout

    dropped = expected[:-1]
    r = invoke("replay", write_record(tmp_path / "short.ndjson", events, dropped), "--diff")
    assert r.exit_code == 1 and "the log has no such command" in r.stdout


def test_lease_states_are_folded_in_at_their_record_time(tmp_path, events, expected):
    """An executor that already held epoch 7 raises the epoch floor; one that rejects the
    first lease ends it, so replay (like the live scheduler) does not renew it."""
    first = next(c for c in expected if c.gpu == "az/0" and c.kind == "grant")
    states = (lease_state(7, "active", T0 - 60), lease_state(8, "rejected", first.ts + 0.2))
    rec = write_record(tmp_path / "ls.ndjson", events, expected, states)
    r = invoke("replay", rec)
    got = [orjson.loads(x) for x in r.stdout.encode().splitlines()]
    az0 = [c for c in got if c["gpu"] == "az/0"]
    assert az0[0]["kind"] == "grant" and az0[0]["epoch"] == 8
    assert az0[1]["kind"] == "grant" and az0[1]["epoch"] == 9  # #8 rejected: never renewed, re-granted
    assert [c for c in got if c["gpu"] != "az/0"] == [c.to_dict() for c in expected if c.gpu != "az/0"]
    r = invoke("replay", rec, "--telemetry-only")
    assert [orjson.loads(x) for x in r.stdout.encode().splitlines()] == [c.to_dict() for c in expected]
    r = invoke("replay", rec, "--explain", "az/0")
    assert "lease state az/0#7 epoch 7 active" in r.stdout and "epoch floor 7" in r.stdout
    assert "lease state az/0#8 epoch 8 rejected" in r.stdout and "view lease az/0#8 -> None" in r.stdout


def test_first_divergence_picks_the_earliest_gpu_mismatch(expected):
    rec = list(enumerate(expected, 1))
    assert first_divergence(rec, expected) is None
    later = max(range(len(expected)), key=lambda k: expected[k].ts)
    earlier = min(range(len(expected)), key=lambda k: expected[k].ts)
    mutated = list(expected)
    for k in (later, earlier):
        mutated[k] = dataclasses.replace(mutated[k], reason="edited")
    d = first_divergence(rec, mutated)
    assert d.recorded == expected[earlier] and d.replayed == mutated[earlier]


def test_malformed_lines_are_reported_with_line_numbers_and_skipped(tmp_path, plain_log, expected):
    lines = plain_log.read_bytes().splitlines()
    missing = orjson.loads(lines[5])
    del missing["slo_ms"]
    bad_type = orjson.loads(lines[6])
    bad_type["latency_ms"]["tpot_p99"] = "fast"
    lines[5:7] = [orjson.dumps(missing), orjson.dumps(bad_type)]  # these two events are lost
    lines.insert(2, b"{not json")
    lines.insert(3, b"[1, 2]")
    p = tmp_path / "dirty.ndjson"
    p.write_bytes(b"\n".join(lines) + b"\n")
    r = invoke("replay", p, "--out", tmp_path / "o.ndjson")
    assert r.exit_code == 0
    err = r.stderr
    assert f"{p}:3: invalid JSON" in err
    assert f"{p}:4: expected JSON object" in err
    assert f"{p}:8: invalid telemetry: slo_ms: missing required field" in err
    assert f"{p}:9: invalid telemetry: latency_ms.tpot_p99: expected number" in err
    assert "4 lines skipped" in err and "Traceback" not in err
    assert (tmp_path / "o.ndjson").read_bytes().count(b"\n") > 0


def test_telemetry_the_scheduler_would_not_admit_is_skipped(tmp_path, events):
    skewed = record_line("rose.telemetry", 0, events[0].to_dict(), int(events[0].ts * 1000) + 3_600_000)
    wrong_key = orjson.loads(record_line("rose.telemetry", 1, events[1].to_dict(), int(events[1].ts * 1000)))
    wrong_key["key"] = "other/9"
    p = tmp_path / "adm.ndjson"
    p.write_bytes(skewed + b"\n" + orjson.dumps(wrong_key) + b"\n")
    seen = []
    log = read_log(p.read_bytes().splitlines(), PolicyConfig(), lambda n, m: seen.append((n, m)))
    assert log.telemetry == [] and [n for n, _ in seen] == [1, 2]
    assert "ts: event time" in seen[0][1] and "gpu: message key" in seen[1][1]


def test_explain_prints_each_event_of_the_gpu_with_its_view_and_reason(plain_log, events, expected):
    r = invoke("replay", plain_log, "--explain", "az/0")
    assert r.exit_code == 0
    out = r.stdout
    steps = [ln for ln in out.splitlines() if ln.startswith("line ")]
    assert len(steps) == sum(1 for e in events if e.gpu == "az/0")
    assert steps[0].endswith("NONE: headroom streak 1 < 3") or "NONE:" in steps[0]
    assert "view before: (none: first event)" in out and '"streak":' in out
    grants = [c for c in expected if c.gpu == "az/0" and c.kind == "grant"]
    assert out.count("GRANT:") == len(grants) and "-> grant az/0#1 epoch 1" in out
    assert "az/1" not in out.replace('"gpu":"az/0"', "")
    r = invoke("replay", plain_log, "--explain", "nope/0")
    assert r.exit_code == 2 and "--explain: no telemetry for gpu 'nope/0'" in r.stderr


def test_config_what_if_changes_the_decisions(tmp_path, plain_log, expected):
    toml = tmp_path / "whatif.toml"
    toml.write_text("[policy]\ngrant_headroom = 0.6\ncooldown_s = 1.0\n")
    r = invoke("replay", plain_log, "--config", toml)
    assert r.exit_code == 0
    got = [orjson.loads(x) for x in r.stdout.encode().splitlines()]
    assert got != [c.to_dict() for c in expected]
    assert all("0.60" in c["reason"] for c in got if c["kind"] == "grant")
    toml.write_text("[policy]\ngrant_headrom = 0.6\n")
    r = invoke("replay", plain_log, "--config", toml)
    assert r.exit_code == 2 and "policy.grant_headrom: unknown setting" in r.stderr
