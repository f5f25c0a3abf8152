"""A random-init Hugging Face causal-LM checkpoint of a named architecture and shape.

The tests and benches roll out on such a checkpoint: real architecture code paths (vLLM's and
transformers'), a few megabytes, no download. Weights come from transformers' own initialiser
under a fixed seed (in float32, then cast to the asked dtype), so the same arguments give the
same bytes. With `tokenizer=True` a small byte-level BPE of the model's vocabulary size is
trained locally and written beside the weights (rose.model.tokenizer).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from rose.model.tokenizer import MIN_VOCAB, train_tokenizer

# architecture name -> transformers config class name
ARCHS = {"qwen2": "Qwen2Config", "llama": "LlamaConfig", "mistral": "MistralConfig", "qwen3": "Qwen3Config"}
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class CheckpointShape:
    arch: str = "qwen2"
    layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 1024
    max_positions: int = 2048
    tie_embeddings: bool = True

    def check(self) -> None:
        """Raise ValueError naming the flag at fault and what to pass instead."""
        if self.arch not in ARCHS:
            raise ValueError(f"--arch {self.arch!r} is not known: pass one of {', '.join(sorted(ARCHS))}")
        sizes = {
            "--layers": self.layers,
            "--hidden": self.hidden,
            "--heads": self.heads,
            "--kv-heads": self.kv_heads,
            "--intermediate": self.intermediate,
            "--vocab": self.vocab,
            "--max-positions": self.max_positions,
        }
        for flag, value in sizes.items():
            if value < 1:
                raise ValueError(f"{flag} {value}: must be a positive integer")
        if self.hidden % self.heads:
            raise ValueError(
                f"--hidden {self.hidden} is not divisible by --heads {self.heads}: "
                f"pass a --hidden that is a multiple of {self.heads} (e.g. {self.heads * 64})"
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"--heads {self.heads} is not divisible by --kv-heads {self.kv_heads}: "
                f"pass a --kv-heads that divides {self.heads} (e.g. 1 or {self.heads})"
            )
        if (self.hidden // self.heads) % 2:
            raise ValueError(
                f"--hidden {self.hidden} / --heads {self.heads} gives an odd head size "
                f"{self.hidden // self.heads}; rotary embeddings need an even one: change --hidden or --heads"
            )

    def config(self):
        """The transformers config of this shape (a PretrainedConfig)."""
        import transformers

        self.check()
        return getattr(transformers, ARCHS[self.arch])(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.max_positions,
            tie_word_embeddings=self.tie_embeddings,
        )


def check_args(shape: CheckpointShape, dtype: str = "float32", tokenizer: bool = False):
    """The transformers config of `shape` if `init_checkpoint` can write it with these arguments;
    otherwise ValueError naming the flag at fault and what to pass instead. Writes nothing."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not supported: pass one of {', '.join(DTYPES)}")
    shape.check()
    if tokenizer:
        if shape.vocab < MIN_VOCAB:
            raise ValueError(
                f"--vocab {shape.vocab}: --tokenizer needs at least {MIN_VOCAB} "
                f"(256 bytes + 2 special tokens); pass --vocab {MIN_VOCAB} or more"
            )
    return shape.config()


def init_checkpoint(
    out: str | Path,
    shape: CheckpointShape = CheckpointShape(),
    seed: int = 0,
    *,
    dtype: str = "float32",
    tokenizer: bool = False,
) -> Path:
    """Write a random-init checkpoint of `shape` (safetensors in `dtype`, config.json; with
    `tokenizer`, tokenizer.json and tokenizer_config.json too) to `out`; returns `out`.

    Bad arguments raise ValueError before anything is written."""
    config = check_args(shape, dtype, tokenizer)

    import torch
    import transformers

    out = Path(out)
    if tokenizer:
        ids = train_tokenizer(out, shape.vocab, shape.max_positions)
        config.bos_token_id, config.eos_token_id, config.pad_token_id = ids.bos, ids.eos, ids.pad
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # the initialiser draws float32 whatever the caller set
    try:
        model = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default)
    model.to(getattr(torch, dtype))
    if tokenizer:  # generate() reads these from the generation config
        gen = model.generation_config
        gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = ids.bos, ids.eos, ids.pad
    model.save_pretrained(out)
    return out


def checkpoint_parameters(out: str | Path) -> int:
    """Parameters stored in the safetensors files of the checkpoint at `out` (a tied embedding
    is stored, and counted, once); read from the file headers, no tensor is loaded."""
    total = 0
    for f in sorted(Path(out).glob("*.safetensors")):
        with f.open("rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total
