"""Whether the demo's trainer raises the task's reward within a run: its recipe (GRPO-shaped
REINFORCE on one-digit addition, rose.rollout.addition_task) in one process, with no broker. Each
step samples its groups through vLLM's offline `LLM` at temperature 1, scores them, takes the
trainer's step on the transformers model and reloads the updated weights into the engine in
place, as a worker reloads a version. The step-0 reward, before any update, is the baseline."""

from __future__ import annotations

import multiprocessing
import random
import statistics
import time
from typing import Any

from rose.bench._stack import child_result, progress
from rose.rollout import addition_task as mt

# the demo's recipe on a real checkpoint (rose.demo.run_setup's TrainerSpec for engine != reference)
LR = 1e-4  # Adam
GROUP = 8  # samples per prompt
GROUPS_PER_STEP = 2
TRAIN_LAYERS = 1  # the last decoder layer and the final norm
MAX_TOKENS = 14  # the demo's tokens_per_turn (rose.demo.run_setup.RunOptions)
BUDGET_S, QUICK_STEPS = 600.0, 3  # steps taken until the budget is spent (after the engine starts)
SEED = 1  # the prompts' draw and the trainer's torch seed
BAND = (0.1, 0.7)  # a starting mean reward inside it leaves groups with variance (docs/demo.md "The task")


def thirds(n: int) -> tuple[range, range]:
    """The first and the last third of `n` steps (n // 3 each; the middle keeps the rest)."""
    k = n // 3
    return range(0, k), range(n - k, n)


def separated(first: list[float] | None, last: list[float] | None) -> bool:
    """Whether the last third's 95 % interval lies wholly above the first third's."""
    return first is not None and last is not None and last[0] > first[1]


def summary(group_means: list[list[float]]) -> dict:
    """Per step its mean reward and samples; the first and the last third's means over their
    groups' mean rewards (each group a prompt, independent of the others), with 95 % intervals."""
    from rose.obs.stats import mean_ci95

    def third(steps: range) -> dict:
        gs = [g for s in steps for g in group_means[s]]
        m, ci = mean_ci95(gs)
        return {
            "steps": [steps.start, steps.stop] if steps else None,
            "mean_reward": None if m is None else round(m, 4),
            "ci95": None if ci is None else [round(x, 4) for x in ci],
            "groups": len(gs),
        }

    first, last = (third(r) for r in thirds(len(group_means)))
    start = first["mean_reward"]
    return {
        "reward_by_step": [
            {"step": i, "mean": round(statistics.fmean(gs), 4), "n": len(gs) * GROUP}
            for i, gs in enumerate(group_means)
        ],
        "first_third": first,
        "last_third": last,
        "separated": separated(first["ci95"], last["ci95"]),
        "start_in_band": start is not None and BAND[0] <= start <= BAND[1],
        "goal_band": list(BAND),
    }


def run(cfg: Any, quick: bool, *, model: str = "", lr: float = 0.0) -> dict:
    """The recipe in a process of its own (vLLM's settings are process-wide)."""
    t0 = time.monotonic()
    lr = lr or LR
    budget = (0.0, QUICK_STEPS) if quick else (BUDGET_S, 0)
    progress("learning", t0, f"training {model} at lr {lr:g} ({'quick' if quick else f'{BUDGET_S:.0f} s'})")
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_train, args=(q, model, lr, budget, t0), daemon=True)
    p.start()
    out = child_result(q, p, "bench learning: the training process")
    return {
        "model": model,
        **out["setup"],
        "recipe": {
            "lr": lr,
            "optimizer": "Adam",
            "layers_trained": f"last {TRAIN_LAYERS} decoder layer(s) + final norm",
            "group": GROUP,
            "groups_per_step": GROUPS_PER_STEP,
            "max_tokens": MAX_TOKENS,
            "temperature": 1.0,
            "task": mt.TASK.name,
            **out["trained"],
        },
        "steps": len(out["group_means"]),
        "budget_s": None if quick else BUDGET_S,
        "baseline_step0": round(statistics.fmean(out["group_means"][0]), 4) if out["group_means"] else None,
        **summary(out["group_means"]),
        "seconds_per_step": {k: round(statistics.fmean(v), 3) for k, v in out["times"].items() if v},
        "engine_start_s": out["engine_start_s"],
        # the engine's weights after the last reload against the trainer's, cast as published: none expected
        "engine_tensors_not_matching": out["engine_tensors_not_matching"],
        "wall_s": round(time.monotonic() - t0, 1),
    }


def _train(q: Any, model: str, lr: float, budget: tuple[float, int], t0: float) -> None:
    import os

    from rose.config import GiB
    from rose.rollout.engines.vllm_engine import engine_environment

    threads = os.cpu_count() or 1
    os.environ.update(engine_environment("cpu", GiB, threads))  # its logs on stderr, not the JSON
    import torch
    import vllm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM

    from rose.rollout.compute_dtype import native_dtype, this_cpu_flags

    torch.set_num_threads(threads)
    torch.manual_seed(SEED)
    tok = AutoTokenizer.from_pretrained(model)
    dtype: Any = native_dtype("cpu", this_cpu_flags())  # as task_reward and the demo's workers choose it
    t_start = time.monotonic()
    llm = LLM(model, dtype=dtype, max_model_len=512, enforce_eager=True)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)  # the trainer's master weights
    policy.train()
    trained, params = mt.trainable_parameters(policy, TRAIN_LAYERS)
    opt = torch.optim.Adam(params, lr=lr)
    engine_start_s = round(time.monotonic() - t_start, 1)
    group_means, times = _steps(llm, policy, opt, tok, budget, t0)
    from rose.rollout.engines.vllm_engine import _mismatches

    progress("learning", t0, "checking the engine's weights against the trainer's")
    stale = llm.collective_rpc(_mismatches, args=(list(_published(policy).items()),))[0]
    q.put(
        {
            "setup": {"dtype": dtype, "threads": threads, "vllm": vllm.__version__},
            "trained": {
                "trained_parameters": sum(p.numel() for p in params),
                "of": sum(p.numel() for p in policy.parameters()),
                "tensors_trained": len(trained),
            },
            "group_means": group_means,
            "times": times,
            "engine_start_s": engine_start_s,
            "engine_tensors_not_matching": stale,
        }
    )


def _published(policy: Any) -> dict:
    """The trainer's state dict as the demo publishes it: the checkpoint's tensors (a tied
    output layer is the embeddings) cast to the weight stream's dtype."""
    import torch

    tied = bool(getattr(policy.config, "tie_word_embeddings", False))
    return {
        k: v.detach().to(getattr(torch, mt.PUBLISH_DTYPE))
        for k, v in policy.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }


def _steps(llm: Any, policy: Any, opt: Any, tok: Any, budget: tuple[float, int], t0: float) -> tuple[list, dict]:
    """Steps until the budget (seconds, or a number of steps) is spent: sample, score, train,
    reload. Each step's groups' mean rewards and the seconds of each phase."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from rose.rollout.engines.vllm_engine import _reload

    rng = random.Random(SEED)
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, n=GROUP)
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else 0)
    group_means: list[list[float]] = []
    times: dict[str, list[float]] = {"sampling_s": [], "training_s": [], "reload_s": []}
    start = time.monotonic()
    seconds, steps = budget
    while (steps and len(group_means) < steps) or (seconds and time.monotonic() - start < seconds):
        problems = [mt.problem(rng) for _ in range(GROUPS_PER_STEP)]
        ids = [mt.prompt_ids(tok, pb) for pb in problems]
        a = time.monotonic()
        done = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], params, use_tqdm=False)
        b = time.monotonic()
        seqs, adv, means = [], [], []
        for x, r, pb in zip(ids, done, problems, strict=True):
            rs = [mt.reward(o.text, pb) for o in r.outputs]
            means.append(statistics.fmean(rs))
            adv += mt.group_advantages(rs)
            seqs += [(x + list(o.token_ids), [0] * len(x) + [1] * len(o.token_ids)) for o in r.outputs]
        mt.reinforce_step(policy, opt, seqs, adv, pad)
        c = time.monotonic()
        llm.collective_rpc(_reload, args=(list(_published(policy).items()),))  # the worker's in-place reload
        llm.reset_prefix_cache()
        d = time.monotonic()
        for k, v in zip(times, (b - a, c - b, d - c), strict=True):
            times[k].append(v)
        group_means.append(means)
        progress("learning", t0, f"step {len(group_means) - 1}: reward {statistics.fmean(means):.3f}, {d - a:.1f} s")
    return group_means, times
