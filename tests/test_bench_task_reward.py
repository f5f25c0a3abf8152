"""`rose bench task_reward`: the demo task's starting reward per variant, sampled through vLLM.
The summary is checked on rewards with a known answer; the run itself on the tiny checkpoint
with a tokenizer (a random policy, so only the shape and the counts can be asserted), as a long
variant: it starts a vLLM engine of its own."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rose.bench import task_reward
from rose.rollout import addition_task as mt


def test_the_summary_is_the_mean_over_prompts_with_its_interval_and_the_groups_that_differ():
    out = task_reward._summary([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    assert out["mean_reward"] == 0.5 and out["samples"] == 8
    assert out["groups_with_variance"] == 0.5
    lo, hi = out["ci95"]
    assert lo < 0.5 < hi and hi - lo < 2  # t(3) × sd 0.408 / 2 each side: [-0.15, 1.15]
    assert task_reward._summary([[1.0], [1.0]])["ci95"] == [1.0, 1.0]


def test_the_demo_trains_a_variant_the_bench_measures():
    assert mt.TASK in mt.TASKS and len({t.name for t in mt.TASKS}) == len(mt.TASKS)


@pytest.mark.parametrize(
    "args,says",
    [
        (["--engine", "hf", "--model", "."], "--engine 'hf'"),
        (["--model", "/nowhere"], "--model '/nowhere'"),
        ([], "--model ''"),
    ],
)
def test_bad_arguments_get_one_line_and_exit_2(args, says):
    _exits_2_with_one_line(args, says)


def test_a_checkpoint_without_a_chat_template_gets_one_line_and_exit_2(tiny_checkpoint):
    _exits_2_with_one_line(["--model", str(tiny_checkpoint)], "has no chat template")


def _exits_2_with_one_line(args: list[str], says: str) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "rose", "bench", "task_reward", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and says in p.stderr


# ChatML, as SmolLM2's; the tiny checkpoint's tokenizer has none
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.slow  # a vLLM engine of its own
@pytest.mark.timeout(600)
def test_a_quick_run_samples_every_variant(cfg, tmp_path):
    pytest.importorskip("vllm")
    from rose.model.random_init import init_checkpoint

    model = init_checkpoint(tmp_path / "tiny-qwen2-tok", tokenizer=True)
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    out = task_reward.run(cfg, quick=True, model=str(model))
    assert set(out["variants"]) == {t.name for t in mt.TASKS} and out["demo_task"] == mt.TASK.name
    for v in out["variants"].values():
        assert v["samples"] == task_reward.QUICK_PROMPTS * task_reward.QUICK_GROUP
        assert 0 <= v["mean_reward"] <= 1 and 0 <= v["groups_with_variance"] <= 1
