"""Text in and out of `POST /generate` where the gateway is given the checkpoint's tokenizer
(`gateway.tokenizer`, CONTRACT §8: `text` "where the checkpoint has a tokenizer"). The workers
decode token ids either way; the gateway tokenizes a `text` prompt as SGLang's tokenizer manager
does (the tokenizer's own special tokens added) and detokenizes the answer. Without a tokenizer
the gateway speaks token ids only and refuses `text`, naming the field."""

from __future__ import annotations

from typing import Any


class TextCodec:
    """A Hugging Face tokenizer, loaded once when the gateway starts."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        try:
            self.tok: Any = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"gateway.tokenizer: no tokenizer loads from {path!r} ({type(e).__name__}); "
                "give a Hugging Face checkpoint or tokenizer directory, or leave it empty for token ids only"
            ) from None
        self.path = path

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tok.encode(text)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def pieces(self, ids: list[int]) -> list[str]:
        """Each token's own text (SGLang's `return_text_in_logprobs`)."""
        return [str(self.tok.decode([t])) for t in ids]


def text_codec(path: str) -> TextCodec | None:
    """`gateway.tokenizer`'s codec; None where it is empty (token ids only)."""
    return TextCodec(path) if path else None
