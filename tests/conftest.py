"""Shared fixtures. Tests of Kafka and Redis behaviour use the real local stack
(`rose stack up`); each test gets its own topic and key prefix so runs never collide."""

from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path

import pytest

from rose.config import Config, load_config
from rose.obs.logs import setup_logging

setup_logging("WARNING")  # decision logs of in-process services would drown the test output

REPO = Path(__file__).resolve().parent.parent
TRACES = Path(os.environ.get("ROSE_TRACES", REPO.parent / "shared" / "traces"))


def slow_enabled(path: Path, setting: str) -> bool:
    """Whether the long variant at `path` runs: ROSE_SLOW=1 runs them all; a comma-separated
    list of folders or files (relative to the repository, e.g. `tests/faults`, which `make
    test` sets) runs those under them; unset or empty, none."""
    if setting.strip() == "1":
        return True
    return any(path.is_relative_to(REPO / p.strip()) for p in setting.split(",") if p.strip())


# Fixtures that reach the real local Kafka and Redis (`cfg` and `redis_client` go through `stack`).
STACK_FIXTURES = frozenset({"stack", "cfg", "redis_client"})


def needs_stack(item) -> bool:
    """Whether a test needs the real Kafka and Redis: marked `stack`, asking for a fixture that
    reaches them (directly or through another fixture), or one of the fault suite's."""
    return (
        item.get_closest_marker("stack") is not None
        or not STACK_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))
        or Path(item.path).is_relative_to(REPO / "tests" / "faults")
    )


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the marks added here
def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    slow = os.environ.get("ROSE_SLOW", "")
    for item in items:
        if needs_stack(item) and item.get_closest_marker("stack") is None:
            item.add_marker(pytest.mark.stack)  # `make unit` (-m "not stack") leaves it out
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "slow" in item.keywords and not slow_enabled(Path(item.path), slow):
            item.add_marker(pytest.mark.skip(reason="long variant; set ROSE_SLOW=1 (or ROSE_SLOW=its folder)"))


@pytest.fixture(scope="session")
def base_cfg() -> Config:
    return load_config()


@pytest.fixture(scope="session")
def stack(base_cfg):
    """The real local Kafka + Redis; started here if `make test` did not start it."""
    from rose.stack import LocalStack

    s = LocalStack.from_config(base_cfg)
    st = s.status()
    started = not all(st.values())
    if started:
        s.up()
    yield s
    if started and os.environ.get("ROSE_KEEP_STACK") != "1":
        s.down()


@pytest.fixture
def cfg(stack, base_cfg) -> Config:
    """A Config with a unique topic prefix and Redis key prefix, topics created."""
    from rose.kafka.topics import create_topics, delete_topics, topic_specs

    tag = uuid.uuid4().hex[:10]
    kafka = dataclasses.replace(base_cfg.kafka, bootstrap=stack.kafka_bootstrap, topic_prefix=f"t{tag}.", partitions=4)
    redis = dataclasses.replace(base_cfg.redis, url=stack.redis_url, key_prefix=f"t{tag}:")
    c = dataclasses.replace(base_cfg, kafka=kafka, redis=redis)
    create_topics(c.kafka)
    yield c
    delete_topics(c.kafka, list(topic_specs(c.kafka)))


@pytest.fixture
def redis_client(cfg):
    import redis

    r = redis.Redis.from_url(cfg.redis.url)
    yield r
    keys = list(r.scan_iter(match=f"{cfg.redis.key_prefix}*", count=1000))
    if keys:
        r.delete(*keys)
    r.close()


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    if not TRACES.is_dir():
        pytest.fail(f"traces not found at {TRACES}; set ROSE_TRACES to the shared traces folder")
    return TRACES


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A random-init Qwen2 checkpoint (2 layers, hidden 256, vocab 1024), made once per session."""
    from rose.model.random_init import init_checkpoint

    return init_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen2")


VLLM_STARTUP_TIMEOUT_S = 240.0  # a cold start on a busy 2-core machine (about 45 s on an idle one)


def start_tiny_server(checkpoint: Path, log: Path):
    """vLLM's OpenAI server (`rose.vllm_server`) on the tiny checkpoint, as the tests run it: one
    compute thread, the dev endpoints (/sleep, /wake_up) on. pytest.fail when it does not start."""
    from rose.vllm_server import ServerError, start_server

    try:
        return start_server(
            str(checkpoint),
            log,
            max_model_len=1024,
            threads=1,
            timeout_s=VLLM_STARTUP_TIMEOUT_S,
            env={"VLLM_SERVER_DEV_MODE": "1"},
        )
    except ServerError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def vllm_server(tiny_checkpoint, tmp_path_factory):
    """vLLM's OpenAI server (`rose.vllm_server`) on the tiny checkpoint, up until the session ends."""
    from rose.vllm_server import stop_server

    srv = start_tiny_server(tiny_checkpoint, tmp_path_factory.mktemp("vllm") / "server.log")
    try:
        yield srv
    finally:
        stop_server(srv)
