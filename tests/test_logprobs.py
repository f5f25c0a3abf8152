"""The sampled tokens' log-probabilities, from the engines to the trainer and the gateway: the
reference and hf engines report log_softmax(logits / temperature) at each sampled id (checked
against a forward pass over the whole context); episodes carry them per action token, through a
continuation, into the trajectory and the client's `Trajectory`; the gateway answers
`logprobs` in OpenAI's shapes, streamed and not, through a real gateway, the real Redis and one
rollout worker on the reference engine."""

from __future__ import annotations

import math
from collections.abc import Iterator

import httpx
import orjson
import pytest
import torch

from rose.client import Trajectory
from rose.config import Config
from rose.rollout.engine import GenRequest, MemoryBudget, TorchEngine
from rose.rollout.episode import Episode, InvalidTask, Task
from rose.rollout.pause_flag import PauseFlag
from rose.rollout.policy_model import ModelSpec, PolicyModel, init_state_dict
from rose.rollout.token_stream import TokenStreamer
from tests.test_gateway import (
    KEY,
    MODEL,
    PROMPT,
    Served,
    _FakeRedis,
    launch_workers,
    pause_flags,
    prefixed_gateway_cfg,
    serve,
    stop_workers,
)
from tests.test_rollout_tasks import wait_for

SPEC = ModelSpec(d_model=64, n_heads=4, d_ff=128, n_layers=2, max_seq=128)
PROMPTS = {"a": list(b"the first prompt"), "b": list(b"two"), "c": list(b"and a third, longer one")}


def drive(engine, prompts: dict[str, list[int]], steps: int) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    """As a worker does: one `generate(..., 1)` per step for every sequence; each sequence's
    tokens and the logprobs the engine reported for them."""
    toks: dict[str, list[int]] = {s: [] for s in prompts}
    lps: dict[str, list[float]] = {s: [] for s in prompts}
    for step in range(steps):
        reqs = [
            GenRequest(s, list(p), seed=11 + i) if step == 0 else GenRequest(s)
            for i, (s, p) in enumerate(prompts.items())
        ]
        out = engine.generate(reqs, 1)
        assert len(engine.last_logprobs) == len(out)
        for r, t, lp in zip(reqs, out, engine.last_logprobs):
            assert len(lp) == len(t)
            toks[r.seq_id] += t
            lps[r.seq_id] += lp
    return toks, lps


def check(got: list[float], logits: torch.Tensor, ids: list[int], temperature: float) -> None:
    """`got` equals float32 log_softmax(logits / temperature) at the sampled ids."""
    want = torch.log_softmax(logits.float() / temperature, dim=-1)[torch.arange(len(ids)), torch.tensor(ids)]
    assert all(math.isfinite(x) and x <= 0 for x in got)
    assert torch.allclose(torch.tensor(got), want, atol=1e-4), (got, want.tolist())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_reference_engine_reports_the_sampled_tokens_logprobs(temperature):
    state = init_state_dict(SPEC, 4)
    e = TorchEngine(SPEC, MemoryBudget(1 << 30, SPEC), max_batch=8, temperature=temperature)
    e.load_weights(0, state)
    toks, lps = drive(e, PROMPTS, 12)
    m = PolicyModel(SPEC).eval()
    m.load_state_dict(state)
    for sid, prompt in PROMPTS.items():
        ctx = torch.tensor([prompt + toks[sid][:-1]])
        with torch.no_grad():
            logits = m(ctx, m.new_cache(1), torch.tensor([0]), torch.tensor([0]))[0]
        check(lps[sid], logits[len(prompt) - 1 :], toks[sid], temperature)


def test_the_hf_engine_reports_the_sampled_tokens_logprobs(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from rose.model.random_init import init_checkpoint
    from rose.rollout.engines.hf_engine import HFEngine

    ckpt = init_checkpoint(tmp_path / "tiny")
    prompts = {"a": [5, 17, 300, 42, 9, 1000, 3], "b": [1, 2, 3]}
    toks, lps = drive(HFEngine(ckpt, max_batch=4, temperature=0.8), prompts, 8)
    model = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True).eval()
    for sid, prompt in prompts.items():
        with torch.no_grad():
            logits = model(torch.tensor([prompt + toks[sid][:-1]])).logits[0]
        check(lps[sid], logits[len(prompt) - 1 :], toks[sid], 0.8)


def test_the_vllm_engine_reads_the_sampled_tokens_logprobs_of_a_delta():
    from types import SimpleNamespace

    from rose.rollout.engines.vllm_engine import _sampled_logprobs, logprobs_mode

    lp = SimpleNamespace  # vLLM's Logprob: the sampled token's entry of each position
    delta = [{7: lp(logprob=-0.5, rank=3)}, {2: lp(logprob=-1.5, rank=1)}]
    assert _sampled_logprobs(delta, [7, 2]) == [-0.5, -1.5]
    with pytest.raises(RuntimeError):
        _sampled_logprobs(None, [7])
    assert logprobs_mode(1.0) == logprobs_mode(0.0) == "raw_logprobs"
    assert logprobs_mode(0.7) == "processed_logprobs"


def task(**kw) -> Task:
    return Task(task_id="t", prompt=[1, 2, 3], max_turns=2, tokens_per_turn=4, obs_tokens=2, **kw)


def test_a_continuation_keeps_the_logprobs_of_its_partial_action():
    ep = Episode(task(), "w0", "g0", False, 0.0)
    for tok, lp in [(7, -0.5), (8, -1.25), (9, -2.0), (10, -0.125)]:
        ep.on_token(tok, 0, 0.0, lp)
    assert ep.turns[0].logprobs == [-0.5, -1.25, -2.0, -0.125]
    ep.finish_tool()
    ep.on_token(11, 1, 0.0, -3.5)  # then the worker is revoked: the action in progress moves
    cont = Task.from_dict(ep.continuation().to_dict())
    assert cont.partial == [11] and cont.partial_versions == [1] and cont.partial_logprobs == [-3.5]
    assert cont.turns[0].logprobs == [-0.5, -1.25, -2.0, -0.125]
    moved = Episode(cont, "w1", "g1", False, 0.0)
    for tok in (12, 13, 14):
        moved.on_token(tok, 2, 0.0, -0.25)
    traj = moved.trajectory(now=1.0)
    assert traj["token_logprobs"] == [[-0.5, -1.25, -2.0, -0.125], [-3.5, -0.25, -0.25, -0.25]]
    t = Trajectory.from_dict(traj)
    assert t.turns[1].logprobs == [-3.5, -0.25, -0.25, -0.25]
    assert len(t.token_logprobs) == len(t.tokens) == len(t.token_versions)
    assert [lp for lp, m in zip(t.token_logprobs, t.action_mask) if m] == [-0.5, -1.25, -2.0, -0.125, -3.5] + [
        -0.25
    ] * 3
    assert all(lp == 0.0 for lp, m in zip(t.token_logprobs, t.action_mask) if not m)


def test_older_tasks_and_trajectories_without_logprobs_still_load():
    old = {"task_id": "t", "prompt": [1, 2], "tokens_per_turn": 4, "partial": [5], "partial_versions": [0]}
    t = Task.from_dict(old)
    assert t.partial_logprobs == []
    ep = Episode(t, "w0", "g0", False, 0.0)
    for tok in (6, 7, 8):
        ep.on_token(tok, 0, 0.0, -1.0)  # the first token's is not known: the turn keeps none
    assert ep.turns[0].logprobs == []
    traj = ep.trajectory(now=1.0)
    traj.pop("token_logprobs")
    for turn in traj["turns"]:
        turn.pop("logprobs")
    got = Trajectory.from_dict(traj)
    assert got.turns[0].logprobs == []
    assert [math.isnan(x) for x in got.token_logprobs] == [False] * 2 + [True] * 4 + [False] * (len(got.tokens) - 6)


@pytest.mark.parametrize("bad", [[0.5], [-1.0, -2.0], ["x"], [float("nan")], [float("-inf")], [True], -1.0])
def test_bad_partial_logprobs_are_refused_naming_the_field(bad):
    d = {"task_id": "t", "prompt": [1, 2], "tokens_per_turn": 4, "partial": [5], "partial_versions": [0]}
    with pytest.raises(InvalidTask) as e:
        Task.from_dict({**d, "partial_logprobs": bad})
    assert e.value.field == "partial_logprobs"
    turn = {"action": [5, 6], "observation": [1], "version": 0, "logprobs": [-1.0]}
    with pytest.raises(InvalidTask) as e:
        Task.from_dict({"task_id": "t", "prompt": [1, 2], "turns": [turn]})
    assert e.value.field == "turns[0].logprobs"


def test_the_token_stream_carries_logprobs_beside_tokens_and_versions():
    fr = _FakeRedis()
    st = TokenStreamer(fr, "w0", flush_ms=1000, flush_steps=100)
    for i, lp in enumerate([-0.5, -1.5, -0.25]):
        st.add("a", "k", 0, i, [40 + i], [3], 0.0, lp)
    st.add("b", "k2", 0, 0, [7], [3], 0.0)  # an engine that gave none: the chunk carries none
    st.flush()
    (_, fa), (_, fb) = fr.log[0]
    assert orjson.loads(fa["tokens"]) == [40, 41, 42] and orjson.loads(fa["logprobs"]) == [-0.5, -1.5, -0.25]
    assert orjson.loads(fb["logprobs"]) == []


# -- the gateway ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lp_cfg(stack, base_cfg) -> Iterator[Config]:
    yield from prefixed_gateway_cfg(stack, base_cfg)


@pytest.fixture(scope="module")
def lp_flags() -> Iterator[dict[str, PauseFlag]]:
    yield from pause_flags("rose-lp")


@pytest.fixture(scope="module")
def lp_gw(lp_cfg, lp_flags) -> Iterator[Served]:
    procs = launch_workers(lp_cfg, {"w0": lp_flags["w0"]})  # one worker on the reference engine
    s = serve(lp_cfg)
    try:
        wait_for(lambda: httpx.get(s.url + "/health").json()["workers_running"] == ["w0"], 90, "the worker running")
        yield s
    finally:
        s.stop()
        stop_workers(procs)


def post(s: Served, path: str, body: dict) -> httpx.Response:
    return httpx.post(
        s.url + path, json={"model": MODEL, **body}, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )


def test_a_completion_with_logprobs_carries_one_per_token(lp_gw):
    r = lp_gw.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=9, seed=2, logprobs=1)
    ch = r.choices[0]
    assert ch.logprobs is not None and len(ch.token_ids) == 9  # type: ignore[attr-defined]
    lp = ch.logprobs.token_logprobs
    assert lp is not None and len(lp) == 9 and all(math.isfinite(x) and x <= 0 for x in lp)
    assert ch.logprobs.tokens == [str(t) for t in ch.token_ids]  # type: ignore[attr-defined]
    assert ch.logprobs.text_offset == [0] * 9 and ch.logprobs.top_logprobs is None
    again = post(lp_gw, "/v1/completions", {"prompt": PROMPT, "max_tokens": 9, "seed": 2, "logprobs": 0}).json()
    assert again["choices"][0]["logprobs"]["token_logprobs"] == lp  # the seed decides tokens and logprobs
    plain = post(lp_gw, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_a_chat_completion_with_logprobs_carries_one_per_token(lp_gw):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "seed": 4, "logprobs": True}
    ch = post(lp_gw, "/v1/chat/completions", {**body, "top_logprobs": 0}).json()["choices"][0]
    content = ch["logprobs"]["content"]
    assert [c["token"] for c in content] == [str(t) for t in ch["token_ids"]] and len(content) == 6
    assert all(c["logprob"] <= 0 and c["bytes"] is None and c["top_logprobs"] == [] for c in content)
    bad = post(lp_gw, "/v1/chat/completions", {**body, "top_logprobs": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"
    worse = post(lp_gw, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "logprobs": 5})
    assert worse.status_code == 400 and worse.json()["error"]["param"] == "logprobs"


def test_streamed_chunks_carry_their_tokens_logprobs(lp_gw):
    c = lp_gw.client()
    whole = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, seed=6, logprobs=1).choices[0]
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, seed=6, logprobs=1, stream=True))
    pieces = [ch.choices[0] for ch in chunks if ch.choices[0].finish_reason is None]
    assert all(p.logprobs is not None and len(p.logprobs.token_logprobs or []) == 1 for p in pieces)
    assert [x for p in pieces for x in p.logprobs.token_logprobs] == whole.logprobs.token_logprobs  # type: ignore[union-attr]
