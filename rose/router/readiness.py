"""`ReadinessAdapter`: the `Router` for routers ROSE cannot call. It serves one readiness endpoint
per replica, which the router, load balancer or Kubernetes probe polls (docs/router.md):

    GET /ready/<replica>   200 while the replica serves, 503 while it is out (lent), 404 unknown

`<replica>` is the name given at construction, percent-encoded in the path. The router learns of
a removal only at its next poll, so the caller waits out the poller's period (and failure
threshold) before it counts new arrivals as stopped; `not_ready_answers` counts the 503s given."""

from __future__ import annotations

import threading
import urllib.parse
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rose.router.base import RouterError


class ReadinessAdapter:
    def __init__(self, replicas: Iterable[str], host: str = "127.0.0.1", port: int = 0):
        self._out: set[str] = set()
        self._known = frozenset(replicas)
        self._not_ready_answers = dict.fromkeys(self._known, 0)
        self._lock = threading.Lock()
        adapter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                prefix, _, name = self.path.partition("/ready/")
                status = adapter._answer(urllib.parse.unquote(name)) if prefix == "" and name else 404
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:  # probes every few seconds: no log line each
                pass

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            raise RouterError(f"router.url: cannot serve readiness on {host}:{port} ({e.strerror or e})") from None
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="rose-readiness", daemon=True)
        self._thread.start()

    def _answer(self, replica: str) -> int:
        with self._lock:
            if replica not in self._known:
                return 404
            if replica in self._out:
                self._not_ready_answers[replica] += 1
                return 503
            return 200

    def _check(self, replica: str) -> None:
        if replica not in self._known:
            raise RouterError(f"readiness: unknown replica {replica!r} (known: {', '.join(sorted(self._known))})")

    def remove(self, replica: str) -> None:
        self._check(replica)
        with self._lock:
            if replica not in self._out:
                self._out.add(replica)
                self._not_ready_answers[replica] = 0

    def readmit(self, replica: str) -> None:
        self._check(replica)
        with self._lock:
            self._out.discard(replica)

    def serving(self) -> frozenset[str]:
        with self._lock:
            return self._known - self._out

    def in_flight(self, replica: str) -> int | None:
        return None  # a readiness endpoint sees no requests: the engine's own count tells

    def not_ready_answers(self, replica: str) -> int:
        """503s given for `replica` since its removal: the poller has seen it out once this is
        at least its failure threshold."""
        with self._lock:
            return self._not_ready_answers.get(replica, 0)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
