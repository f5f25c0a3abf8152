"""SGLang's native `POST /generate` shape over the gateway's turns, as slime's rollout sends it
(`slime/rollout/sglang_rollout.py`, `sglang_streaming_rollout.py`) and reads the answer.

A request carries `input_ids` (or `text` where the gateway has the checkpoint's tokenizer,
rose.gateway.text) and `sampling_params`; the answer carries `text` (the decoded answer; "" without
a tokenizer), `output_ids` and `meta_info` (`finish_reason` `{"type": "stop" | "length" |
"abort"}`, `prompt_tokens`, `completion_tokens`, `output_token_logprobs` as `[logprob, token_id,
text-or-null]` per token, `weight_version`, each token's version and their spans,
`weight_versions`). Streamed, each SSE chunk is the whole answer so far (SGLang's default,
cumulative), then `data: [DONE]`.

A request may pin the policy version: `min_required_version` (every token at it or newer) or
`exact_version` (every token at it), at the top level as slime sends them or inside
`weight_version` (`{"exact_version": N}` or `{"min_required_version": N}`). `stop_token_ids` cut the answer after the first one the
turn samples (the worker samples on to `max_new_tokens`; what follows the stop is dropped: the
prefix is sampled as it would have been). docs/gateway.md, "SGLang's /generate"."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rose.gateway import api
from rose.rollout.episode import MAX_TOKEN_ID, MAX_TOKENS

if TYPE_CHECKING:
    from rose.gateway.dispatch import WorkerWeights
    from rose.gateway.text import TextCodec

# SGLang's SamplingParams default, the length a request that names none gets
SGLANG_MAX_NEW_TOKENS = 128
# the header slime sends a sample's session in for SGLang Model Gateway's consistent hashing;
# here it is the turn's session (its turns go to one worker while it runs)
ROUTING_KEY_HEADER = "x-smg-routing-key"
Version = int | str  # SGLang names weight versions by strings; ROSE's are ints
PIN_FIELDS = ("exact_version", "min_required_version", "min_weight_version")


def _version(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, str) and v.strip().isdigit())):
        raise ValueError(f"expected a weight version (an int >= 0, or its digits as a string), got {v!r}")
    n = int(v)
    if n > api.MAX_SEED:
        raise ValueError(f"expected a weight version up to {api.MAX_SEED}, got {n}")
    return n


class SamplingParams(BaseModel):
    """What SGLang's `sampling_params` may say that the workers can honour; a field not named
    here is refused naming it, so a setting is never silently dropped."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(default=SGLANG_MAX_NEW_TOKENS, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(default=None, ge=0, le=api.MAX_SEED)
    sampling_seed: int | None = Field(default=None, ge=0, le=api.MAX_SEED)  # SGLang's name for it
    # how SGLang turns ids into text: the first is honoured where the gateway has a tokenizer
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    spaces_between_special_tokens: bool | None = None

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        for i, t in enumerate(v or []):
            if not 0 <= t <= MAX_TOKEN_ID:
                raise ValueError(f"expected token ids (ints 0..{MAX_TOKEN_ID}), got {t!r} at index {i}")
        return v

    def check_supported(self) -> None:
        """Refuse what the workers do not do, naming the field."""
        if self.temperature is not None and self.temperature != 1.0:
            raise api.Unsupported("sampling_params.temperature", "workers sample at temperature 1.0 only")
        if self.top_p is not None and self.top_p != 1.0:
            raise api.Unsupported("sampling_params.top_p", "workers sample the whole distribution (top_p 1.0)")
        if self.top_k not in (None, -1, 0):
            raise api.Unsupported("sampling_params.top_k", "workers sample the whole distribution (-1)")
        if self.stop:
            raise api.Unsupported("sampling_params.stop", "stop strings are not applied; use stop_token_ids")
        if None not in (self.seed, self.sampling_seed) and self.seed != self.sampling_seed:
            raise api.Unsupported("sampling_params.seed", "seed and sampling_seed disagree; send one")

    def the_seed(self) -> int | None:
        return self.seed if self.seed is not None else self.sampling_seed


class GenerateRequest(BaseModel):
    """`POST /generate`, SGLang's native request (the fields slime sends)."""

    model_config = ConfigDict(extra="forbid")

    input_ids: Any = None
    text: Any = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    return_logprob: bool = False
    stream: bool = False
    rid: str | None = None
    return_text_in_logprobs: bool | None = None
    exact_version: Version | None = None
    min_required_version: Version | None = None
    min_weight_version: Version | None = None  # the OpenAI endpoints' name for the minimum
    weight_version: Any = None  # {"exact_version": N} or {"min_required_version": N} (CONTRACT §8)
    image_data: Any = None
    return_routed_experts: bool = False

    @field_validator("input_ids")
    @classmethod
    def _ids(cls, v: Any) -> list[int] | None:
        return None if v is None else api._token_ids(v, "input_ids")

    @field_validator("exact_version", "min_required_version", "min_weight_version")
    @classmethod
    def _pin(cls, v: Any) -> int | None:
        return _version(v)

    @field_validator("weight_version")
    @classmethod
    def _nested_pin(cls, v: Any) -> dict[str, int] | None:
        if v is None:
            return None
        if not isinstance(v, dict) or len(v) != 1 or not set(v) <= set(PIN_FIELDS[:2]):
            raise ValueError(f"expected {{'exact_version': N}} or {{'min_required_version': N}}, got {v!r}")
        ((k, n),) = v.items()
        version = _version(n)
        if version is None:
            raise ValueError(f"weight_version.{k}: expected a weight version, got null")
        return {k: version}

    def _pins(self) -> dict[str, int]:
        """The pins given, by the field that gave them."""
        pins = {f: int(getattr(self, f)) for f in PIN_FIELDS if getattr(self, f) is not None}
        for k, n in (self.weight_version or {}).items():
            pins[f"weight_version.{k}"] = n
        return pins

    def check_supported(self, text: TextCodec | None = None) -> list[int]:
        """The prompt's token ids (`text` tokenized where the gateway has a tokenizer); refuses what
        the gateway cannot honour, naming the field."""
        if self.text is not None and self.input_ids is not None:
            raise api.Unsupported("text", "send the prompt once: text or input_ids")
        if self.text is not None and text is None:
            raise api.Unsupported(
                "text", "a text prompt needs gateway.tokenizer, which this gateway has not; send input_ids"
            )
        if self.text is not None and not (isinstance(self.text, str) and self.text):
            raise api.Unsupported("text", "expected the prompt as a non-empty string")
        if self.input_ids is None and self.text is None:
            raise api.Unsupported("input_ids", "required: the prompt as a list of token ids (or text)")
        if self.image_data is not None:
            raise api.Unsupported("image_data", "images are not supported")
        if self.return_routed_experts:
            raise api.Unsupported("return_routed_experts", "the workers do not report routed experts")
        pins = list(self._pins())
        if len(pins) > 1:
            raise api.Unsupported(pins[1], f"one version pin per request; {pins[0]} is given too")
        self.sampling_params.check_supported()
        if self.input_ids is not None:
            return list(self.input_ids)
        assert text is not None and isinstance(self.text, str)
        try:  # the tokenizer's ids within what the workers take
            return api._token_ids(text.encode(self.text), "text")
        except ValueError as e:
            raise api.Unsupported("text", str(e)) from None

    def pin(self) -> api.Pin | None:
        for f, n in self._pins().items():
            return api.Pin(n, f.endswith("exact_version"), f)
        return None


def _stop_at(ids: list[int], stop_ids: list[int] | None) -> int | None:
    """The index just past the first stop token in `ids` (None: none)."""
    stops = set(stop_ids or ())
    return next((i + 1 for i, t in enumerate(ids) if t in stops), None)


class Answer:
    """A /generate answer built as tokens come (SGLang's shape): `add` takes output tokens in
    order, ignoring those past a stop token or the first of a version the pin does not meet;
    `body` is the answer so far, or the final one once `finish` (or `abort`) has been said."""

    def __init__(self, rid: str, req: GenerateRequest, prompt_tokens: int, text: TextCodec | None = None):
        self.rid, self.req, self.prompt_tokens, self.text = rid, req, prompt_tokens, text
        self.pin = req.pin()
        self.ids: list[int] = []
        self.versions: list[int] = []
        self.logprobs: list[float] = []
        self.finish: dict[str, Any] | None = None
        self.worker = ""

    def add(self, ids: list[int], versions: list[int], logprobs: list[float] | None) -> None:
        for k, (t, v) in enumerate(zip(ids, versions)):
            if self.finish is not None:
                return
            if self.pin is not None and not self.pin.met(v):
                self.abort(
                    f"{self.pin.field}: token {len(self.ids)} would be of policy version {v}; the answer stops before it"
                )
                return
            self.ids.append(t)
            self.versions.append(v)
            if logprobs is not None and len(logprobs) == len(ids):
                self.logprobs.append(logprobs[k])
            if _stop_at([t], self.req.sampling_params.stop_token_ids):
                self.finish = {"type": "stop", "matched": t}

    def abort(self, message: str) -> None:
        if not self.aborted():
            self.finish = {"type": "abort", "message": message}

    def end(self, r: api.TurnResult) -> None:
        """The whole turn: the tokens not yet added, then `length` unless it stopped before."""
        self.add(r.token_ids[len(self.ids) :], r.versions[len(self.ids) :], r.logprobs[len(self.ids) :] or None)
        self.worker = r.worker
        if self.finish is None:
            self.finish = {"type": "length", "length": len(self.ids)}

    def aborted(self) -> bool:
        return self.finish is not None and self.finish["type"] == "abort"

    def body(self, final: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish if final else None,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.ids),
            "cached_tokens": 0,
            "weight_version": str(self.versions[-1]) if self.versions else None,
            "output_token_weight_versions": self.versions,
            "weight_versions": api.version_spans(self.versions),
            "worker": self.worker or None,
        }
        if self.req.return_logprob:
            lps: list[float | None] = (
                list(self.logprobs) if len(self.logprobs) == len(self.ids) else [None] * len(self.ids)
            )
            texts: list[str | None] = (
                list(self.text.pieces(self.ids))
                if self.text and self.req.return_text_in_logprobs
                else [None] * len(self.ids)
            )
            meta["output_token_logprobs"] = [[lp, t, x] for lp, t, x in zip(lps, self.ids, texts)]
        skip = self.req.sampling_params.skip_special_tokens is not False
        text = self.text.decode(self.ids, skip_special_tokens=skip) if self.text else ""
        return {"text": text, "output_ids": self.ids, "meta_info": meta}


class GenerateStream(api.StreamShape):
    """A streamed /generate turn in the gateway's stream loop: each call brings the whole answer
    so far (SGLang's cumulative chunks), the tail the final one; an error ends it as an abort
    that keeps the tokens sent."""

    def __init__(self, answer: Answer, prompt: list[int]):
        super().__init__(answer.rid, "", prompt, chat=False, logprobs=answer.req.return_logprob)
        self.answer = answer

    def head(self) -> list[dict[str, Any]]:
        return []

    def pieces(
        self, start: int, ids: list[int], versions: list[int], logprobs: list[float] | None = None
    ) -> list[dict[str, Any]]:
        if self.answer.finish is not None or start != len(self.answer.ids) or not ids:
            return []
        self.answer.add(ids, versions, logprobs)
        return [self.answer.body(final=False)] if self.answer.finish is None else []

    def tail(self, r: api.TurnResult) -> dict[str, Any]:
        self.answer.end(r)
        return self.answer.body(final=True)

    def error(self, message: str, param: str | None, kind: str, code: str | None) -> dict[str, Any]:
        self.answer.abort(message)
        return self.answer.body(final=True)


class DiskWeightsRequest(BaseModel):
    """SGLang's `POST /update_weights_from_disk`: the full checkpoint at `model_path` (a path the
    gateway reads) published as `weight_version` (absent: the next one) on the model's weight
    stream, which the fleet pulls (the publish-only mode: the trainer publishes, the workers
    apply it between decode steps). SGLang's load settings are accepted and change nothing."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(min_length=1)
    weight_version: Version | None = None
    load_format: str | None = None
    flush_cache: bool | None = None
    abort_all_requests: bool | None = None

    @field_validator("weight_version")
    @classmethod
    def _v(cls, v: Any) -> int | None:
        n = _version(v)
        if n == 0:
            raise ValueError("expected a version >= 1 (the weight stream numbers versions from 1)")
        return n

    def publish(self) -> api.WeightsRequest:
        v = None if self.weight_version is None else int(self.weight_version)
        return api.WeightsRequest(checkpoint=self.model_path, version=v)


def fleet_version(workers: list[WorkerWeights], latest: int | None) -> dict[str, Any]:
    """`GET /get_weight_version` for a fleet: `weight_version` is the oldest version a running
    worker serves (what an unpinned request may get; SGLang's engine answers its own), `newest`
    the newest, `latest_published` the weight stream's (null: none), `workers` each one's."""
    running = [w for w in workers if w.state == "running"]
    vs = [w.version for w in running]
    return {
        "weight_version": str(min(vs)) if vs else None,
        "newest": str(max(vs)) if vs else None,
        "latest_published": None if latest is None else str(latest),
        "workers": {w.worker: str(w.version) for w in running},
    }
