"""`POST /generate` with text, on a gateway given the checkpoint's tokenizer (`gateway.tokenizer`),
over the real Redis and two hf-engine workers on the tiny checkpoint with a locally trained
tokenizer (CONTRACT §8: `text` where the checkpoint has a tokenizer): a text prompt is tokenized
as the tokenizer does by default, the answer's `text` is its `output_ids` decoded, each token's
text comes back in `output_token_logprobs` when asked, and bad text is a 400 naming the field.
A gateway configured with a directory that holds no tokenizer is refused at start, naming
`gateway.tokenizer`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rose.config import Config, ConfigError, load_config
from tests.test_example_grpo import flags, gw, workers  # noqa: F401 (fixtures)
from tests.test_example_trl import tiny_checkpoint  # noqa: F401 (the checkpoint with a tokenizer)
from tests.test_gateway import KEY, prefixed_gateway_cfg

pytestmark = pytest.mark.stack

AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def module_cfg(stack, base_cfg, tiny_checkpoint) -> Iterator[Config]:  # noqa: F811
    for c in prefixed_gateway_cfg(stack, base_cfg):
        yield dataclasses.replace(c, gateway=dataclasses.replace(c.gateway, tokenizer=str(tiny_checkpoint)))


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):  # noqa: F811
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint)


def generate(url: str, body: dict) -> httpx.Response:
    """One turn, on the worker that holds the session (so a seed gives the same tokens again)."""
    return httpx.post(url + "/generate", json=body, headers={**AUTH, "X-SMG-Routing-Key": "text"}, timeout=60)


def test_a_text_prompt_is_answered_with_its_text(gw, tok):  # noqa: F811
    sampling = {"sampling_params": {"max_new_tokens": 12, "seed": 3}, "return_logprob": True}
    body = {"text": PROMPT, **sampling}
    r = generate(gw.url, {**body, "return_text_in_logprobs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    ids, meta = out["output_ids"], out["meta_info"]
    assert len(ids) == 12 and meta["prompt_tokens"] == len(tok.encode(PROMPT))
    assert out["text"] == tok.decode(ids, skip_special_tokens=True)
    assert [item[1] for item in meta["output_token_logprobs"]] == ids
    assert [item[2] for item in meta["output_token_logprobs"]] == [tok.decode([t]) for t in ids]
    same = generate(gw.url, {"input_ids": tok.encode(PROMPT), **sampling}).json()
    assert same["output_ids"] == ids  # the text is the ids the tokenizer gives, sampled with the same seed
    assert all(item[2] is None for item in same["meta_info"]["output_token_logprobs"])  # not asked
    kept = generate(gw.url, {**body, "sampling_params": {**body["sampling_params"], "skip_special_tokens": False}})
    assert kept.json()["text"] == tok.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize(
    "body, field",
    [
        ({"text": "", "sampling_params": {}}, "text"),
        ({"text": ["two", "prompts"], "sampling_params": {}}, "text"),
        ({"text": PROMPT, "input_ids": [1, 2]}, "text"),
        ({"text": PROMPT, "sampling_params": {"stop": ["\n"]}}, "sampling_params.stop"),
    ],
)
def test_bad_text_is_a_400_naming_the_field(gw, body, field):  # noqa: F811
    r = generate(gw.url, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert r.json()["error"]["message"].startswith(field) and "\n" not in r.json()["error"]["message"]


def test_a_tokenizer_path_without_one_is_refused_naming_the_setting(tmp_path: Path):
    cfg = tmp_path / "rose.toml"
    cfg.write_text(f'[gateway]\ntokenizer = "{tmp_path}"\n')
    with pytest.raises(ConfigError, match=r"^gateway\.tokenizer: .* holds no tokenizer"):
        load_config(cfg, env={})
