"""A small byte-level BPE tokenizer, trained locally for a random-init checkpoint (`--tokenizer`).

The corpus is built in: English prose, digits and numbers, and arithmetic questions with their
answers ("What is 12 + 30?" ... "The answer is 42."), the text the reference tasks roll out on.
Byte-level means any text encodes and decodes back unchanged, whatever the corpus held.

The vocabulary has exactly the model's size: two special tokens first (eos, then pad), the 256
byte symbols, the merges learned from the corpus, and, when the corpus runs out of merges before
the size is reached, reserved special tokens `<|reserved_N|>` to fill it (as Llama 3 does).
The same vocabulary size gives the same files, byte for byte.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

EOS = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL = (EOS, PAD)  # ids 0 and 1
RESERVED = "<|reserved_{}|>"
MIN_VOCAB = len(SPECIAL) + 256  # the specials and every byte

_PROSE = """\
The quick brown fox jumps over the lazy dog. A model reads a question, thinks, and writes an answer.
Solve the problem step by step, then give the final answer on its own line.
Reinforcement learning improves a policy from the rewards of its own rollouts.
The serving fleet is busy by day and idle by night; rollout borrows the idle capacity.
Each episode starts with a prompt. The policy samples tokens until it writes the end of text.
If the answer is correct the reward is one, otherwise it is zero.
Numbers are written with digits: zero is 0, one is 1, two is 2, ten is 10, and a hundred is 100.
Add the two numbers, carry the ten, and check the sum. Subtract, multiply, divide, and compare.
Question: How many apples are left if you have 7 and eat 3? Answer: 4 apples are left.
Please answer with a single number. Think about it first. Let us work it out together.
This is a test. It is only a test. The weather is fine today, and the sea is calm.
"""


def corpus() -> list[str]:
    """The training text: fixed, so that training is reproducible (its own seed, not the model's)."""
    rng = random.Random(0)
    lines = _PROSE.splitlines()
    lines.append(" ".join(str(d) for d in range(10)))
    lines.extend(" ".join(str(n) for n in range(start, start + 50)) for start in range(0, 1000, 50))
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for _ in range(3000):
        op = rng.choice("+-*")
        a, b = rng.randrange(100), rng.randrange(100 if op != "*" else 13)
        lines.append(f"What is {a} {op} {b}?")
        lines.append(f"Question: What is {a} {op} {b}? Answer: {ops[op](a, b)}")
        lines.append(f"{a} {op} {b} = {ops[op](a, b)}. The answer is {ops[op](a, b)}.")
    return lines


@dataclass(frozen=True)
class SpecialIds:
    eos: int
    pad: int
    bos: int  # the eos token, as in GPT-2: nothing is prepended when encoding


def train_tokenizer(out: str | Path, vocab_size: int, max_length: int) -> SpecialIds:
    """Train the BPE to exactly `vocab_size` tokens and write tokenizer.json and
    tokenizer_config.json to `out` (AutoTokenizer loads them); returns the special token ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < MIN_VOCAB:
        raise ValueError(
            f"--vocab {vocab_size}: a byte-level tokenizer needs at least {MIN_VOCAB} "
            f"(256 bytes + {len(SPECIAL)} special tokens); pass --vocab {MIN_VOCAB} or more"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([AddedToken(RESERVED.format(i), special=True) for i in range(missing)])
    if tok.get_vocab_size() != vocab_size:  # the trainer never overshoots; this guards the padding
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, not {vocab_size}")
    eos, pad = tok.token_to_id(EOS), tok.token_to_id(PAD)
    assert eos is not None and pad is not None  # the trainer puts the special tokens first
    ids = SpecialIds(eos=eos, pad=pad, bos=eos)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    # written here rather than by transformers' save_pretrained, whose class name differs between
    # releases: this one loads in transformers 4.x and 5.x, and in vLLM
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ids
