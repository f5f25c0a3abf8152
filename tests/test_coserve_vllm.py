"""The demo's measured device on vLLM (`rose.demo.coserve`, server "vllm"): the trace replayed as
streaming token-id completions against vLLM's OpenAI server (the session's `vllm_server` on the
tiny checkpoint), the client's per-request figures in the status hash, and telemetry on the real
local Kafka whose p99s and KV-cache usage are what the agent's reader makes of the server's
/metrics."""

from __future__ import annotations

import importlib.util
import json
import math
import threading
import time

import pytest

from rose.contract.events import Telemetry
from rose.demo.capacity import Level, capacity_rps, peak_rps, replayed
from rose.demo.coserve import CoServed, CoserveSpec
from rose.executor.guard import FileLatencySource
from rose.kafka.consumer import read_all
from rose.node import agent
from rose.node import prometheus as prom
from rose.node.agent import LatencyCarry

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM installed")

RUN_S = 20.0
GPU = "real/0"


def measured_p99s(pages: list[tuple[float, str]]) -> set[tuple[float, float]]:
    """Every (TTFT, TPOT) p99 pair the agent's reader publishes for these scrapes, in order."""
    names = prom.metric_names("auto")
    keep = prom.all_names(names)
    carry, prev, out = LatencyCarry(), None, set()
    for t, text in pages:
        sc = prom.parse(text, keep)
        w = prom.window(sc, prev[1] if prev else None, t - prev[0] if prev else 0.0, names)
        prev = (t, sc)
        p = carry.update(w.ttft_p99_ms, w.tpot_p99_ms)
        if p is not None:
            out.add((p[0], p[1]))
    return out


@needs_vllm
@pytest.mark.timeout(900)  # the server's start (tests/conftest.py: vllm_server) counts here
def test_coserve_on_vllm(vllm_server, cfg, redis_client, traces_dir, tmp_path, monkeypatch):
    pages: list[tuple[float, str]] = []  # every /metrics page the device read, with when (monotonic)
    walls: list[float] = []  # the same, wall clock
    real_scrape = agent.scrape

    def recording_scrape(url: str, timeout_s: float) -> str:
        text = real_scrape(url, timeout_s)
        if url.endswith("/metrics"):
            pages.append((time.monotonic(), text))
            walls.append(time.time())
        return text

    monkeypatch.setattr(agent, "scrape", recording_scrape)
    spec = CoserveSpec(
        trace=str(traces_dir / "azure_llm2023_conv.csv"),
        gpu=GPU,
        speed=1.0,  # the trace as recorded: about 2 requests/s at its start
        server="vllm",
        url=vllm_server.url,
        model=vllm_server.model,
        latency_dir=str(tmp_path / "latency"),
        startup_timeout_s=30.0,
    )
    dev = CoServed(spec, cfg, redis_client)
    key = cfg.redis.key(spec.status_key)
    result: dict = {}
    th = threading.Thread(target=lambda: result.update(summary=dev.run()), daemon=True)
    t_start = time.monotonic()
    th.start()
    deadline = time.monotonic() + 60
    while redis_client.hget(key, "state") != b"serving":
        assert th.is_alive() and time.monotonic() < deadline, "the device did not start serving"
        time.sleep(0.2)
    time.sleep(RUN_S)
    dev.stop = True
    th.join(60)
    assert not th.is_alive()
    print(f"run {time.monotonic() - t_start:.1f} s")

    # the client: every request answered with the tokens it asked for, each in the summary
    st = {k.decode(): v.decode() for k, v in redis_client.hgetall(key).items()}
    assert st["state"] == "stopped" and st["server"] == "vllm" and st["server_url"] == vllm_server.url
    answered, submitted = int(st["answered"]), int(st["submitted"])
    assert int(st["wrong_length"]) == 0 and int(st["failed"]) == 0
    assert answered >= 10 and submitted - answered <= 8  # at most the few in flight at the stop
    summary, rows = json.loads(st["summary"]), json.loads(st["requests"])
    assert summary == result["summary"]
    assert summary["requests"] == len(rows) == answered == dev.served
    assert summary["with_rollout"]["requests"] + summary["without_rollout"]["requests"] == answered
    assert all(r[1] > 0 and r[2] >= 0 for r in rows)  # TTFT, mean TPOT (ms) as the client saw them

    # telemetry on Kafka: decodes, the server's p99s through the agent's reader, KV-cache usage 0..1
    evs = [Telemetry.from_dict(json.loads(m.value())) for m in read_all(cfg.kafka, [cfg.kafka.telemetry_topic])]
    evs = [e for e in evs if e.gpu == GPU]
    assert len(evs) >= RUN_S / cfg.telemetry.period_s / 2, len(evs)
    readable = measured_p99s(pages)
    for e in evs:
        lat = e.latency_ms
        assert all(math.isfinite(v) and v > 0 for v in (lat.ttft_p99, lat.tpot_p99))
        assert (lat.ttft_p99, lat.tpot_p99) in readable
        assert e.kv_cache_usage is not None and 0.0 <= e.kv_cache_usage <= 1.0
        assert (e.slo_ms.ttft_p99, e.slo_ms.tpot_p99) == (cfg.telemetry.slo_ttft_ms, cfg.telemetry.slo_tpot_ms)
    # the server's TTFT histogram counted every request answered between the first and the last page
    names = prom.metric_names("auto")
    first, last = (prom.parse(pages[i][1], prom.all_names(names)) for i in (0, -1))
    ttft = names["ttft"][0]
    seen = sum(walls[0] <= r[0] <= walls[-1] for r in rows)
    assert last.histograms[ttft].count - first.histograms[ttft].count >= seen > 0

    print(
        f"{answered} answered of {submitted} sent, client TTFT p99 {summary['without_rollout']['ttft_p99_ms']} ms, "
        f"TPOT p99 {summary['without_rollout']['tpot_p99_ms']} ms; {len(evs)} telemetry records, server TTFT p99 "
        f"{sorted({e.latency_ms.ttft_p99 for e in evs})} ms, TPOT p99 {sorted({e.latency_ms.tpot_p99 for e in evs})} "
        f"ms, KV-cache usage {sorted({e.kv_cache_usage for e in evs})}"
    )

    # the local guard got a measured window
    sample = FileLatencySource(spec.latency_dir)(GPU)
    assert sample is not None and (sample.latency_ms.ttft_p99, sample.latency_ms.tpot_p99) in readable


@needs_vllm
@pytest.mark.timeout(900)  # the server's start (tests/conftest.py: vllm_server) counts here
def test_the_device_measures_its_capacity_alone_and_scales_the_trace_to_it(vllm_server, cfg, redis_client, traces_dir):
    spec = CoserveSpec(
        trace=str(traces_dir / "azure_llm2023_conv.csv"),
        gpu="real/capacity",
        server="vllm",
        url=vllm_server.url,
        model=vllm_server.model,
        startup_timeout_s=30.0,
        peak_fraction=0.5,
        capacity_clients=(1, 2),
        capacity_level_s=3.0,
        replay_s=600.0,
        status_key="demo:coserve-capacity",
        measure_when_key="demo:measure-capacity-test",
    )
    dev = CoServed(spec, cfg, redis_client)
    recorded = dev.arrival.copy()
    key = cfg.redis.key(spec.status_key)
    redis_client.delete(cfg.redis.key(spec.measure_when_key))
    th = threading.Thread(target=dev.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 120
    while redis_client.hget(key, "state") != b"warm":  # started, and waits for the key to measure
        assert th.is_alive() and time.monotonic() < deadline, "the device did not get warm"
        time.sleep(0.2)
    assert redis_client.hget(key, "serving_load") is None
    redis_client.set(cfg.redis.key(spec.measure_when_key), 1)
    while redis_client.hget(key, "state") != b"serving":
        assert th.is_alive() and time.monotonic() < deadline, "the device did not start serving"
        time.sleep(0.2)
    dev.stop = True
    th.join(60)
    assert not th.is_alive()
    load = json.loads(redis_client.hget(key, "serving_load"))
    levels = load["levels"]
    assert levels[0]["clients"] == 1 and all(lv["requests"] > 0 and lv["rps"] > 0 for lv in levels)
    assert load["capacity_rps"] > 0 and load["fraction"] == 0.5 and load["slo_met_alone"] and load["held_back"] is None
    # the trace's course compressed into 600 s and thinned: its peak minute as recorded, at the
    # replay's speed and share, is half the measured capacity
    assert load["trace_peak_rps"] == round(peak_rps(recorded, 60.0), 4)
    sent = replayed(len(recorded), load["keep"], spec.seed)
    assert dev.arrival == pytest.approx((recorded[sent] - recorded[sent].min()) / load["speed"])
    assert load["speed"] == pytest.approx((recorded.max() - recorded.min()) / 600.0, rel=1e-4)
    assert load["trace_peak_rps"] * load["speed"] * load["keep"] == pytest.approx(0.5 * load["capacity_rps"], rel=1e-3)
    print(f"capacity {load['capacity_rps']} req/s, levels {levels}, speed ×{load['speed']}")
    assert load["capacity_rps"] == round(capacity_rps([Level(**lv) for lv in levels], *dev._slo()), 4)


def test_demo_runs_the_measured_device_on_vllm_with_the_vllm_engine(tmp_path):
    from rose.config import Config
    from rose.demo.run_setup import MEASURE_KEY, DemoOptions, DemoSetup

    def coserve_spec(opts: DemoOptions) -> CoserveSpec:
        argv = DemoSetup(Config(), opts)._argv()["coserve"]
        assert isinstance(argv, list)
        return CoserveSpec.from_json(argv[argv.index("--spec") + 1])

    spec = coserve_spec(DemoOptions(engine="vllm", model=str(tmp_path), report_dir=str(tmp_path / "r")))
    assert (spec.server, spec.model, spec.max_model_len) == ("vllm", str(tmp_path.resolve()), 512)
    assert spec.server_log == str((tmp_path / "r" / "logs").resolve())
    # scaled so the trace's peak is what the pool decision provisions for: 1 / (1 + headroom)
    assert (spec.peak_fraction, spec.peak_bin_s, spec.replay_s) == (round(1 / 1.3, 6), 60.0, 0.0)
    assert spec.measure_when_key == MEASURE_KEY
    assert coserve_spec(DemoOptions()).server == "torch" and coserve_spec(DemoOptions()).peak_fraction == 0
    assert coserve_spec(DemoOptions(engine="hf", model=str(tmp_path))).server == "torch"


def test_coserve_refuses_an_unknown_server_and_vllm_without_a_model():
    from rose.config import Config

    with pytest.raises(ValueError, match="server"):
        CoServed(CoserveSpec(trace="t.csv", server="sglang"), Config(), None)
    with pytest.raises(ValueError, match="model"):
        CoServed(CoserveSpec(trace="t.csv", server="vllm"), Config(), None)
    with pytest.raises(ValueError, match="peak_fraction"):
        CoServed(CoserveSpec(trace="t.csv", peak_fraction=0.5), Config(), None)
