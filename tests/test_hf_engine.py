"""The `hf` engine (rose.rollout.engines.hf_engine) on a tiny random-init checkpoint, on CPU."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rose.rollout.engine import GenRequest  # noqa: E402
from rose.rollout.engines.hf_engine import HFEngine, weights_match  # noqa: E402

PROMPTS = {"a": [5, 17, 300, 42, 9, 1000, 3], "b": [1, 2, 3], "c": list(range(40, 80))}


def run(engine: HFEngine, prompts: dict[str, list[int]], steps: int, seeds: dict[str, int] | None = None, start=None):
    """Drive the engine as a worker does: one `generate(..., 1)` per step for every live
    sequence; `start[sid]` delays a sequence's first step (it joins a running batch)."""
    start = start or {}
    out: dict[str, list[int]] = {sid: [] for sid in prompts}
    fed: set[str] = set()
    for step in range(steps + max(start.values(), default=0)):
        reqs = []
        for sid, prompt in prompts.items():
            if step < start.get(sid, 0) or len(out[sid]) >= steps:
                continue
            if sid in fed:
                reqs.append(GenRequest(sid))
            else:
                fed.add(sid)
                reqs.append(GenRequest(sid, list(prompt), seed=(seeds or {}).get(sid)))
        for r, toks in zip(reqs, engine.generate(reqs, 1)):
            out[r.seq_id] += toks
    return out


@functools.lru_cache(maxsize=4)
def hf_model(checkpoint: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True).eval()


def reference(checkpoint: Path, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy continuation of `prompt`."""
    ids = hf_model(checkpoint).generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return ids[0, len(prompt) :].tolist()


def checkpoint_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_describe_and_limits(tiny_checkpoint):
    e = HFEngine(tiny_checkpoint, max_batch=3)
    assert e.describe()["name"] == "hf" and e.describe()["device"] == "cpu"
    assert e.describe()["version"]  # the transformers version
    assert (e.vocab_size, e.max_seq, e.n_slots, e.free_slots(), e.version) == (1024, 2048, 3, 3, -1)
    assert HFEngine(tiny_checkpoint, max_seq=64).max_seq == 64
    assert HFEngine(tiny_checkpoint, max_seq=0).max_seq == 2048  # 0: the config's


def test_step_tokens_from_the_config_size_the_prefill_chunk(tiny_checkpoint):
    """`rollout.step_tokens` reaches the engine the worker builds (0: the engine's default)."""
    import dataclasses

    from rose.config import Config, RolloutConfig
    from rose.rollout.engines import build_engine
    from rose.rollout.launcher import WorkerConfig

    rollout = RolloutConfig(engine="hf", model=str(tiny_checkpoint), step_tokens=64)
    wc = WorkerConfig.from_config(Config(rollout=rollout), gpu="g", worker_id="w")
    assert WorkerConfig.from_json(wc.to_json()).step_tokens == 64
    assert build_engine(wc, "cpu", 0).prefill_chunk == 64
    default = build_engine(dataclasses.replace(wc, step_tokens=0), "cpu", 0)
    assert default.prefill_chunk == HFEngine(tiny_checkpoint).prefill_chunk != 64


@pytest.mark.parametrize("batch_decode", [True, False])
def test_greedy_matches_transformers_generate(tiny_checkpoint, batch_decode):
    """Each sequence's greedy tokens, decoded beside the others, are transformers' own."""
    e = HFEngine(tiny_checkpoint, temperature=0, batch_decode=batch_decode)
    out = run(e, PROMPTS, 12, start={"b": 3})  # b joins a running batch
    for sid, prompt in PROMPTS.items():
        assert out[sid] == reference(tiny_checkpoint, prompt, 12), sid


def test_batching_does_not_change_a_seeded_sequence(tiny_checkpoint):
    """Temperature 1, seeded: a sequence draws the same tokens alone, beside others that join
    and finish at other steps, and with one decode forward per sequence."""
    seeds = {"a": 7, "b": 8, "c": 9}
    alone = run(HFEngine(tiny_checkpoint, temperature=1.0), {"a": PROMPTS["a"]}, 16, seeds)["a"]
    batched = run(HFEngine(tiny_checkpoint, temperature=1.0), PROMPTS, 16, seeds, start={"b": 2, "c": 5})
    serial = run(HFEngine(tiny_checkpoint, temperature=1.0, batch_decode=False), PROMPTS, 16, seeds, start={"c": 1})
    assert batched["a"] == alone == serial["a"]
    assert batched["b"] == serial["b"] and batched["c"] == serial["c"]
    assert len(set(alone)) > 1  # sampled, not a constant
    other_seed = run(HFEngine(tiny_checkpoint, temperature=1.0), {"a": PROMPTS["a"]}, 16, {"a": 70})["a"]
    assert other_seed != alone


@pytest.mark.parametrize("prefill_chunk", [512, 3])
def test_extension_after_tool_call_matches_fresh_context(tiny_checkpoint, prefill_chunk):
    """Observation tokens appended to a live sequence give the same next tokens as the whole
    context fed to a fresh sequence (and chunked prefill changes nothing)."""
    e = HFEngine(tiny_checkpoint, temperature=0, prefill_chunk=prefill_chunk)
    first = run(e, {"t": PROMPTS["a"], "other": PROMPTS["b"]}, 5)["t"]
    obs = [11, 12, 13, 14, 15, 16]
    # the last sampled token is still pending (not yet fed); the observation follows it
    out = [e.generate([GenRequest("t", obs), GenRequest("other")], 1)[0]]
    for _ in range(5):
        out.append(e.generate([GenRequest("t"), GenRequest("other")], 1)[0])
    extended = [t for toks in out for t in toks]
    fresh = run(HFEngine(tiny_checkpoint, temperature=0), {"f": PROMPTS["a"] + first + obs}, 6)["f"]
    assert extended == fresh == reference(tiny_checkpoint, PROMPTS["a"] + first + obs, 6)


@pytest.mark.parametrize("batch_decode", [True, False])
def test_pause_returns_nothing_and_resumes(tiny_checkpoint, batch_decode):
    """A pause before any forward returns no tokens; what was fed stays fed, and the sequences
    resume to exactly the tokens of a run that was never paused."""
    want = {sid: reference(tiny_checkpoint, PROMPTS[p], 6) for sid, p in (("a", "c"), ("b", "b"))}
    e = HFEngine(tiny_checkpoint, temperature=0, prefill_chunk=8, batch_decode=batch_decode)
    calls: list[int] = []

    def pause_from(n):  # False for the first n-1 calls, then True
        calls.clear()
        return lambda: calls.append(1) or len(calls) >= n

    got: dict[str, list[int]] = {"a": [], "b": []}

    def step(reqs, pause=lambda: False):
        out = e.generate(reqs, 1, pause_check=pause)
        for sid, toks in zip("ab", out):
            got[sid] += toks
        return out

    more = [GenRequest("a"), GenRequest("b")]
    assert step([GenRequest("a", PROMPTS["c"]), GenRequest("b", PROMPTS["b"])], lambda: True) == [[], []]
    assert e.free_slots() == e.n_slots - 2 and e.length("a") == 40
    assert step(more, pause_from(3)) == [[], []]  # a's 40 tokens: paused after two chunks of 8
    assert step(more, pause_from(4)) == [[], []]  # a's last three chunks, paused before b's prompt
    assert calls == [1, 1, 1, 1]
    for _ in range(3):
        assert [len(t) for t in step(more)] == [1, 1]
    # a decode step paused before its forward (serial decode: between the two sequences)
    assert step(more, pause_from(1 if batch_decode else 2)) == [[], []]
    for _ in range(3):
        step(more)
    assert got == want
    assert e.interrupted_tokens == 0  # forwards are never cut short


def test_load_weights_bf16_and_weights_match(tiny_checkpoint):
    e = HFEngine(tiny_checkpoint, temperature=0)
    before = run(e, {"a": PROMPTS["a"]}, 8)["a"]
    ckpt = checkpoint_tensors(tiny_checkpoint)
    assert weights_match(e, ckpt) == []
    g = torch.Generator().manual_seed(1)
    published = {k: (v + 0.05 * torch.randn(v.shape, generator=g)).to(torch.bfloat16) for k, v in ckpt.items()}
    assert weights_match(e, published) != []
    e.load_weights(3, published)
    assert e.version == 3
    assert weights_match(e, published) == []
    emb, head = e.model.get_input_embeddings().weight, e.model.get_output_embeddings().weight
    assert emb.data_ptr() == head.data_ptr()  # lm_head still tied to embed_tokens
    assert emb.dtype == torch.float32  # cast to the parameter's dtype
    e.release("a")
    assert run(e, {"a": PROMPTS["a"]}, 8)["a"] != before
    # one corrupted element is named
    name = "model.layers.1.mlp.down_proj.weight"
    with torch.no_grad():
        dict(e.model.named_parameters())[name].view(-1)[17] += 1.0
    assert weights_match(e, published) == [name]
    assert e.weights_match(published) == [name]  # the method the worker's verify_weights calls
    # an empty dict keeps the weights and sets the version
    e.load_weights(4, {})
    assert e.version == 4 and weights_match(e, published) == [name]


def test_load_weights_is_strict(tiny_checkpoint):
    e = HFEngine(tiny_checkpoint)
    ckpt = checkpoint_tensors(tiny_checkpoint)
    good = {k: torch.zeros_like(v) for k, v in ckpt.items()}
    with pytest.raises(ValueError, match="model.nope.weight"):
        e.load_weights(1, {**good, "model.nope.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match="model.norm.weight"):
        e.load_weights(1, {**good, "model.norm.weight": torch.zeros(7)})
    assert e.version == -1 and weights_match(e, ckpt) == []  # nothing was copied
    # a tied head given on its own moves the embeddings with it
    head = torch.full_like(ckpt["model.embed_tokens.weight"], 0.5)
    e.load_weights(2, {"lm_head.weight": head})
    assert weights_match(e, {"model.embed_tokens.weight": head}) == []


def test_release_frees_a_slot(tiny_checkpoint):
    e = HFEngine(tiny_checkpoint, max_batch=2, temperature=0)
    e.generate([GenRequest("a", [1, 2]), GenRequest("b", [3])], 1)
    assert e.free_slots() == 0
    with pytest.raises(RuntimeError, match="free slot"):
        e.generate([GenRequest("c", [4])], 1)
    e.release("a")
    assert e.free_slots() == 1 and e.length("a") == 0
    assert len(e.generate([GenRequest("c", [4]), GenRequest("b")], 1)[0]) == 1
    assert e.free_slots() == 0


def test_too_long_sequence_raises(tiny_checkpoint):
    e = HFEngine(tiny_checkpoint, max_batch=2, max_seq=16, temperature=0)
    with pytest.raises(ValueError, match="sequence long-one"):
        e.generate([GenRequest("long-one", list(range(17)))], 1)
    assert e.free_slots() == 2  # nothing admitted
    e.generate([GenRequest("s", list(range(15)))], 1)  # 15 fed + 1 sampled
    e.generate([GenRequest("s")], 1)  # 16 fed + 1 sampled
    with pytest.raises(ValueError, match="sequence s"):
        e.generate([GenRequest("s")], 1)
    with pytest.raises(ValueError, match="sequence s"):
        e.generate([GenRequest("s", [1])], 1)


@pytest.mark.parametrize("arch", ["gpt_neox", "phi"])
def test_architecture_the_code_never_names(tmp_path, arch):
    import transformers

    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    config = {
        "gpt_neox": lambda: transformers.GPTNeoXConfig(**common, max_position_embeddings=128),
        "phi": lambda: transformers.PhiConfig(**common, max_position_embeddings=128),
    }[arch]()
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / arch)
    e = HFEngine(tmp_path / arch, temperature=0)
    assert e.max_seq == 128 and e.vocab_size == 512
    prompts = {"x": [1, 2, 3, 4, 5], "y": [7] * 20, "z": [300]}
    out = run(e, prompts, 8, start={"z": 2})
    for sid, prompt in prompts.items():
        assert out[sid] == reference(tmp_path / arch, prompt, 8), sid


@pytest.mark.cuda
def test_hf_engine_on_cuda_on_the_lowest_priority_stream(tiny_checkpoint):
    """The GPU check's engine: greedy tokens on a CUDA device, launched on rollout's lowest-priority
    stream, equal transformers' own generate on the same device; a bf16 version applies bit-exact."""
    from transformers import AutoModelForCausalLM

    from rose.rollout.worker_process import lowest_priority_stream

    dev = torch.device("cuda:0")
    e = HFEngine(tiny_checkpoint, temperature=0, device="cuda:0", stream=lowest_priority_stream(dev))
    assert e.describe()["device"].startswith("cuda")
    out = run(e, PROMPTS, 12, start={"b": 3})
    ref = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, local_files_only=True).to(dev).eval()
    for sid, prompt in PROMPTS.items():
        ids = ref.generate(torch.tensor([prompt], device=dev), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert out[sid] == ids[0, len(prompt) :].tolist(), sid
    g = torch.Generator().manual_seed(2)
    published = {
        k: (v + 0.05 * torch.randn(v.shape, generator=g)).to(torch.bfloat16)
        for k, v in checkpoint_tensors(tiny_checkpoint).items()
    }
    e.load_weights(1, published)
    assert weights_match(e, published) == []
