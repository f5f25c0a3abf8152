"""SGLang's `POST /generate` on a real gateway (uvicorn in a thread), the real Redis and two real
reference-engine workers that follow the model's weight stream (started once for the module).

Requests are shaped exactly as slime's rollout sends them, as read from THUDM/slime at commit
624b824a898ab0ec1fcb4d373004c7f3852bf515 (`slime/rollout/sglang_rollout.py`: `GenerateState`'s
sampling params and `generate`'s payload; `sglang_streaming_rollout.py`: the streamed one), and
every answer is read the way slime reads it (`slime/utils/types.py`, `Sample._apply_meta_info`):
`text`, `meta_info.output_token_logprobs` (`[logprob, token_id, _]`), `finish_reason.type`,
`weight_version`, `prompt_tokens`, `completion_tokens`. The version pin (`exact_version`,
`min_required_version`) is served at its version or refused with 409 naming it; the publish-only
mode's endpoints (`POST /update_weights_from_disk`, `GET /get_weight_version`) publish a version
the workers pull and report it; a streamed turn revoked midway is answered whole; bad input is a
400 naming the field."""

from __future__ import annotations

import dataclasses

import httpx
import orjson
import pytest
import redis

from tests.test_gateway import (
    JOB,
    KEY,
    PROMPT,
    revoke_midway,
    serve,
    sse,
)
from tests.test_gateway_weights import (  # noqa: F401 - test_gateway_weights' fixtures, reused
    flags,
    gw,
    module_cfg,
    reference_weights,
    workers,
)
from tests.test_rollout_tasks import wait_for

pytestmark = pytest.mark.stack

AUTH = {"Authorization": f"Bearer {KEY}"}
SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"


def slime_payload(input_ids: list[int], max_new_tokens: int, stream: bool = False, **extra) -> dict:
    """`generate`'s payload as slime builds it from `GenerateState.sampling_params` (its
    defaults: temperature 1.0, top_p 1.0, top_k -1, no stop strings or ids), seeded as the
    deterministic-inference mode seeds it (`sampling_seed`)."""
    sampling_params = {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": max_new_tokens,
        "stop": None,
        "stop_token_ids": None,
        "skip_special_tokens": True,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
        "sampling_seed": 7,
    }
    body: dict = {"sampling_params": sampling_params, "return_logprob": True, "input_ids": input_ids}
    if stream:
        body["stream"] = True
    for k, v in extra.items():
        (sampling_params if k in sampling_params or k == "seed" else body)[k] = v
    return body


@dataclasses.dataclass
class SlimeRead:
    """What slime takes from an answer (`generate`, `append_response_tokens`)."""

    tokens: list[int]
    log_probs: list[float]
    text: str
    status: str  # finish_reason.type
    weight_version: str | None
    prompt_tokens: int
    completion_tokens: int


def slime_reads(output: dict) -> SlimeRead:
    meta = output["meta_info"]
    items = meta.get("output_token_logprobs", [])
    return SlimeRead(
        tokens=[item[1] for item in items],
        log_probs=[item[0] for item in items],
        text=output["text"],
        status=meta["finish_reason"]["type"],
        weight_version=meta.get("weight_version"),
        prompt_tokens=meta.get("prompt_tokens", 0),
        completion_tokens=meta.get("completion_tokens", 0),
    )


def generate(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, headers=AUTH, timeout=60)


def streamed(url: str, body: dict) -> list[dict]:
    """The streamed answer's chunks as slime's streaming rollout reads them (`data:` lines, not
    `[DONE]`), each the whole answer so far."""
    return [e for _t, e in sse(url, "/generate", body)]


def test_an_answer_has_every_field_slime_reads(gw, workers):  # noqa: F811 - the imported fixtures
    r = generate(gw.url, slime_payload(PROMPT, 12))
    assert r.status_code == 200, r.text
    out = r.json()
    got = slime_reads(out)
    assert got.status == "length" and got.text == "" and got.tokens == out["output_ids"] and len(got.tokens) == 12
    assert all(0 <= t < 256 for t in got.tokens) and all(isinstance(lp, float) and lp <= 0 for lp in got.log_probs)
    assert len(got.log_probs) == 12 and all(item[2] is None for item in out["meta_info"]["output_token_logprobs"])
    assert (got.prompt_tokens, got.completion_tokens) == (len(PROMPT), 12)
    assert got.weight_version == "0" and out["meta_info"]["output_token_weight_versions"] == [0] * 12
    assert out["meta_info"]["weight_versions"] == [{"version": 0, "start": 0, "end": 12}]  # CONTRACT §6's spans
    assert out["meta_info"]["worker"] in workers
    again = slime_reads(generate(gw.url, slime_payload(PROMPT, 12)).json())
    assert again.tokens == got.tokens  # the seed alone decides the tokens
    bare = generate(gw.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}}).json()
    assert len(bare["output_ids"]) == 3 and "output_token_logprobs" not in bare["meta_info"]  # not asked


def test_a_streamed_answer_grows_chunk_by_chunk_to_the_whole_one(gw):  # noqa: F811 - the imported fixtures
    whole = generate(gw.url, slime_payload(PROMPT, 10)).json()
    chunks = streamed(gw.url, slime_payload(PROMPT, 10, stream=True))
    partial = [c for c in chunks if c["meta_info"]["finish_reason"] is None]
    for a, b in zip(partial, partial[1:]):  # cumulative: each chunk extends the one before
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"] and len(b["output_ids"]) > len(
            a["output_ids"]
        )
    last = slime_reads(chunks[-1])
    assert partial and chunks[-1]["meta_info"]["finish_reason"] is not None
    assert last.status == "length" and last.tokens == whole["output_ids"] and last.completion_tokens == 10
    assert last.log_probs == slime_reads(whole).log_probs and last.weight_version == "0"


def test_slimes_routing_key_keeps_a_sessions_turns_on_one_worker(gw, workers):  # noqa: F811 - the imported fixtures
    """slime sends a sample's session as `X-SMG-Routing-Key` (consistent hashing): its turns go
    to one worker, as an OpenAI request's `X-Rose-Session`."""
    seen = {
        key: {
            httpx.post(
                gw.url + "/generate",
                json=slime_payload(PROMPT + [i], 4),
                headers={**AUTH, "X-SMG-Routing-Key": key},
                timeout=60,
            ).json()["meta_info"]["worker"]
            for i in range(4)
        }
        for key in ("sample-1", "sample-2")
    }
    assert all(len(w) == 1 and w <= set(workers) for w in seen.values()), seen


def test_stop_token_ids_end_the_answer_after_the_first(gw):  # noqa: F811 - the imported fixtures
    ids = generate(gw.url, slime_payload(PROMPT, 16)).json()["output_ids"]
    stop = ids[5]
    cut = ids.index(stop) + 1
    body = slime_payload(PROMPT, 16, stop_token_ids=[stop])
    out = generate(gw.url, body).json()
    got = slime_reads(out)
    assert got.status == "stop" and out["meta_info"]["finish_reason"]["matched"] == stop
    assert got.tokens == ids[:cut] and got.completion_tokens == cut
    last = slime_reads(streamed(gw.url, {**body, "stream": True})[-1])
    assert last.status == "stop" and last.tokens == ids[:cut]


def test_publish_only_a_version_the_workers_pull_and_a_pin_served_at_it(module_cfg, gw, workers, tmp_path):  # noqa: F811 - the imported fixtures
    """slime's disk path publishes a full checkpoint (`update_weights_from_disk`) and asks the
    version (`get_weight_version`); the fleet pulls it, and pinned requests are served at it."""
    before = httpx.get(gw.url + "/get_weight_version", headers=AUTH).json()
    assert before["weight_version"] == "0" and sorted(before["workers"]) == workers
    ckpt = reference_weights(tmp_path / "v1.safetensors", seed=5)
    r = httpx.post(
        gw.url + "/update_weights_from_disk",
        json={"model_path": str(ckpt), "weight_version": "1", "flush_cache": True},
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["success"] is True and r.json()["version"] == 1, r.text

    def pulled() -> dict | None:
        v = httpx.get(gw.url + "/get_weight_version", headers=AUTH).json()
        return v if v["weight_version"] == "1" and sorted(v["workers"]) == workers else None

    after = wait_for(pulled, 60, "every worker at version 1")
    assert after["latest_published"] == "1" and after["newest"] == "1"
    nested = [{"weight_version": {"min_required_version": 1}}, {"weight_version": {"exact_version": "1"}}]
    for pin in [{"min_required_version": "1"}, {"exact_version": 1}, *nested]:  # slime's and CONTRACT §8's
        got = slime_reads(generate(gw.url, slime_payload(PROMPT, 8, **pin)).json())
        assert got.weight_version == "1" and len(got.tokens) == 8, pin
        chunks = streamed(gw.url, slime_payload(PROMPT, 8, stream=True, **pin))
        assert all(c["meta_info"]["output_token_weight_versions"] == [1] * len(c["output_ids"]) for c in chunks)
        assert slime_reads(chunks[-1]).status == "length"


def test_a_pin_no_worker_meets_is_a_409_naming_it(module_cfg, gw):  # noqa: F811 - the imported fixtures
    quick = serve(
        dataclasses.replace(module_cfg, gateway=dataclasses.replace(module_cfg.gateway, pause_patience_s=0.5))
    )
    try:
        for pin, field in [
            ({"exact_version": 98}, "exact_version"),
            ({"min_required_version": 99}, "min_required_version"),
            ({"weight_version": {"exact_version": 98}}, "weight_version.exact_version"),
        ]:
            for stream in (False, True):
                r = generate(quick.url, slime_payload(PROMPT, 4, stream=stream, **pin))
                assert r.status_code == 409 and r.json()["error"]["param"] == field, r.text
                assert r.json()["error"]["message"].startswith(field)
    finally:
        quick.stop()


@pytest.mark.parametrize(
    "body, field",
    [
        ({"text": "What is 2 + 2?", "sampling_params": {}}, "text"),
        ({"sampling_params": {"max_new_tokens": 4}}, "input_ids"),
        ({"input_ids": [1, 300000000]}, "input_ids"),
        ({"input_ids": PROMPT, "sampling_params": {"temperature": 0.7}}, "sampling_params.temperature"),
        ({"input_ids": PROMPT, "sampling_params": {"top_p": 0.9}}, "sampling_params.top_p"),
        ({"input_ids": PROMPT, "sampling_params": {"stop": ["\n"]}}, "sampling_params.stop"),
        ({"input_ids": PROMPT, "sampling_params": {"frequency_penalty": 1.0}}, "sampling_params.frequency_penalty"),
        ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
        ({"input_ids": PROMPT, "exact_version": "one"}, "exact_version"),
        ({"input_ids": PROMPT, "exact_version": 1, "min_required_version": 1}, "min_required_version"),
        ({"input_ids": PROMPT, "image_data": ["x"]}, "image_data"),
        ({"input_ids": PROMPT, "weight_version": {"newest_version": 1}}, "weight_version"),
        ({"input_ids": PROMPT, "weight_version": 3}, "weight_version"),
        (
            {"input_ids": PROMPT, "exact_version": 1, "weight_version": {"min_required_version": 1}},
            "weight_version.min_required_version",
        ),
    ],
)
def test_bad_input_is_a_400_naming_the_field(gw, body, field):  # noqa: F811 - the imported fixtures
    r = generate(gw.url, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert r.json()["error"]["message"].startswith(field) and "\n" not in r.json()["error"]["message"]


def test_a_bad_disk_publish_is_a_400_naming_its_field(gw, tmp_path):  # noqa: F811 - the imported fixtures
    for body, field in [
        ({"model_path": str(tmp_path / "none")}, "model_path"),
        ({"model_path": str(tmp_path), "weight_version": 0}, "weight_version"),
    ]:
        r = httpx.post(gw.url + "/update_weights_from_disk", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert httpx.post(gw.url + "/generate", json={"input_ids": PROMPT}).status_code == 401


def test_a_streamed_generate_revoked_midway_is_answered_whole(gw, module_cfg, flags):  # noqa: F811 - the imported fixtures
    """Last in the module: it stops one worker. The worker running a streamed /generate is
    paused then stopped mid-turn; the other finishes it, and slime's reader sees one answer whose
    chunks only grow, ending `length` with the turn's final ids and every token's version."""

    def ids(events: list) -> list[int]:
        return events[-1][1]["output_ids"] if events else []

    rv = revoke_midway(
        gw.url,
        module_cfg,
        flags,
        slime_payload(PROMPT, 120, stream=True),
        path="/generate",
        shape=(ids, lambda e: e["meta_info"]["id"]),
    )
    r = redis.Redis.from_url(module_cfg.redis.url)
    task_id = rv.events[0][1]["meta_info"]["id"]
    traj = next(
        orjson.loads(f[b"trajectory"])
        for _i, f in r.xrange(module_cfg.redis.key("results", JOB))
        if f[b"task_id"].decode() == task_id
    )
    r.close()
    outs = [e for _t, e in rv.events]
    for a, b in zip(outs, outs[1:]):
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    last = slime_reads(outs[-1])
    assert last.status == "length" and last.tokens == traj["turns"][0]["action"] and len(last.tokens) == 120
    assert outs[-1]["meta_info"]["worker"] == rv.other and len(last.log_probs) == 120
    turn = traj["turns"][0]
    assert outs[-1]["meta_info"]["output_token_weight_versions"] == (turn.get("versions") or [turn["version"]] * 120)
