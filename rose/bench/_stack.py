"""Shared set-up of the executor benches: a private topic and Redis key prefix on the running
stack (so a bench never touches a live system's topics), and a queue of rollout tasks."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid

from rose.config import Config
from rose.obs.stats import percentile


@contextlib.contextmanager
def private_stack(cfg: Config, tag: str, kafka: bool = True, partitions: int = 1):
    """`cfg` with its own topics of `partitions` partitions (created, deleted after; only with
    `kafka`) and Redis keys (deleted after)."""
    import redis

    from rose.kafka.admin import wait_for_broker
    from rose.kafka.topics import create_topics, delete_topics, topic_specs

    u = uuid.uuid4().hex[:8]
    c = dataclasses.replace(
        cfg,
        kafka=dataclasses.replace(
            cfg.kafka, topic_prefix=f"{cfg.kafka.topic_prefix}bench-{tag}-{u}.", partitions=partitions
        ),
        redis=dataclasses.replace(cfg.redis, key_prefix=f"{cfg.redis.key_prefix}bench-{tag}-{u}:"),
    )
    if kafka:
        wait_for_broker(c.kafka, timeout_s=30)
        create_topics(c.kafka)
    r = redis.Redis.from_url(c.redis.url)
    try:
        yield c
    finally:
        if kafka:
            delete_topics(c.kafka, list(topic_specs(c.kafka)))
        keys = list(r.scan_iter(match=f"{c.redis.key_prefix}*", count=1000))
        if keys:
            r.delete(*keys)
        r.close()


def fill_tasks(cfg: Config, job: str, n: int, turns: int = 4, tokens_per_turn: int = 32) -> None:
    """`n` agentic episodes with short tool calls, so a worker always has decoding to do."""
    import redis

    from rose.rollout.episode import Task, ToolLatency
    from rose.rollout.tasks import TaskQueue

    q = TaskQueue(redis.Redis.from_url(cfg.redis.url), cfg.redis, job)
    q.ensure_group()
    for i in range(n):
        q.submit(
            Task(
                task_id=f"bench-{i}",
                prompt=[1 + i % 250, 7, 9, 11],
                max_turns=turns,
                tokens_per_turn=tokens_per_turn,
                obs_tokens=8,
                tool=ToolLatency(mu=-5.0, sigma=0.0),
                seed=i,
            )
        )


def percentiles_ms(samples_ns: list[int]) -> dict:
    """p50/p99/max in milliseconds of nanosecond samples (nearest rank; None for no samples)."""
    ms = [x / 1e6 for x in samples_ns]
    return {
        "p50_ms": percentile(ms, 0.50, 3),
        "p99_ms": percentile(ms, 0.99, 3),
        "max_ms": percentile(ms, 1.0, 3),
        "n": len(ms),
    }


def wait_for(fn, timeout_s: float):
    """Poll `fn` (every 0.2 ms: the benches time sub-millisecond events) until it returns
    something true, and return that; TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.0002)
    raise TimeoutError(f"bench: condition not met within {timeout_s}s")
