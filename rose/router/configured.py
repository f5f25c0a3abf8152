"""The router adapter `[router]` names (`router.kind`), for the replicas an executor lends."""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable

from rose.config import RouterConfig
from rose.router.base import Router
from rose.router.readiness import ReadinessAdapter
from rose.router.vllm_router import VllmRouterAdapter


def router_for(cfg: RouterConfig, replicas: Iterable[str]) -> Router:
    """vllm-router: its worker API at `router.url`; readiness: an endpoint per replica served at
    `router.url`'s host and port (docs/router.md)."""
    if cfg.kind == "readiness":
        u = urllib.parse.urlsplit(cfg.url)
        return ReadinessAdapter(replicas, host=u.hostname or "127.0.0.1", port=u.port or 0)
    return VllmRouterAdapter(cfg.url, cfg.metrics_url)
