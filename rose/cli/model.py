"""`rose model init|import`: local Hugging Face checkpoints, random-init or imported from a GGUF file."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from rose.cli import fail

model_app = typer.Typer(
    help="Hugging Face checkpoints: random-init ones of a chosen shape, and GGUF files imported.",
    no_args_is_help=True,
)


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        fail(f"{out} exists and is not an empty directory: pass a new or empty OUT directory")


@model_app.command("init")
def init(
    out: Path = typer.Argument(..., help="Directory to write (new or empty)."),
    arch: str = typer.Option(..., "--arch", help="qwen2 | llama | mistral | qwen3."),
    layers: int = typer.Option(2, "--layers", help="Decoder layers."),
    hidden: int = typer.Option(256, "--hidden", help="Hidden size (a multiple of --heads)."),
    heads: int = typer.Option(4, "--heads", help="Attention heads."),
    kv_heads: int = typer.Option(2, "--kv-heads", help="Key/value heads (divides --heads)."),
    intermediate: int | None = typer.Option(None, "--intermediate", help="MLP size (default: 2 x --hidden)."),
    vocab: int = typer.Option(1024, "--vocab", help="Vocabulary size (the tokenizer's too, with --tokenizer)."),
    max_positions: int = typer.Option(2048, "--max-positions", help="Longest sequence (max_position_embeddings)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the initialiser: the same seed gives the same bytes."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16."),
    tokenizer: bool = typer.Option(
        False, "--tokenizer", help="Also train a small byte-level BPE of --vocab tokens, locally."
    ),
) -> None:
    """Write a random-init checkpoint (config.json, model.safetensors; tokenizer files with --tokenizer)."""
    from rose.model.random_init import CheckpointShape, check_args, checkpoint_parameters, init_checkpoint

    shape = CheckpointShape(
        arch=arch,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=2 * hidden if intermediate is None else intermediate,
        vocab=vocab,
        max_positions=max_positions,
    )
    try:
        check_args(shape, dtype, tokenizer)
    except ValueError as e:
        fail(str(e))
    _check_out(out)
    t0 = time.perf_counter()
    init_checkpoint(out, shape, seed, dtype=dtype, tokenizer=tokenizer)
    extra = ", tokenizer" if tokenizer else ""
    typer.echo(
        f"{out}: {arch} checkpoint, {checkpoint_parameters(out):,} parameters ({dtype}{extra}), "
        f"{time.perf_counter() - t0:.1f} s"
    )


@model_app.command("import")
def import_(
    gguf: Path = typer.Argument(..., help="The .gguf file (e.g. SmolLM2-135M-Instruct.Q4_1.gguf)."),
    out: Path = typer.Argument(..., help="Directory to write (new or empty)."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="float32 | bfloat16: the weights as written."),
) -> None:
    """Write the model and tokenizer of a GGUF file as a Hugging Face checkpoint (weights unquantized)."""
    from rose.model.gguf_import import GgufImportError, import_gguf
    from rose.model.random_init import DTYPES, checkpoint_parameters

    if dtype not in DTYPES:
        fail(f"--dtype {dtype!r} is not supported: pass one of {', '.join(DTYPES)}")
    if not gguf.is_file():
        fail(f"{gguf}: no such file; pass the path of a .gguf file (SmolLM2's: docs/engines.md)")
    _check_out(out)
    t0 = time.perf_counter()
    try:
        import_gguf(gguf, out, dtype=dtype)
    except GgufImportError as e:
        fail(str(e))
    typer.echo(
        f"{out}: {checkpoint_parameters(out):,} parameters ({dtype}) and tokenizer from {gguf.name}, "
        f"{time.perf_counter() - t0:.1f} s"
    )


def register(app: typer.Typer) -> None:
    app.add_typer(model_app, name="model")
