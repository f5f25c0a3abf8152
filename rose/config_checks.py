"""The configuration's checks at load (rose.config.load_config): each bad setting is one
`ConfigError` naming the setting and what to do, which the commands print as one line with exit
status 2. Apart from the dataclasses so that rose.config stays a list of settings."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key."""


# one pool's forecast of its load: "last" is the evaluation's baseline, not a product choice
FORECASTS = ("last", "peak", "peak_trend")
ROUTER_KINDS = ("vllm-router", "readiness")


def check_sections(cfg: Any) -> None:
    """Every section's checks that span fields (a field's type is checked as it is read)."""
    _check_rollout(cfg.rollout)
    _check_gateway(cfg.gateway)
    _check_router(cfg.router, cfg.executor)
    _check_clock_skew(cfg.executor, cfg.policy)
    for name, pool in cfg.policy.pools.items():
        check_pool_config(name, pool)


def check_pool_config(name: str, c: Any) -> None:
    """ConfigError with one line naming the setting and what to do."""
    where = f"policy.pools.{name}"
    if c.forecast not in FORECASTS:
        raise ConfigError(f"{where}.forecast: {c.forecast!r} is not one of {FORECASTS}")
    if not 0 <= c.replica_capacity_rps < math.inf:
        raise ConfigError(f"{where}.replica_capacity_rps: {c.replica_capacity_rps} must be ≥ 0 (0: estimate)")
    if not 0 <= c.headroom < math.inf:
        raise ConfigError(f"{where}.headroom: {c.headroom} must be ≥ 0")
    if c.replica_capacity_rps == 0 and c.headroom >= 1:
        raise ConfigError(
            f"{where}.replica_capacity_rps: 0 (estimate) cannot be estimated with headroom {c.headroom} ≥ 1 "
            "(no latency is within (1 - headroom) × SLO); set the rps one replica serves within its SLO"
        )
    for term in ("decision_latency_s", "stop_rollout_s", "wake_s", "readmit_s"):
        if not 0 <= getattr(c, term) < math.inf:
            raise ConfigError(f"{where}.{term}: {getattr(c, term)} must be a number of seconds ≥ 0")
    if not 0 < c.bin_s < math.inf:
        raise ConfigError(f"{where}.bin_s: {c.bin_s} must be > 0")
    if not c.horizon_s <= c.window_s < math.inf:
        raise ConfigError(f"{where}.window_s: {c.window_s} s is shorter than the reclaim horizon {c.horizon_s} s")


def _check_clock_skew(e: Any, p: Any) -> None:
    if not 0 <= e.max_clock_skew_s < p.renew_before_s:
        raise ConfigError(
            f"executor.max_clock_skew_s: expected seconds >= 0 and below policy.renew_before_s "
            f"({p.renew_before_s:g}), got {e.max_clock_skew_s:g}"
        )


def _check_rollout(r: Any) -> None:
    if r.engine not in ("vllm", "hf", "reference"):
        raise ConfigError(f"rollout.engine: expected vllm, hf or reference, got {r.engine!r}")
    if r.engine != "reference" and not r.model:
        raise ConfigError(f"rollout.model: engine {r.engine!r} needs a local Hugging Face checkpoint directory")
    if r.engine != "reference" and not (Path(r.model) / "config.json").is_file():
        raise ConfigError(f"rollout.model: {r.model} is not a Hugging Face checkpoint directory (no config.json)")
    if r.step_tokens < 0:
        raise ConfigError(
            f"rollout.step_tokens: expected 0 (the engine's default) or a positive count, got {r.step_tokens}"
        )


def _check_gateway(g: Any) -> None:
    if not 0 <= g.port <= 65535:
        raise ConfigError(f"gateway.port: expected a port 0..65535, got {g.port}")
    if g.max_inflight < 1:
        raise ConfigError(f"gateway.max_inflight: expected an integer >= 1, got {g.max_inflight}")
    if g.max_queue < 0:
        raise ConfigError(f"gateway.max_queue: expected an integer >= 0, got {g.max_queue}")
    if not 0 < g.request_timeout_s < float("inf"):
        raise ConfigError(
            f"gateway.request_timeout_s: expected a positive number of seconds, got {g.request_timeout_s}"
        )
    if not 0 <= g.pause_patience_s < float("inf"):
        raise ConfigError(f"gateway.pause_patience_s: expected a number of seconds >= 0, got {g.pause_patience_s}")
    if g.tokenizer and not any((Path(g.tokenizer) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(
            f"gateway.tokenizer: {g.tokenizer!r} holds no tokenizer.json or tokenizer_config.json; "
            "give the checkpoint's directory, or leave it empty for token ids only"
        )


def _check_router(r: Any, e: Any) -> None:
    if r.kind not in ROUTER_KINDS:
        raise ConfigError(f"router.kind: expected {' or '.join(ROUTER_KINDS)}, got {r.kind!r}")
    scheme, sep, rest = r.url.partition("://")
    if scheme not in ("http", "https") or not sep or not rest.strip("/"):
        raise ConfigError(f"router.url: expected an http:// or https:// address, got {r.url!r}")
    if not e.drain_timeout_s > 0 or math.isinf(e.drain_timeout_s):
        raise ConfigError(
            f"executor.drain_timeout_s: expected a number of seconds > 0, got {e.drain_timeout_s:g}; "
            "set it to how long a lent replica's requests in flight may take to finish"
        )
