"""`rose gateway` on vLLM: the official `openai` client against a real gateway, the real Redis and
two vLLM rollout workers on the tiny checkpoint, one leased (a pause flag, as its executor holds
it) and one dedicated (no lease), started once for the module. Completions and chat, streamed and
not, return the engine's token ids with every token's policy version and log-probability (the
checkpoint's own, recomputed by transformers); a session keeps its turns
on one engine; a published version is applied in place and `min_weight_version` is served by it
and nothing older; `GET /v1/weights` agrees with the engines; overload, auth and validation
answer 429, 401 and 400 naming the field, never a 5xx; and a streamed turn whose lease is revoked
midway is finished by the other engine, its streamed ids the final ones."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import orjson
import pytest
import redis

from rose.config import Config
from rose.rollout.pause_flag import STOP, PauseFlag
from rose.weights.stream import WeightPublisher
from tests.test_gateway import (
    JOB,
    KEY,
    MODEL,
    PROMPT,
    Served,
    covers,
    launch_workers,
    overload,
    pause_flags,
    prefixed_gateway_cfg,
    serve,
    session_workers,
    sse,
    stop_workers,
    streamed_ids,
)
from tests.test_rollout_tasks import wait_for
from tests.test_vllm_rollout import ENGINE_START_S, _published

pytestmark = [pytest.mark.stack, pytest.mark.timeout(900)]  # the first test waits for two vLLM engines

pytest.importorskip("vllm", reason="the vLLM environment is installed by `make test` (docs/engines.md)")

LEASED, DEDICATED = "w0", "w1"
VOCAB = 1024  # the tiny checkpoint's


@pytest.fixture(scope="module")
def module_cfg(stack, base_cfg) -> Iterator[Config]:
    yield from prefixed_gateway_cfg(stack, base_cfg)


@pytest.fixture(scope="module")
def flags() -> Iterator[dict[str, PauseFlag]]:
    yield from pause_flags("rose-gwv")


@pytest.fixture(scope="module")
def workers(module_cfg, flags, tiny_checkpoint) -> Iterator[list[str]]:
    """The leased worker holds its pause flag; the dedicated one has none (no lease, never paused)."""

    def engine(w: str) -> dict:
        own = {"pause_flag": ""} if w == DEDICATED else {}
        return {
            "engine": "vllm",
            "checkpoint": str(tiny_checkpoint),
            "max_model_len": 512,
            "weights": "follow",
            "verify_weights": True,
            "dedicated": w == DEDICATED,
            **own,
        }

    procs = launch_workers(module_cfg, flags, engine)
    yield sorted(procs)
    stop_workers(procs)


@pytest.fixture(scope="module")
def gw(module_cfg, workers) -> Iterator[Served]:
    s = serve(module_cfg)
    wait_for(
        lambda: sorted(httpx.get(s.url + "/health").json()["workers_running"]) == workers,
        ENGINE_START_S,
        "both vLLM workers running",
    )
    yield s
    s.stop()


def _hb(cfg: Config, w: str) -> dict[str, str]:
    r = redis.Redis.from_url(cfg.redis.url)
    try:
        return {k.decode(): v.decode() for k, v in r.hgetall(cfg.redis.key("workers", w)).items()}
    finally:
        r.close()


def test_completions_and_chat_streamed_and_not_return_the_engines_ids_and_versions(gw, workers, module_cfg):
    c = gw.client()
    whole = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, seed=7).choices[0]
    assert whole.finish_reason == "length" and len(whole.token_ids) == 12
    assert all(0 <= t < VOCAB for t in whole.token_ids) and whole.prompt_token_ids == PROMPT
    assert covers(whole.weight_versions, 12) == [0] * 12 and whole.worker in workers
    assert all(_hb(module_cfg, w)["engine"] == "vllm" for w in workers)
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, seed=7, stream=True))
    ids = [t for ch in chunks for t in ch.choices[0].token_ids]
    assert ids == whole.token_ids  # vLLM's seeded sampling: the seed alone decides, on either engine
    assert chunks[-1].choices[0].finish_reason == "length" and covers(chunks[-1].choices[0].weight_versions, 12)

    msgs = [{"role": "system", "content": [9, 8, 7]}, {"role": "user", "content": PROMPT}]
    chat = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, seed=11)  # type: ignore[arg-type]
    assert chat.prompt_token_ids == [9, 8, 7] + PROMPT and len(chat.choices[0].token_ids) == 8
    assert covers(chat.choices[0].weight_versions, 8) == [0] * 8
    streamed = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, seed=11, stream=True))  # type: ignore[arg-type]
    assert [t for x in streamed for t in (getattr(x.choices[0], "token_ids", None) or [])] == chat.choices[0].token_ids


def test_the_engines_logprobs_are_the_checkpoints_own(gw, tiny_checkpoint):
    """`logprobs=1` returns, per sampled token, what the checkpoint (run by transformers over the
    same context, float32) gives it at temperature 1: vLLM's reported logprobs line up with the
    tokens they belong to, through the worker, the results stream and the gateway."""
    import torch
    import transformers

    got = (
        gw.client()
        .completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, seed=4, logprobs=1, stream=False)
        .choices[0]
    )
    ids, lps = got.token_ids, got.logprobs.token_logprobs
    assert got.logprobs.tokens == [str(t) for t in ids] and len(lps) == 10
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1 : -1]
    want = torch.log_softmax(logits, -1)[torch.arange(10), torch.tensor(ids)].tolist()
    assert lps == pytest.approx(want, abs=2e-3), (lps, want)
    chunks = list(
        gw.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, seed=4, logprobs=1, stream=True)
    )
    streamed = [
        x for ch in chunks[:-1] for x in (ch.choices[0].logprobs.token_logprobs if ch.choices[0].logprobs else [])
    ]
    assert streamed == pytest.approx(lps, abs=1e-6)


def test_a_session_keeps_its_turns_on_one_engine(gw, workers):
    seen = session_workers(gw, ("s-1", "s-2", "s-3"), 4)
    assert all(len(w) == 1 and w <= set(workers) for w in seen.values()), seen


def test_bad_requests_are_400_naming_the_field_and_a_wrong_token_401(gw):
    with pytest.raises(openai.BadRequestError) as e:
        gw.client().completions.create(model=MODEL, prompt=[VOCAB + 5, 1], max_tokens=4)
    assert e.value.status_code == 400 and "prompt" in e.value.message  # outside the engine's vocabulary
    with pytest.raises(openai.BadRequestError) as e:
        gw.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=-1)
    assert "max_tokens" in e.value.message
    with pytest.raises(openai.AuthenticationError):
        gw.client("wrong").completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)


def test_overload_is_answered_or_429_never_5xx(module_cfg, gw):
    got = overload(module_cfg, 12, 32, max_inflight=2, max_queue=1)
    assert got.count(200) >= 3 and any(str(x).startswith("429 ") for x in got), got
    assert all(x == 200 or (isinstance(x, str) and x.split()[-1].isdigit()) for x in got), got


def test_a_published_version_is_applied_in_place_and_min_weight_version_honoured(
    gw, module_cfg, workers, tiny_checkpoint
):
    r = redis.Redis.from_url(module_cfg.redis.url)
    pids = {w: _hb(module_cfg, w)["pid"] for w in workers}
    try:
        WeightPublisher(r, module_cfg.redis, MODEL, hmac_key="").publish(_published(tiny_checkpoint, 1))
    finally:
        r.close()
    c = gw.client()
    got = c.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, seed=1, extra_body={"min_weight_version": 1}
    ).choices[0]
    assert covers(got.weight_versions, 6) == [1] * 6  # served at the new version, never the old one
    wait_for(lambda: all(_hb(module_cfg, w).get("version") == "1" for w in workers), 60, "version 1 on both engines")
    for w in workers:
        hb = _hb(module_cfg, w)
        assert hb["pid"] == pids[w], "the version was not applied in place"
        assert hb["versions_verified"] == "1" and hb["versions_mismatched"] == "0", hb
    body = httpx.get(gw.url + "/v1/weights", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert body["latest_published"] == 1 and {d["worker"]: d["version"] for d in body["data"]} == {
        w: 1 for w in workers
    }


# -- last: it stops the leased worker ----------------------------------------------------------


def test_a_streamed_turn_revoked_midway_is_finished_by_the_other_engine(gw, module_cfg, flags):
    """The leased engine runs a streamed turn (its session pinned there) and is stopped mid-turn:
    the tokens made so far, with their versions, go on as a continuation, the dedicated engine
    prefills them and samples on, and the stream goes on from the next index."""
    c = gw.client()
    session = next(
        s
        for s in (f"rv-{i}" for i in range(40))
        if c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_headers={"X-Rose-Session": s})
        .choices[0]
        .worker
        == LEASED
    )
    before = int(_hb(module_cfg, LEASED).get("tokens", 0))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 180, "seed": 5, "stream": True}
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(sse, gw.url, "/v1/completions", body, {"X-Rose-Session": session})
        # pinned while the leased worker runs at full share (a paused one is not a pin target);
        # under the long-tail rule's 192 tokens, so the leased worker keeps it
        wait_for(lambda: int(_hb(module_cfg, LEASED).get("tokens", 0)) > before, 60, "the turn on the leased engine")
        flags[LEASED].set_share(0.05)  # then slowed down, so the stop lands mid-turn
        wait_for(lambda: int(_hb(module_cfg, LEASED).get("tokens", 0)) - before >= 10, 60, "the leased engine mid-turn")
        flags[LEASED].set(STOP)
        events = fut.result(timeout=120)
    stopped = wait_for(
        lambda: h if (h := _hb(module_cfg, LEASED)).get("state") == "stopped" else None, 30, "the stopped worker"
    )
    task_id = events[0][1]["id"].removeprefix("cmpl-")
    r = redis.Redis.from_url(module_cfg.redis.url)
    try:
        traj = next(
            orjson.loads(f[b"trajectory"])
            for _i, f in r.xrange(module_cfg.redis.key("results", JOB))
            if f[b"task_id"].decode() == task_id
        )
    finally:
        r.close()
    ids, idx = streamed_ids(events)
    last = events[-1][1]["choices"][0]
    assert idx == list(range(180)) and ids == traj["turns"][0]["action"]  # contiguous, the final ids
    assert last["finish_reason"] == "length" and last["worker"] == DEDICATED  # ended at max_tokens
    versions = covers(last["weight_versions"], 180)
    assert versions == [int(_hb(module_cfg, DEDICATED)["version"])] * 180
    assert int(stopped["requeued"]) == 1 and int(stopped["tokens_carried"]) >= 10  # handed on, not redone
