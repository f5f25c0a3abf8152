"""The demo's verifiable task on a real checkpoint: addition, "What is A + B?", one-digit addends
(`TASK`; two-digit ones are `TWO_DIGIT`).

A prompt is the question as the checkpoint's chat template renders it for a user turn (with the
assistant's header after it), as token ids, after a system line asking for the sum alone and two
solved examples (without them SmolLM2-135M-Instruct answers in prose and almost never starts with
the sum); the episode is one turn of a few tokens. The reward
is 1 when the first integer in the decoded answer is A + B, else 0. Advantages are normalised
within each group of samples of the same prompt (GRPO): a group whose samples all earn the same
reward teaches nothing and gets advantage 0. The step the demo's trainer takes on a batch of
groups is here too (`trainable_parameters`, `reinforce_step`), below both the demo and the bench
that measures whether it learns (`rose bench learning`).
"""

from __future__ import annotations

import random
import re
import statistics
from dataclasses import dataclass

_INT = re.compile(r"-?\d+")
PUBLISH_DTYPE = "bfloat16"  # what the trainer publishes on the weight stream, so what a worker loads


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def question(self) -> str:
        return f"What is {self.a} + {self.b}?"

    @property
    def answer(self) -> int:
        return self.a + self.b


@dataclass(frozen=True)
class Addition:
    """A variant of the task: both addends drawn from [lo, hi], after its solved examples."""

    name: str
    lo: int
    hi: int
    examples: tuple[Problem, ...]


ONE_DIGIT = Addition("one-digit", 1, 9, (Problem(2, 1), Problem(4, 4)))
TWO_DIGIT = Addition("two-digit", 10, 99, (Problem(23, 45), Problem(51, 37)))
TASKS = (ONE_DIGIT, TWO_DIGIT)
# the demo's: the variant on which SmolLM2-135M-Instruct starts with a mean reward between 0.1 and
# 0.7, so that groups differ (`rose bench task_reward` measures each; docs/demo.md "The task")
TASK = ONE_DIGIT


def problem(rng: random.Random, task: Addition = TASK) -> Problem:
    return Problem(rng.randint(task.lo, task.hi), rng.randint(task.lo, task.hi))


def first_int(text: str) -> int | None:
    """The first integer in `text` ("1,234" is read as 1); None when there is none."""
    m = _INT.search(text)
    return int(m.group()) if m else None


def reward(answer_text: str, p: Problem) -> float:
    return 1.0 if first_int(answer_text) == p.answer else 0.0


def group_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """(r - mean) / (std + eps) over one group; all zeros when the rewards are all equal."""
    if len(rewards) < 2:
        return [0.0] * len(rewards)
    m = statistics.fmean(rewards)
    s = statistics.pstdev(rewards)
    if s < eps:
        return [0.0] * len(rewards)
    return [(r - m) / (s + eps) for r in rewards]


def trainable(names: list[str], n_layers: int, train_layers: int) -> set[str]:
    """The parameters a step updates: the last `train_layers` decoder layers and the final norm."""
    prefixes = tuple(f"model.layers.{i}." for i in range(max(0, n_layers - train_layers), n_layers))
    return {n for n in names if n.startswith(prefixes) or n.startswith("model.norm.")}


def trainable_parameters(model, train_layers: int) -> tuple[set[str], list]:
    """A transformers causal LM's `trainable` parameters, the others frozen: their names and the
    tensors an optimizer updates."""
    names = [n for n, _ in model.named_parameters()]
    trained = trainable(names, int(model.config.num_hidden_layers), train_layers)
    params = []
    for n, p in model.named_parameters():
        p.requires_grad_(n in trained)
        if n in trained:
            params.append(p)
    return trained, params


def policy_gradient_step(opt, logits, tok, mask, adv: list[float]) -> float:
    """One REINFORCE step: minus the advantage-weighted log-probability of each action token
    (`mask`), averaged over them; the loss."""
    import torch

    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tok[:, 1:, None])[..., 0]
    keep = mask[:, 1:].float()
    a = torch.tensor(adv)[:, None]
    loss = -(a * logp * keep).sum() / keep.sum().clamp(min=1)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def reinforce_step(model, opt, seqs: list[tuple[list[int], list[int]]], adv: list[float], pad: int) -> float:
    """`policy_gradient_step` on a causal LM over `seqs` (each the tokens and its action mask),
    right-padded with `pad`; no step (loss 0) when every advantage is 0, which teaches nothing."""
    import torch

    if not any(a != 0 for a in adv):
        return 0.0
    B, T = len(seqs), max(len(s) for s, _ in seqs)
    tok = torch.full((B, T), pad, dtype=torch.long)
    att = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, (s, m) in enumerate(seqs):
        tok[i, : len(s)] = torch.tensor(s)
        att[i, : len(s)] = 1
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.bool)
    logits = model(input_ids=tok, attention_mask=att).logits
    return policy_gradient_step(opt, logits, tok, mask, adv)


def load_tokenizer(checkpoint: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


SYSTEM = "You are a calculator. Reply with the sum only."


def messages(p: Problem, task: Addition = TASK) -> list[dict]:
    """The chat: the system line, the solved examples, then the question."""
    out = [{"role": "system", "content": SYSTEM}]
    for e in task.examples:
        out += [{"role": "user", "content": e.question}, {"role": "assistant", "content": str(e.answer)}]
    return out + [{"role": "user", "content": p.question}]


def prompt_text(tokenizer, p: Problem, task: Addition = TASK) -> str:
    """The chat as the checkpoint's chat template renders it, ready for the answer."""
    return str(tokenizer.apply_chat_template(messages(p, task), tokenize=False, add_generation_prompt=True))


def prompt_ids(tokenizer, p: Problem, task: Addition = TASK) -> list[int]:
    text = prompt_text(tokenizer, p, task)
    return list(tokenizer.encode(text, add_special_tokens=False))


def has_chat_template(checkpoint: str) -> bool:
    """Whether the checkpoint's tokenizer carries a chat template (in tokenizer_config.json or,
    as newer transformers save it, chat_template.jinja / .json), which renders the prompts."""
    import json
    from pathlib import Path

    d = Path(checkpoint)
    if (d / "chat_template.jinja").is_file() or (d / "chat_template.json").is_file():
        return True
    cfg = d / "tokenizer_config.json"
    return cfg.is_file() and bool(json.loads(cfg.read_text()).get("chat_template"))
