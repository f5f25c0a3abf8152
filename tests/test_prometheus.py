"""Prometheus exposition parsing and windowed serving figures (vLLM and SGLang names).

tests/data/vllm-0.32-metrics-{idle,busy}.txt are the `vllm:` lines of two scrapes of a real vLLM
0.32 server (CPU build, the tiny random-init Qwen2 of tests/conftest.py): idle after two warm-up
requests, then mid-load with eight requests running (tests/test_agent_vllm.py's load)."""

from __future__ import annotations

import dataclasses
import http.server
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rose.node import prometheus as prom

DATA = Path(__file__).resolve().parent / "data"

BOUNDS = ["0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0", "2.5", "+Inf"]


def hist(name: str, counts: list[int], labels: str = 'model_name="m"', total_sum: float = 1.0) -> str:
    """Histogram lines in the exposition format from per-bucket (non-cumulative) counts."""
    lines = [f"# HELP {name} Histogram.", f"# TYPE {name} histogram"]
    cum = 0
    for le, c in zip(BOUNDS, counts):
        cum += c
        lines.append(f'{name}_bucket{{{labels},le="{le}"}} {float(cum)}')
    lines += [f"{name}_sum{{{labels}}} {total_sum}", f"{name}_count{{{labels}}} {float(cum)}"]
    return "\n".join(lines) + "\n"


def vllm_text(
    ttft: list[int],
    tpot: list[int],
    success: float,
    waiting: float = 3,
    running: float = 7,
    tpot_name: str = "vllm:time_per_output_token_seconds",
) -> str:
    return (
        "# HELP vllm:num_requests_running Number of requests currently running on GPU.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{model_name="m"}} {running}\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
        "# TYPE vllm:request_success_total counter\n"
        f'vllm:request_success_total{{finished_reason="stop",model_name="m"}} {success * 0.75}\n'
        f'vllm:request_success_total{{finished_reason="length",model_name="m"}} {success * 0.25}\n'
        + hist("vllm:time_to_first_token_seconds", ttft)
        + hist(tpot_name, tpot)
    )


def sglang_text(ttft, tpot, total, queue=2, running=5, token_usage: float | None = 0.28) -> str:
    usage = (
        ""
        if token_usage is None
        else (
            "# HELP sglang:token_usage The token usage.\n"
            "# TYPE sglang:token_usage gauge\n"
            f'sglang:token_usage{{model_name="m",engine_type="unified",tp_rank="0"}} {token_usage}\n'
        )
    )
    return (
        usage + "# TYPE sglang:num_running_reqs gauge\n"
        f'sglang:num_running_reqs{{model_name="m",engine_type="unified",tp_rank="0"}} {running}\n'
        "# TYPE sglang:num_queue_reqs gauge\n"
        f'sglang:num_queue_reqs{{model_name="m",engine_type="unified",tp_rank="0"}} {queue}\n'
        "# TYPE sglang:num_requests_total counter\n"
        f'sglang:num_requests_total{{model_name="m"}} {total}\n'
        + hist("sglang:time_to_first_token_seconds", ttft)
        + hist("sglang:inter_token_latency_seconds", tpot)
    )


NAMES = prom.metric_names("auto")


def test_vllm_window_from_bucket_deltas():
    a = prom.parse(vllm_text([0, 0, 10, 0, 0, 0, 0, 0, 0], [100, 0, 0, 0, 0, 0, 0, 0, 0], success=10))
    # the window adds 100 TTFT samples: 98 in (0.05, 0.1], 2 in (0.25, 0.5]
    b = prom.parse(
        vllm_text([0, 0, 10, 98, 0, 2, 0, 0, 0], [100, 0, 900, 100, 0, 0, 0, 0, 0], success=60, waiting=4, running=9)
    )
    w = prom.window(b, a, 2.0, NAMES)
    # rank 0.99*100 = 99 lies in (0.25, 0.5]: 98 below, 2 inside -> 0.25 + 0.25 * (99-98)/2
    assert w.ttft_p99_ms == pytest.approx(375.0)
    # TPOT window: 900 in (0.025, 0.05], 100 in (0.05, 0.1] -> rank 990 -> 0.05 + 0.05 * 90/100
    assert w.tpot_p99_ms == pytest.approx(95.0)
    assert w.rps == pytest.approx(25.0) and w.queue_depth == 4 and w.running == 9


def test_inter_token_latency_name_and_sglang():
    a = prom.parse(sglang_text([1] + [0] * 8, [0] * 9, total=5))
    b = prom.parse(sglang_text([1, 0, 0, 0, 0, 0, 0, 0, 10], [0, 50] + [0] * 7, total=15, queue=6))
    w = prom.window(b, a, 1.0, prom.metric_names("sglang"))
    assert w.ttft_p99_ms == pytest.approx(2500.0)  # +Inf bucket -> highest finite bound (as PromQL)
    assert w.tpot_p99_ms == pytest.approx(10.0 + 15.0 * (49.5 / 50))
    assert w.rps == 10.0 and w.queue_depth == 6 and w.running == 5
    v = prom.parse(vllm_text([0] * 9, [0] * 9, 1, tpot_name="vllm:inter_token_latency_seconds"))
    v2 = prom.parse(vllm_text([0] * 9, [0, 0, 0, 4] + [0] * 5, 1, tpot_name="vllm:inter_token_latency_seconds"))
    assert prom.window(v2, v, 1.0, prom.metric_names("vllm")).tpot_p99_ms == pytest.approx(50 + 50 * 3.96 / 4)


def test_counter_reset_counts_since_restart():
    before = prom.parse(vllm_text([0, 0, 500, 0, 0, 0, 0, 0, 0], [0] * 9, success=1000))
    after = prom.parse(vllm_text([0, 0, 0, 0, 0, 0, 4, 0, 0], [0] * 9, success=8))  # engine restarted
    w = prom.window(after, before, 2.0, NAMES)
    assert w.ttft_p99_ms == pytest.approx(500 + 500 * 3.96 / 4)  # only the new process's samples
    assert w.rps == pytest.approx(4.0)


def test_missing_metrics_and_empty_windows():
    only_gauges = prom.parse('vllm:num_requests_waiting{model_name="m"} 2\n')
    w = prom.window(only_gauges, None, 0.0, NAMES)
    assert (w.ttft_p99_ms, w.tpot_p99_ms, w.rps, w.queue_depth, w.running) == (None, None, None, 2, None)
    t = vllm_text([0, 5] + [0] * 7, [0] * 9, 3)
    w = prom.window(prom.parse(t), prom.parse(t), 1.0, NAMES)  # nothing happened in the window
    assert w.ttft_p99_ms is None and w.rps == 0.0
    first = prom.window(prom.parse(t), None, 0.0, NAMES)  # first scrape: no window yet
    assert first.ttft_p99_ms is None and first.rps is None


def test_parser_details_and_errors():
    s = prom.parse('# comment\nm{a="x\\"y,z}",b="2"} 1.5 1700000000000\nm{a="q"} 2\nn 3\nnan_metric NaN\n')
    assert s.values == {"m": 3.5, "n": 3.0}
    for bad, where in (
        ("m{a=1} 2", "line 1"),
        ("ok 1\nm", "line 2"),
        ('m{a="x"} abc', "line 1"),
        ("m 1 2 3", "line 1"),
    ):
        with pytest.raises(prom.ExpositionError, match=where):
            prom.parse(bad)
    with pytest.raises(ValueError, match="unknown engine"):
        prom.metric_names("tgi")
    custom = prom.metric_names("vllm", {"ttft": "tgi_request_ttft_seconds, other"})
    assert custom["ttft"] == ("tgi_request_ttft_seconds", "other") and custom["tpot"][0].startswith("vllm:")


class _Metrics(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(type(self).body)

    def log_message(self, *a):
        pass


@pytest.fixture
def metrics_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}/metrics"
    srv.shutdown()
    srv.server_close()


def test_scrape_a_local_http_server(metrics_server):
    from rose.node.agent import scrape

    _srv, url = metrics_server
    _Metrics.body = vllm_text([0, 0, 10, 0, 0, 0, 0, 0, 0], [0] * 9, success=10).encode()
    a = prom.parse(scrape(url, 2.0))
    _Metrics.body = vllm_text([0, 0, 10, 100, 0, 0, 0, 0, 0], [0] * 9, success=30).encode()
    b = prom.parse(scrape(url, 2.0))
    w = prom.window(b, a, 0.5, NAMES)
    assert w.ttft_p99_ms == pytest.approx(50 + 50 * 99 / 100) and w.rps == pytest.approx(40.0)


def test_keep_skips_other_series_with_the_same_result():
    text = 'other_metric{x="1"} 5\n' + vllm_text([0, 3] + [0] * 7, [0] * 9, 2)
    full, kept = prom.parse(text), prom.parse(text, prom.all_names(NAMES))
    assert "other_metric" in full.values and "other_metric" not in kept.values
    assert kept.histograms["vllm:time_to_first_token_seconds"] == full.histograms["vllm:time_to_first_token_seconds"]
    assert kept.values["vllm:num_requests_waiting"] == 3


def recorded(name: str) -> str:
    return (DATA / f"vllm-0.32-metrics-{name}.txt").read_text()


def test_recorded_vllm_032_pages():
    """The names vLLM 0.32 reports, read from its own page: a window between the idle and the busy
    scrape (16 first tokens and 441 inter-token gaps in between)."""
    idle, busy = prom.parse(recorded("idle"), prom.all_names(NAMES)), prom.parse(recorded("busy"))
    assert "vllm:time_per_output_token_seconds" not in busy.histograms  # gone in 0.32: only the fallback
    w = prom.window(busy, idle, 2.0, NAMES)
    assert w.missing == ()
    # TTFT: 9 of 16 below 0.5 s, 7 in (0.5, 0.75] -> rank 15.84 -> 0.5 + 0.25 * 6.84 / 7
    assert w.ttft_p99_ms == pytest.approx(1000 * (0.5 + 0.25 * (0.99 * 16 - 9) / 7))
    # inter-token: 431 of 441 below 75 ms, 8 in (75, 100] ms -> rank 436.59
    assert w.tpot_p99_ms == pytest.approx(75 + 25 * (0.99 * 441 - 431) / 8)
    assert w.rps == pytest.approx((10 - 2) / 2.0)  # request_success_total summed over finish reasons
    assert (w.running, w.queue_depth) == (8, 0)
    assert w.kv_cache_usage == pytest.approx(0.003907203907203893)  # 8 requests x 2 blocks of 128 tokens, of 4095
    first = prom.window(idle, None, 0.0, NAMES)
    assert first.kv_cache_usage == 0.0 and first.ttft_p99_ms is None  # an idle engine: 0, not absent
    only_vllm = prom.window(busy, idle, 2.0, prom.metric_names("vllm"))
    assert only_vllm == w


def renamed(text: str, **names: str) -> str:
    for old, new in names.items():
        text = text.replace(old, new)
    return text


def test_older_vllm_names_are_read_when_the_current_ones_are_absent():
    idle, busy = recorded("idle"), recorded("busy")
    current = prom.window(prom.parse(busy), prom.parse(idle), 2.0, NAMES)
    old = {"vllm:inter_token_latency_seconds": "vllm:time_per_output_token_seconds"}
    old_kv = {"vllm:kv_cache_usage_perc": "vllm:gpu_cache_usage_perc"}
    w = prom.window(prom.parse(renamed(busy, **old, **old_kv)), prom.parse(renamed(idle, **old, **old_kv)), 2.0, NAMES)
    assert w == current
    # both on one page (a release that reports the old name beside the new): the current name wins
    extra = '\nvllm:gpu_cache_usage_perc{engine="0"} 0.9\n'
    both = prom.window(
        prom.parse(busy + renamed(busy, **old) + extra), prom.parse(idle + renamed(idle, **old) + extra), 2.0, NAMES
    )
    assert both.kv_cache_usage == current.kv_cache_usage
    assert both.tpot_p99_ms == current.tpot_p99_ms
    a = prom.parse(vllm_text([0] * 9, [0] * 9, 1) + hist("vllm:inter_token_latency_seconds", [0] * 9))
    b = prom.parse(
        vllm_text([0] * 9, [0, 0, 0, 0, 0, 0, 0, 5, 0], 1) + hist("vllm:inter_token_latency_seconds", [0, 5] + [0] * 7)
    )
    assert prom.window(b, a, 1.0, prom.metric_names("vllm")).tpot_p99_ms == pytest.approx(10 + 15 * 4.95 / 5)


def test_kv_cache_usage_gauge():
    def kv(text: str, engine: str = "auto") -> float | None:
        return prom.window(prom.parse(text), None, 0.0, prom.metric_names(engine)).kv_cache_usage

    # several engines behind one page (data parallel): the fullest, never the sum
    page = 'vllm:kv_cache_usage_perc{engine="0"} 0.25\nvllm:kv_cache_usage_perc{engine="1"} 0.75\n'
    assert kv(page) == 0.75 and prom.parse(page).values["vllm:kv_cache_usage_perc"] == 1.0
    assert kv('vllm:kv_cache_usage_perc{engine="0"} 1.0\n') == 1.0
    assert kv('vllm:num_requests_running{engine="0"} 1\n') is None  # not reported: None, never 0
    assert kv("vllm:kv_cache_usage_perc 57\n") is None  # a percentage is no fraction: left out
    assert kv("vllm:kv_cache_usage_perc -0.1\n") is None
    assert kv("vllm:kv_cache_usage_perc NaN\n") is None
    assert kv(sglang_text([0] * 9, [0] * 9, 1, token_usage=0.28), "sglang") == 0.28
    assert kv(sglang_text([0] * 9, [0] * 9, 1, token_usage=0.28)) == 0.28
    assert kv(sglang_text([0] * 9, [0] * 9, 1, token_usage=None), "sglang") is None
    assert kv(page, "sglang") is None  # an engine's names only
    assert kv("my_kv_ratio 0.5\n", "vllm") is None
    custom = prom.metric_names("vllm", {"kv_cache": "my_kv_ratio"})
    assert custom["kv_cache"] == ("my_kv_ratio",)
    assert prom.window(prom.parse("my_kv_ratio 0.5\n"), None, 0.0, custom).kv_cache_usage == 0.5
    assert "kv_cache" in prom.ROLES and all(set(r) == set(prom.ROLES) for r in prom.ENGINES.values())


@settings(max_examples=200, deadline=None)
@given(
    engine=st.sampled_from(["vllm", "sglang", "auto"]),
    present=st.lists(st.booleans(), min_size=4, max_size=4),
    values=st.lists(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=3), min_size=4, max_size=4),
    counts=st.lists(st.lists(st.integers(0, 5), min_size=9, max_size=9), min_size=4, max_size=4),
)
def test_first_present_candidate_wins(engine, present, values, counts):
    """Per role the reader takes the first candidate name on the page, as if the others were not there:
    KV usage as that gauge's largest value over label sets, the p99 from that histogram alone."""
    names = prom.metric_names(engine)
    kv_names, tpot_names = names["kv_cache"], names["tpot"]
    on = [n for n, p in zip(kv_names, present) if p]
    page = "".join(
        f'{n}{{engine="{k}"}} {v!r}\n' for n, vs in zip(kv_names, values) if n in on for k, v in enumerate(vs)
    )
    w = prom.window(prom.parse(page), None, 0.0, names)
    assert w.kv_cache_usage == (max(values[kv_names.index(on[0])]) if on else None)

    hon = [n for n, p in zip(tpot_names, present) if p]
    before = "".join(hist(n, [0] * 9) for n in hon)
    after = "".join(hist(n, c) for n, c in zip(tpot_names, counts) if n in hon)
    w = prom.window(prom.parse(after), prom.parse(before), 1.0, names)
    if not hon:
        assert w.tpot_p99_ms is None and "tpot" in w.missing
        return
    first = hon[0]
    alone = prom.window(
        prom.parse(hist(first, counts[tpot_names.index(first)])),
        prom.parse(hist(first, [0] * 9)),
        1.0,
        {**names, "tpot": (first,)},
    )
    assert w.tpot_p99_ms == alone.tpot_p99_ms and "tpot" not in w.missing


def test_the_agent_publishes_kv_cache_usage_when_the_engine_reports_it(tmp_path):
    """`run_nvml` over two engines' pages served by HTTP: the recorded vLLM 0.32 pages (KV usage
    reported) and synthetic ones without the gauge. Only the first GPU's events carry the field."""
    import json

    import jsonschema

    from rose.contract.events import Telemetry
    from tests.test_agent import REPO, Collect
    from tests.test_agent_nvml import Pages, agent_cfg, run_agent

    servers = []

    def serve(pages: list[str]):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Pages)
        srv.pages, srv.served = pages, 0
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}/metrics", srv

    try:
        url0, real = serve([recorded("idle"), recorded("busy"), recorded("busy")])
        url1, _ = serve([vllm_text([0, 1] + [0] * 7, [1] + [0] * 8, 1), vllm_text([0, 2] + [0] * 7, [2] + [0] * 8, 2)])
        cfg = agent_cfg()
        cfg = dataclasses.replace(cfg, telemetry=dataclasses.replace(cfg.telemetry, engine="auto"))
        pub = Collect()
        run_agent(cfg, [url0, url1], real, tmp_path, pub)
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()
    schema = json.loads((REPO / "schemas" / "rose.telemetry.v1.json").read_text())
    for d in pub.events:
        jsonschema.validate(d, schema)
    by_gpu = {g: [Telemetry.from_dict(d) for d in pub.events if d["gpu"] == g] for g in ("n/0", "n/1")}
    assert len(by_gpu["n/0"]) == 2 and len(by_gpu["n/1"]) >= 1
    assert [e.kv_cache_usage for e in by_gpu["n/0"]] == [pytest.approx(0.003907203907203893)] * 2
    assert by_gpu["n/0"][0].latency_ms.ttft_p99 == pytest.approx(1000 * (0.5 + 0.25 * (0.99 * 16 - 9) / 7))
    assert all(e.kv_cache_usage is None for e in by_gpu["n/1"])
    assert all("kv_cache_usage" not in d for d in pub.events if d["gpu"] == "n/1")
