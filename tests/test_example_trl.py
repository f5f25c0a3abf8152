"""examples/trl_grpo.py, run as a user runs it (a subprocess with its own command line) against a
real gateway, the real Redis and two hf-engine workers that follow the weights, on a tiny
checkpoint with a tokenizer (TRL tokenizes the prompts and decodes the completions): TRL's
trainer takes every optimizer step asked for (at least 3), each step's tokens carry the version
published before it, the last version it published is the one Redis holds and both workers
applied, and it exits 0 within its bound. The gateway and workers are test_example_grpo's
fixtures, on this module's checkpoint."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from rose.bench.trl import STEP_LINE  # the bench reads the example's lines with it too
from rose.weights.stream import weight_keys
from tests.test_example_grpo import flags, gw, module_cfg, weights, workers, workers_at  # noqa: F401 (fixtures)
from tests.test_gateway import KEY, MODEL
from tests.test_rollout_tasks import wait_for

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "trl_grpo.py"
STEPS, GROUP, PROMPTS = 3, 4, 2
LIMIT_S = 120.0  # importing torch, transformers, datasets and TRL is most of it on a loaded 2-core machine


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The tiny random-init Qwen2 of conftest's fixture, with a tokenizer trained locally."""
    from rose.model.random_init import init_checkpoint

    return init_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen2-tok", tokenizer=True)


@pytest.mark.timeout(600)  # the checkpoint, the workers' and the gateway's start (fixtures) count here
def test_trl_grpo_trainer_trains_on_rose_rollouts_one_version_per_step(gw, module_cfg, tiny_checkpoint, tmp_path):  # noqa: F811
    argv = [sys.executable, str(EXAMPLE), "--gateway", gw.url, "--api-key", KEY, "--served-model", MODEL]
    argv += ["--model", str(tiny_checkpoint), "--steps", str(STEPS), "--group", str(GROUP)]
    argv += ["--prompts", str(PROMPTS), "--out", str(tmp_path)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    t0 = time.monotonic()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=2 * LIMIT_S, cwd=REPO, env=env)
    wall_s = time.monotonic() - t0
    assert p.returncode == 0, p.stdout + p.stderr
    assert wall_s <= LIMIT_S, f"the example took {wall_s:.1f}s:\n{p.stdout}"
    lines = p.stdout.splitlines()
    start = re.match(r"model \S+: the checkpoint's weights published as version (\d+)$", lines[0])
    assert start, p.stdout
    steps = [STEP_LINE.match(line) for line in lines[1:] if line.startswith("step ")]
    assert len(steps) == STEPS and all(steps), p.stdout
    published = int(start.group(1))
    for i, m in enumerate(steps):
        assert m is not None and int(m.group(1)) == i
        assert int(m.group(3)) == GROUP * PROMPTS
        assert [int(x) for x in m.group(4).split(",")] == [published] and published > 0  # tokens at that version
        assert set(m.group(5).split(", ")) <= {"w0", "w1"}
        assert int(m.group(8)) == published + 1
        published += 1
    done = next(line for line in lines if line.startswith("done: "))
    assert done.startswith(f"done: {STEPS} optimizer steps of TRL's GRPOTrainer, last published {published},")
    r = redis.Redis.from_url(module_cfg.redis.url)
    try:
        assert int(r.hget(weight_keys(module_cfg.redis, MODEL).meta, "version")) == published
    finally:
        r.close()
    assert weights(gw)["latest_published"] == published
    wait_for(lambda: workers_at(gw, published) == ["w0", "w1"], 30, "both workers on the last version")
    print(f"example wall time {wall_s:.1f}s\n{p.stdout}")
