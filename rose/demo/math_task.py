"""The demo's verifiable task on a real checkpoint: two-digit addition, "What is A + B?".

A prompt is the question as the checkpoint's chat template renders it for a user turn (with the
assistant's header after it), as token ids, after a system line asking for the sum alone and two
solved examples (without them SmolLM2-135M-Instruct answers in prose and almost never starts with
the sum); the episode is one turn of a few tokens. The reward
is 1 when the first integer in the decoded answer is A + B, else 0. Advantages are normalised
within each group of samples of the same prompt (GRPO): a group whose samples all earn the same
reward teaches nothing and gets advantage 0.
"""

from __future__ import annotations

import random
import re
import statistics
from dataclasses import dataclass

_INT = re.compile(r"-?\d+")


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


def problem(rng: random.Random) -> Problem:
    """Two two-digit addends."""
    return Problem(rng.randrange(10, 100), rng.randrange(10, 100))


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


def load_tokenizer(checkpoint: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


SYSTEM = "You are a calculator. Reply with the sum only."
EXAMPLES = (Problem(23, 45), Problem(51, 37))


def messages(p: Problem) -> list[dict]:
    """The chat: the system line, the solved examples, then the question."""
    out = [{"role": "system", "content": SYSTEM}]
    for e in EXAMPLES:
        out += [{"role": "user", "content": e.question}, {"role": "assistant", "content": str(e.answer)}]
    return out + [{"role": "user", "content": p.question}]


def prompt_ids(tokenizer, p: Problem) -> list[int]:
    """The chat as the checkpoint's chat template renders it, ready for the answer."""
    text = tokenizer.apply_chat_template(messages(p), tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))
