"""Prometheus metrics and health for every ROSE service, without a dependency.

A process-wide registry of counters, gauges and histograms, rendered in the Prometheus
text exposition format (v0.0.4) by a tiny HTTP server on `/metrics`; `/healthz` answers
200 while the service's health check passes, 503 otherwise.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_lock = threading.Lock()
_metrics: dict[str, _Metric] = {}

LATENCY_BUCKETS_S = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.035,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)  # dense around the 20 ms decision goal, so a p99 read from it means something


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(
        f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
        for k, v in sorted(labels.items())
    )
    return "{" + inner + "}"


class _Metric:
    kind = ""

    def __init__(self, name: str, help_: str):
        self.name, self.help = name, help_
        self._values: dict[tuple, float] = {}

    def _key(self, labels: dict[str, str]) -> tuple:
        return tuple(sorted(labels.items()))

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        for key, v in sorted(self._values.items()):
            lines.append(f"{self.name}{_labels(dict(key))} {v}")
        return lines

    def value(self, **labels) -> float:
        return self._values.get(self._key(labels), 0.0)


class Counter(_Metric):
    kind = "counter"

    def inc(self, n: float = 1.0, **labels) -> None:
        k = self._key(labels)
        self._values[k] = self._values.get(k, 0.0) + n


class Gauge(_Metric):
    kind = "gauge"

    def set(self, v: float, **labels) -> None:
        self._values[self._key(labels)] = float(v)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_: str, buckets=LATENCY_BUCKETS_S):
        super().__init__(name, help_)
        self.buckets = tuple(buckets)
        self._counts = [0] * (len(self.buckets) + 1)
        self._sum = 0.0
        self._n = 0

    def observe(self, v: float) -> None:
        self._counts[bisect.bisect_left(self.buckets, v)] += 1
        self._sum += v
        self._n += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for b, c in zip(self.buckets, self._counts):
            acc += c
            lines.append(f'{self.name}_bucket{{le="{b}"}} {acc}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self._n}')
        lines += [f"{self.name}_sum {self._sum}", f"{self.name}_count {self._n}"]
        return lines


def _get(cls, name: str, help_: str, **kw):
    with _lock:
        m = _metrics.get(name)
        if m is None:
            m = _metrics[name] = cls(name, help_, **kw)
        return m


def counter(name: str, help_: str) -> Counter:
    return _get(Counter, name, help_)


def gauge(name: str, help_: str) -> Gauge:
    return _get(Gauge, name, help_)


def histogram(name: str, help_: str, buckets=LATENCY_BUCKETS_S) -> Histogram:
    return _get(Histogram, name, help_, buckets=buckets)


def render() -> str:
    with _lock:
        ms = list(_metrics.values())
    return "\n".join(line for m in ms for line in m.render()) + "\n"


def serve(port: int, health: Callable[[], bool] = lambda: True, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """Serve /metrics and /healthz on a daemon thread; port 0 picks a free port
    (read it back from server.server_address)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            if self.path.startswith("/metrics"):
                body, code, ctype = render().encode(), 200, "text/plain; version=0.0.4"
            elif self.path.startswith("/healthz"):
                ok = health()
                body, code, ctype = (b"ok\n" if ok else b"unhealthy\n"), (200 if ok else 503), "text/plain"
            else:
                body, code, ctype = b"not found\n", 404, "text/plain"
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="rose-metrics").start()
    return server
