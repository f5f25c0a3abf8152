"""Prometheus exposition parsing and windowed serving figures (vLLM and SGLang names)."""

from __future__ import annotations

import http.server
import threading

import pytest

from rose.node import prometheus as prom

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


def sglang_text(ttft, tpot, total, queue=2, running=5) -> str:
    return (
        "# TYPE sglang:num_running_reqs gauge\n"
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
