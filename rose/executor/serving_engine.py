"""The serving engine of a lent replica, over vLLM's HTTP server (docs/executor.md "Replica leases"):

    POST /sleep?level=1   frees the weights' and KV cache's device memory (weights kept in host memory)
    POST /wake_up         loads them back; the engine serves again
    GET  /health          200 while the engine can serve
    GET  /metrics         vllm:num_requests_running and vllm:num_requests_waiting: its own count

`/sleep` and `/wake_up` exist only with `VLLM_SERVER_DEV_MODE=1` and `--enable-sleep-mode`, and
only on CUDA: vLLM's CPU backend has no sleep mode, so on CPU the engine is left as it is, idle
(nothing is routed to it) and holding its memory."""

from __future__ import annotations

import urllib.error
import urllib.request

from rose.node.prometheus import ENGINES, ExpositionError, parse
from rose.router.base import replica_url


class ServingEngine:
    def __init__(self, url: str, device: str, timeout_s: float = 60.0):
        self.url = replica_url(url)
        self.device = device
        self.timeout_s = timeout_s  # a wake-up loads the weights back: seconds for a large model

    @property
    def can_sleep(self) -> bool:
        return self.device != "cpu"

    def _call(self, method: str, path: str) -> tuple[int, bytes]:
        req = urllib.request.Request(self.url + path, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:  # noqa: S310 - the configured engine
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except (OSError, urllib.error.URLError) as e:
            return 0, str(getattr(e, "reason", e)).encode()

    def sleep(self) -> tuple[bool, str]:
        """Put the engine to sleep (level 1); (False, why) where it cannot."""
        if not self.can_sleep:
            return False, f"vLLM cannot sleep on {self.device}: the engine stays idle and keeps its memory"
        return self._answer("POST", "/sleep?level=1")

    def wake(self) -> tuple[bool, str]:
        """Wake the engine (harmless on one that is awake); nothing to do where it cannot sleep."""
        return self._answer("POST", "/wake_up") if self.can_sleep else (True, "")

    def healthy(self) -> tuple[bool, str]:
        return self._answer("GET", "/health")

    def _answer(self, method: str, path: str) -> tuple[bool, str]:
        code, body = self._call(method, path)
        if code == 200:
            return True, ""
        return False, f"{method} {self.url}{path} answered {code or 'nothing'}: {body[:200].decode(errors='replace')}"

    def in_flight(self) -> int | None:
        """Requests running or waiting in the engine, from its own metrics; None when unread."""
        code, body = self._call("GET", "/metrics")
        if code != 200:
            return None
        try:
            values = parse(body.decode(errors="replace")).values
        except ExpositionError:
            return None
        names = ENGINES["vllm"]["running"] + ENGINES["vllm"]["waiting"]
        return int(sum(values.get(n, 0.0) for n in names))
