"""examples/grpo_gateway.py, run as a user runs it (a subprocess of this interpreter) against a real
gateway, the real Redis and two hf-engine workers on the tiny checkpoint that follow the weights
(started once for the module): it exits 0 within 60 s of its own wall time, every step got G
answers per prompt, every step's tokens carry the version published before it (> 0), and the
versions it published are the ones Redis and `GET /v1/weights` show."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from rose.config import Config
from rose.rollout.pause_flag import PauseFlag
from rose.weights.clients import weight_keys
from tests.test_gateway import (
    KEY,
    MODEL,
    Served,
    launch_workers,
    pause_flags,
    prefixed_gateway_cfg,
    serve,
    stop_workers,
)
from tests.test_rollout_tasks import wait_for

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "grpo_gateway.py"
STEPS, GROUP, PROMPTS = 3, 4, 2
LIMIT_S = 60.0
STEP_LINE = re.compile(
    r"^step (\d+)  reward ([\d.]+)  answers \[([\d, ]+)\]  versions \[([\d, ]+)\]  workers \[([^\]]*)\]"
    r"  [\d.]+s \(rollout [\d.]+s\)  published (\d+)$"
)


@pytest.fixture(scope="module")
def module_cfg(stack, base_cfg) -> Iterator[Config]:
    yield from prefixed_gateway_cfg(stack, base_cfg)


@pytest.fixture(scope="module")
def flags() -> Iterator[dict[str, PauseFlag]]:
    yield from pause_flags("rose-grpo")


@pytest.fixture(scope="module")
def workers(module_cfg, flags, tiny_checkpoint) -> Iterator[list[str]]:
    # niceness 0: no serving to yield to here, and the example's wall time is what is measured
    hf = {"engine": "hf", "checkpoint": str(tiny_checkpoint), "weights": "follow", "max_model_len": 256, "nice": 0}
    procs = launch_workers(module_cfg, flags, per_worker=lambda w: hf)
    yield sorted(procs)
    stop_workers(procs)


@pytest.fixture(scope="module")
def gw(module_cfg, workers) -> Iterator[Served]:
    s = serve(module_cfg)
    wait_for(lambda: sorted(httpx.get(s.url + "/health").json()["workers_running"]) == workers, 180, "workers")
    yield s
    s.stop()


def test_the_grpo_example_advances_the_policy_version_every_step(gw, module_cfg, tiny_checkpoint, tmp_path):
    argv = [sys.executable, str(EXAMPLE), "--base-url", gw.url + "/v1", "--api-key", KEY, "--model", MODEL]
    argv += ["--checkpoint", str(tiny_checkpoint), "--steps", str(STEPS), "--group", str(GROUP)]
    argv += ["--prompts", str(PROMPTS), "--out", str(tmp_path)]
    t0 = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=2 * LIMIT_S, cwd=REPO)
    wall_s = time.monotonic() - t0
    assert p.returncode == 0, p.stdout + p.stderr
    assert wall_s <= LIMIT_S, f"the example took {wall_s:.1f}s:\n{p.stdout}"
    lines = p.stdout.splitlines()
    start = re.match(r"model \S+: the checkpoint's weights published as version (\d+)$", lines[0])
    assert start, p.stdout
    steps = [STEP_LINE.match(line) for line in lines[1 : 1 + STEPS]]
    assert all(steps), p.stdout
    published = int(start.group(1))
    for i, m in enumerate(steps):
        assert m is not None and int(m.group(1)) == i
        assert [int(x) for x in m.group(3).split(",")] == [GROUP] * PROMPTS  # every group got G answers
        assert [int(x) for x in m.group(4).split(",")] == [published] and published > 0  # tokens at that version
        assert set(m.group(5).split(", ")) <= {"w0", "w1"}
        assert int(m.group(6)) == published + 1
        published += 1
    assert (
        lines[1 + STEPS].startswith(f"done: {STEPS} steps training model.embed_tokens.weight")
        and f"last published {published}" in lines[1 + STEPS]
    )
    r = redis.Redis.from_url(module_cfg.redis.url)
    try:
        assert int(r.hget(weight_keys(module_cfg.redis, MODEL).meta, "version")) == published
    finally:
        r.close()
    assert weights(gw)["latest_published"] == published
    wait_for(lambda: workers_at(gw, published) == ["w0", "w1"], 30, "both workers on the last version")
    print(f"example wall time {wall_s:.1f}s\n{p.stdout}")


def weights(gw: Served) -> dict:
    return httpx.get(gw.url + "/v1/weights", headers={"Authorization": f"Bearer {KEY}"}).json()


def workers_at(gw: Served, version: int) -> list[str]:
    return sorted(d["worker"] for d in weights(gw)["data"] if d["version"] >= version)
