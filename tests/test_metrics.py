"""Health and Prometheus metrics: the exposition text parses with the same parser the agent
uses on serving engines, histograms are cumulative, and /healthz follows the health check."""

from __future__ import annotations

import urllib.error
import urllib.request

from rose.node.prometheus import parse, quantile
from rose.obs import metrics


def test_render_parses_and_histogram_is_cumulative():
    c = metrics.counter("rose_test_events_total", "events")
    c.inc(3, kind="grant")
    c.inc(kind="revoke")
    h = metrics.histogram("rose_test_latency_seconds", "latency")
    for v in (0.001, 0.003, 0.003, 0.2):
        h.observe(v)
    scrape = parse(metrics.render())
    assert scrape.values["rose_test_events_total"] == 4  # summed over label sets
    hist = scrape.histograms["rose_test_latency_seconds"]
    assert hist.cumulative == sorted(hist.cumulative) and hist.cumulative[-1] == 4
    assert 0.002 <= quantile(0.5, hist.bounds, hist.cumulative) <= 0.005


def test_metrics_and_health_endpoints():
    healthy = {"ok": True}
    metrics.counter("rose_test_up_total", "probe").inc()
    server = metrics.serve(0, health=lambda: healthy["ok"])
    port = server.server_address[1]
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "rose_test_up_total 1.0" in body
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).status == 200
        healthy["ok"] = False
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5)
            raise AssertionError("unhealthy service answered 200")
        except urllib.error.HTTPError as e:
            assert e.code == 503
    finally:
        server.shutdown()
