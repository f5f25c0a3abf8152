"""The gateway's wire shapes: OpenAI requests as pydantic models (a bad request is refused
naming its field), and the responses and stream chunks built from a finished turn.

Token ids in and out: a prompt (or a chat message's content) is a list of token ids; every
choice carries the generated `token_ids`, the policy version of each as contiguous spans
(`weight_versions`: `{version, start, end}` over output-token indexes, end exclusive) and the
`worker` that finished the turn. Text is not produced: the gateway has no tokenizer (`text` and
`content` are ""). Asked for, a choice's `logprobs` carries the sampled tokens' log-probabilities
in OpenAI's shapes, each token named by its id as a string (`token_logprobs`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rose.rollout.episode import MAX_TOKEN_ID, MAX_TOKENS

MAX_SEED = (1 << 63) - 1
DEFAULT_MAX_TOKENS = 16


class Unsupported(ValueError):
    """A request field the gateway cannot honour; `field` names it."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field


def _token_ids(v: Any, what: str) -> list[int]:
    if isinstance(v, str):
        raise ValueError(f"{what} as text needs a tokenizer, which this gateway has not; send a list of token ids")
    if not isinstance(v, list) or not v:
        raise ValueError(f"expected a non-empty list of token ids, got {type(v).__name__}")
    if all(isinstance(x, list) for x in v):
        raise ValueError("one prompt per request (a list of token ids), not a batch")
    for i, t in enumerate(v):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
            raise ValueError(f"expected token ids (ints 0..{MAX_TOKEN_ID}), got {t!r} at index {i}")
    return v


class TurnRequest(BaseModel):
    """The sampling fields both endpoints share; others OpenAI defines are ignored unless refused below."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(default=None, ge=0.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stream: bool = False
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    user: str | None = None
    return_token_ids: bool | None = None  # vLLM's extension; token ids are always returned here
    # served only by engines that have applied this policy version or a newer one (docs/gateway.md)
    min_weight_version: int | None = Field(default=None, ge=0, le=MAX_SEED)

    def check_supported(self) -> None:
        """Refuse what the engines do not do (yet), naming the field."""
        if self.temperature is not None and self.temperature != 1.0:
            raise Unsupported("temperature", "workers sample at temperature 1.0; other values are not supported yet")
        if self.n != 1:
            raise Unsupported("n", "one choice per request")
        if self.stop:
            raise Unsupported("stop", "turns end at max_tokens; stop sequences are not supported")

    def tokens(self) -> int:
        return self.max_tokens or DEFAULT_MAX_TOKENS

    def pin(self) -> Pin | None:
        v = self.min_weight_version
        return None if v is None else Pin(v, False, "min_weight_version")

    def wants_logprobs(self) -> bool:
        """Whether the answer carries the sampled tokens' log-probabilities."""
        return False


class CompletionRequest(TurnRequest):
    prompt: Any
    logprobs: int | None = None
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> list[int]:
        return _token_ids(v, "a prompt")

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None and self.logprobs not in (0, 1):
            raise Unsupported("logprobs", "0 or 1: only the sampled token's log-probability is known, no alternatives")
        if self.echo:
            raise Unsupported("echo", "not supported")

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Any

    @field_validator("content")
    @classmethod
    def _content(cls, v: Any) -> list[int]:
        return _token_ids(v, "content")


class ChatRequest(TurnRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs:
            raise Unsupported("top_logprobs", "0 or absent: only the sampled token's log-probability is known")

    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def tokens(self) -> int:
        return self.max_completion_tokens or super().tokens()

    def prompt(self) -> list[int]:
        """The messages' token ids, in order (no chat template: the caller's ids are the prompt)."""
        return [t for m in self.messages for t in m.content]


@dataclass(frozen=True)
class Pin:
    """A request's weight-version pin: every token at `version` (`exact`) or at it or newer, as
    the request's field `field` asked."""

    version: int
    exact: bool
    field: str

    def met(self, v: int) -> bool:
        return v == self.version if self.exact else v >= self.version


class WeightsRequest(BaseModel):
    """`POST /v1/weights`: publish the safetensors checkpoint at `checkpoint` (a path the gateway
    reads: a .safetensors file or an HF checkpoint directory) as the served model's next weight
    version (or as `version`), floating-point tensors cast to `dtype` (None: as stored)."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: str = Field(min_length=1)
    version: int | None = Field(default=None, ge=1, le=MAX_SEED)
    dtype: Literal["bfloat16", "float16", "float32"] | None = None


@dataclass(frozen=True)
class TurnResult:
    """A finished turn, as the trajectory of its one-turn task holds it."""

    task_id: str
    prompt: list[int]
    token_ids: list[int]
    versions: list[int]  # per output token
    worker: str
    gpu: str
    moves: int
    logprobs: list[float] = field(default_factory=list)  # per output token; empty when not known

    @classmethod
    def from_trajectory(cls, traj: dict) -> TurnResult:
        turn = traj["turns"][0]
        ids = list(turn["action"])
        versions = list(turn.get("versions") or [turn["version"]] * len(ids))
        logprobs = [float(x) for x in turn.get("logprobs") or []]
        return cls(
            task_id=str(traj["task_id"]),
            prompt=list(traj["prompt"]),
            token_ids=ids,
            versions=versions,
            worker=str(turn.get("worker") or traj.get("worker", "")),
            gpu=str(turn.get("gpu") or traj.get("gpu", "")),
            moves=int(traj.get("moves", 0)),
            logprobs=logprobs if len(logprobs) == len(ids) else [],
        )


def version_spans(versions: list[int]) -> list[dict[str, int]]:
    """Per-token versions as contiguous spans: [{version, start, end}], end exclusive."""
    spans: list[dict[str, int]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


def logprobs_field(ids: list[int], logprobs: list[float], chat: bool) -> dict[str, Any] | None:
    """A choice's `logprobs` in OpenAI's shape (tokens named by their ids as strings; text
    offsets are 0, the text being empty); None when the tokens' logprobs are not known."""
    if len(logprobs) != len(ids) or not ids:
        return None
    if chat:
        return {
            "content": [
                {"token": str(t), "logprob": lp, "bytes": None, "top_logprobs": []} for t, lp in zip(ids, logprobs)
            ]
        }
    return {
        "tokens": [str(t) for t in ids],
        "token_logprobs": logprobs,
        "top_logprobs": None,
        "text_offset": [0] * len(ids),
    }


def _usage(r: TurnResult) -> dict[str, int]:
    n, p = len(r.token_ids), len(r.prompt)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


def _rose_fields(r: TurnResult) -> dict[str, Any]:
    return {"token_ids": r.token_ids, "weight_versions": version_spans(r.versions), "worker": r.worker}


def _answer(
    rid: str, obj: str, model: str, choice: dict[str, Any], r: TurnResult, logprobs: bool = False, **extra: Any
) -> dict[str, Any]:
    """OpenAI's envelope around one choice (ROSE's fields in it), with the turn's usage."""
    lp = logprobs_field(r.token_ids, r.logprobs, obj == "chat.completion") if logprobs else None
    choice = {"index": 0, **choice, "finish_reason": "length", "logprobs": lp, **_rose_fields(r)}
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        **extra,
        "usage": _usage(r),
    }


def completion(rid: str, model: str, r: TurnResult, logprobs: bool = False) -> dict[str, Any]:
    out = _answer(rid, "text_completion", model, {"text": ""}, r, logprobs)
    out["choices"][0]["prompt_token_ids"] = r.prompt
    return out


def chat_completion(rid: str, model: str, r: TurnResult, logprobs: bool = False) -> dict[str, Any]:
    message = {"message": {"role": "assistant", "content": ""}}
    return _answer(rid, "chat.completion", model, message, r, logprobs, prompt_token_ids=r.prompt)


class StreamShape:
    """A turn as OpenAI stream chunks: `head` (chat: the role), one `piece` per output token (its
    id and its version's span), then `tail` with the finish reason, all the version spans, the
    worker and the usage. Pieces may be built from tokens as a worker publishes them, before the
    turn ends. With `logprobs`, each piece carries its token's log-probability when it is known
    (the token stream carries them beside the ids)."""

    def __init__(self, rid: str, model: str, prompt: list[int], chat: bool, logprobs: bool = False):
        self.rid, self.model, self.prompt, self.chat = rid, model, prompt, chat
        self.logprobs = logprobs
        self.created = int(time.time())
        self.obj = "chat.completion.chunk" if chat else "text_completion"

    def _chunk(self, choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
        body = {"index": 0, "logprobs": None, "finish_reason": None, **choice}
        return {
            "id": self.rid,
            "object": self.obj,
            "created": self.created,
            "model": self.model,
            "choices": [body],
            **extra,
        }

    def head(self) -> list[dict[str, Any]]:
        if not self.chat:
            return []
        return [self._chunk({"delta": {"role": "assistant", "content": ""}}, prompt_token_ids=self.prompt)]

    def pieces(
        self, start: int, ids: list[int], versions: list[int], logprobs: list[float] | None = None
    ) -> list[dict[str, Any]]:
        """Output tokens `start`.. (their ids and per-token versions, and logprobs when known),
        one chunk each."""
        out = []
        lps = logprobs if self.logprobs and logprobs is not None and len(logprobs) == len(ids) else None
        for i, (t, v) in enumerate(zip(ids, versions), start):
            piece: dict[str, Any] = {"token_ids": [t], "weight_versions": [{"version": v, "start": i, "end": i + 1}]}
            if lps is not None:
                piece["logprobs"] = logprobs_field([t], [lps[i - start]], self.chat)
            if self.chat:
                piece["delta"] = {"content": ""}
            else:
                piece["text"] = ""
                if i == 0:
                    piece["prompt_token_ids"] = self.prompt
            out.append(self._chunk(piece))
        return out

    def tail(self, r: TurnResult) -> dict[str, Any]:
        last: dict[str, Any] = {
            "finish_reason": "length",
            "token_ids": [],
            "weight_versions": version_spans(r.versions),
            "worker": r.worker,
        }
        if self.chat:
            last["delta"] = {}
        else:
            last["text"] = ""
        return self._chunk(last, usage=_usage(r))

    def error(self, message: str, param: str | None, kind: str, code: str | None) -> dict[str, Any]:
        """The event that ends a stream the turn could not finish (OpenAI's error object)."""
        return error(message, param, kind, code)


def error(message: str, param: str | None, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
