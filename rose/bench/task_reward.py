"""The demo task's starting reward on a checkpoint: each variant of rose.rollout.addition_task sampled
through vLLM as the demo's workers sample it (temperature 1), the mean reward with its 95 %
interval over prompts and the part of the groups whose rewards differ (a group whose samples all
earn the same reward teaches GRPO nothing). The task the demo trains should start between 0.1
and 0.7 (docs/demo.md "The task")."""

from __future__ import annotations

import multiprocessing
import random
import statistics
import time
from typing import Any

from rose.bench._stack import child_result, progress
from rose.rollout import addition_task as mt

PROMPTS, QUICK_PROMPTS = 48, 4  # prompts per variant, each a group
GROUP, QUICK_GROUP = 8, 2  # samples per prompt
MAX_TOKENS = 6  # the answer is a number; the reward reads its first integer
SEED = 1  # the prompts' draw
BAND = (0.1, 0.7)  # a starting mean reward inside it leaves groups with variance


def run(cfg: Any, quick: bool, *, model: str = "") -> dict:
    """Every variant in one vLLM engine, in a process of its own (the engine's settings are
    process-wide). The reference beside the demo's variant is every other variant, measured in
    the same run on the same prompts' seed."""
    t0 = time.monotonic()
    prompts, group = (QUICK_PROMPTS, QUICK_GROUP) if quick else (PROMPTS, GROUP)
    progress("task_reward", t0, f"sampling {prompts} prompts x {group} per variant on {model}")
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_sample_all, args=(q, model, prompts, group), daemon=True)
    p.start()
    rewards: dict[str, list[list[float]]] = child_result(q, p, "bench task_reward: the sampling process")
    variants = {name: _summary(by_prompt) for name, by_prompt in rewards.items()}
    chosen = variants[mt.TASK.name]
    return {
        "model": model,
        "temperature": 1.0,
        "prompts_per_variant": prompts,
        "samples_per_prompt": group,
        "max_tokens": MAX_TOKENS,
        "variants": variants,
        "demo_task": mt.TASK.name,
        "goal_band": list(BAND),
        "demo_task_in_band": BAND[0] <= chosen["mean_reward"] <= BAND[1],  # the mean; the interval is beside it
    }


def _sample_all(q: Any, model: str, prompts: int, group: int) -> None:
    import os

    from rose.config import GiB
    from rose.rollout.engines.vllm_engine import engine_environment

    os.environ.update(engine_environment("cpu", GiB, os.cpu_count() or 1))  # its logs on stderr, not the JSON
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from rose.rollout.compute_dtype import native_dtype, this_cpu_flags

    tok = AutoTokenizer.from_pretrained(model)
    dtype: Any = native_dtype("cpu", this_cpu_flags())  # "float32" or "bfloat16", both among vLLM's names
    llm = LLM(model, dtype=dtype, max_model_len=512, enforce_eager=True)
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, n=group)
    out: dict[str, list[list[float]]] = {}
    for task in mt.TASKS:
        rng = random.Random(SEED)
        problems = [mt.problem(rng, task) for _ in range(prompts)]
        done = llm.generate([mt.prompt_text(tok, pb, task) for pb in problems], params, use_tqdm=False)
        out[task.name] = [[mt.reward(o.text, pb) for o in r.outputs] for r, pb in zip(done, problems, strict=True)]
    q.put(out)


def _summary(by_prompt: list[list[float]]) -> dict:
    """The mean over prompts of each prompt's mean reward, with its Student t interval."""
    from rose.obs.stats import mean_ci95

    m, ci = mean_ci95([statistics.fmean(g) for g in by_prompt])
    return {
        "mean_reward": round(m or 0.0, 4),
        "ci95": None if ci is None else [round(x, 4) for x in ci],
        "groups_with_variance": round(sum(1 for g in by_prompt if len(set(g)) > 1) / len(by_prompt), 4),
        "samples": sum(len(g) for g in by_prompt),
    }
