"""`VllmRouterAdapter`: the `Router` over vllm-router's worker API (PyPI `vllm-router`, the Rust
router that fronts vLLM's OpenAI servers; docs/router.md has what each call was seen to do).

    POST /remove_worker?url=U   U leaves the routing set at once; requests in flight on U finish
    POST /add_worker?url=U      blocks until U's /health answers (or the router's startup timeout)
    GET  /list_workers          {"urls": [...]}: the routing set
    GET  :PROM/metrics          vllm_router_running_requests{worker="U"}: in flight on U, removed or not
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request

from rose.router.base import RouterError, replica_url

# seconds between reads of the router's in-flight gauge while waiting for a drain: a tenth of the
# shortest completion the tiny test model streams, far below drain times of real requests
_DRAIN_POLL_S = 0.05


class VllmRouterAdapter:
    def __init__(self, url: str, metrics_url: str = "", timeout_s: float = 10.0, admit_timeout_s: float = 120.0):
        self.url = replica_url(url)
        self.metrics_url = replica_url(metrics_url)
        self.timeout_s = timeout_s  # every call but /add_worker
        self.admit_timeout_s = admit_timeout_s  # /add_worker waits for the replica's health check

    def _call(self, method: str, path: str, timeout_s: float, base: str = "") -> bytes:
        target = (base or self.url) + path
        req = urllib.request.Request(target, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310 - the configured router
                return r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace").strip()[:200]
            raise RouterError(f"router at {self.url}: {method} {path} answered {e.code}: {detail}") from None
        except (OSError, urllib.error.URLError) as e:
            reason = getattr(e, "reason", e)
            raise RouterError(
                f"router at {target} does not answer ({reason}); check router.url and that the router runs"
            ) from None

    def serving(self) -> frozenset[str]:
        body = self._call("GET", "/list_workers", self.timeout_s)
        try:
            return frozenset(replica_url(u) for u in json.loads(body)["urls"])
        except (ValueError, KeyError, TypeError, AttributeError):
            raise RouterError(f"router at {self.url}: /list_workers gave no url list: {body[:200]!r}") from None

    def remove(self, replica: str) -> None:
        """The router answers 200 even for a URL it does not hold, so the set is read first. The
        last worker is never removed: the router would answer every new request 503."""
        url = replica_url(replica)
        held = self.serving()
        if url not in held:
            return
        if held == {url}:
            raise RouterError(f"router at {self.url}: {url} is its last worker; a pool keeps one replica serving")
        self._call("POST", "/remove_worker?" + urllib.parse.urlencode({"url": url}), self.timeout_s)

    def readmit(self, replica: str) -> None:
        url = replica_url(replica)
        if url not in self.serving():
            self._call("POST", "/add_worker?" + urllib.parse.urlencode({"url": url}), self.admit_timeout_s)

    def in_flight(self, replica: str) -> int | None:
        """From the router's Prometheus gauge (the router's own count, kept for removed workers
        too); None without `metrics_url` or under a policy that keeps no count (round_robin,
        random), where the gauge has no line for any worker."""
        if not self.metrics_url:
            return None
        text = self._call("GET", "/metrics", self.timeout_s, base=self.metrics_url).decode(errors="replace")
        counts = {
            m[1]: int(float(m[2]))
            for m in re.finditer(r'^vllm_router_running_requests\{worker="([^"]*)"\} (\S+)$', text, re.M)
        }
        return counts.get(replica_url(replica), 0) if counts else None

    def wait_drained(self, replica: str, timeout_s: float) -> bool:
        """Whether the router's requests in flight on `replica` reached 0 within `timeout_s`
        (True at once where the router cannot tell: the caller then waits on the engine)."""
        deadline = time.monotonic() + timeout_s
        while True:
            n = self.in_flight(replica)
            if not n:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(_DRAIN_POLL_S)
