"""`rose bench NAME --json`."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import orjson
import typer

from rose.cli import cli_config, fail


def register(app: typer.Typer) -> None:
    @app.command()
    def bench(
        name: str = typer.Argument(..., help="Benchmark name; `rose bench list` lists them."),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
        quick: bool = typer.Option(False, "--quick", help="A short run (smoke test of the bench)."),
        engine: str = typer.Option(
            "",
            "--engine",
            help="Rollout engine of the benches that run workers (coelastic, revoke, replica): vllm | hf.",
        ),
        model: str = typer.Option("", "--model", help="The engine's Hugging Face checkpoint directory."),
        cycles: int = typer.Option(
            0, "--cycles", help="coelastic: warm grants; replica: replica leases (0: the bench's default)."
        ),
        turns: int = typer.Option(0, "--turns", help="gateway: turns measured on each side (0: the bench's default)."),
        max_tokens: int = typer.Option(0, "--max-tokens", help="gateway: tokens per turn (0: the bench's default)."),
        concurrency: int = typer.Option(8, "--concurrency", help="gateway: streams at once on each side."),
        rounds: int = typer.Option(
            0, "--rounds", help="gateway: rounds alternating the sides (0: the bench's default)."
        ),
        plot: str = typer.Option("", "--plot", help="trl: write the reward curve to this PNG."),
        lr: float = typer.Option(0.0, "--lr", help="learning: Adam's learning rate (0: the demo's)."),
    ) -> None:
        """Run a benchmark; figures are measured in this run, goals shown beside them."""
        from rose import bench as benches

        if name == "list":
            for n in benches.names():
                typer.echo(f"{n:14s} {(benches.load(n).__doc__ or '').strip().splitlines()[0]}")
            return
        try:
            mod = benches.load(name)
        except KeyError:
            fail(f"unknown benchmark {name!r}; known: {', '.join(benches.names())}")
        from rose.obs.logs import setup_logging

        setup_logging("WARNING")  # stdout carries only the JSON
        cfg = cli_config()
        if plot and name != "trl":
            fail(f"--plot: bench {name!r} draws no plot (trl does)")
        if lr and name != "learning":
            fail(f"--lr: bench {name!r} trains nothing (learning does)")
        if lr < 0:
            fail(f"--lr {lr}: expected a positive learning rate (0: the demo's)")
        if name in _OWN_OPTIONS:  # benches that start their own engines take --model as an argument
            load = (turns, max_tokens, concurrency, rounds, cycles)
            extra = _OWN_OPTIONS[name](mod, engine, model, plot, load, cfg.rollout.python)
            extra |= {"lr": lr} if name == "learning" else {}
        elif turns or max_tokens or concurrency != 8 or rounds:
            fail(f"--turns/--max-tokens/--concurrency/--rounds: bench {name!r} does not take them (gateway does)")
        else:
            extra = {"cycles": cycles} if cycles and name == "coelastic" else {}
            cfg = _with_engine(cfg, name, engine, model)
        from rose.bench._provenance import provenance

        started = provenance()  # the load as the run starts; the run itself adds to it
        result = mod.run(cfg, quick=quick, **extra)
        result["provenance"] = {**started, "load_average_at_end": provenance()["load_average"]}
        if json_out:
            typer.echo(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode())
        else:
            for k, v in result.items():
                typer.echo(f"{k}: {v}")


def _check_checkpoint(model: str, tokenizer: bool = False, required: bool = False) -> None:
    """`--model`, where given (or `required`), must be a Hugging Face checkpoint directory (one
    line and exit 2)."""
    if (model or required) and not (Path(model) / "config.json").is_file():
        init = "rose model init --tokenizer" if tokenizer else "rose model init"
        fail(f"--model {model!r}: not a Hugging Face checkpoint directory (no config.json); make one with `{init}`")


def _with_engine(cfg, name: str, engine: str, model: str):
    """`cfg` with the rollout engine and checkpoint of `--engine`/`--model` (coelastic, revoke)."""
    if not (engine or model):
        return cfg
    if name not in ("coelastic", "revoke"):
        fail(f"--engine/--model: bench {name!r} runs no rollout engine (coelastic and revoke do)")
    if engine not in ("vllm", "hf"):
        fail(f"--engine {engine!r}: expected vllm or hf")
    _check_checkpoint(model, required=True)
    return dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, engine=engine, model=str(Path(model).resolve()))
    )


def _decode_args(model: str, engine: str) -> dict:
    """`rose bench decode`'s options, checked: vLLM on `model` (default a tiny checkpoint)."""
    if engine not in ("", "vllm"):
        fail(f"--engine {engine!r}: bench decode measures vLLM, the engine whose dtype it chooses")
    _check_checkpoint(model)
    if importlib.util.find_spec("vllm") is None:
        fail("bench decode: vLLM is not installed in this environment (docs/engines.md)")
    return {"model": str(Path(model).resolve()) if model else ""}


def _task_reward_args(model: str, engine: str, name: str = "task_reward") -> dict:
    """`rose bench task_reward`'s (and `learning`'s) options, checked: vLLM sampling `model`, which
    needs its tokenizer."""
    if engine not in ("", "vllm"):
        fail(f"--engine {engine!r}: bench {name} samples through vLLM, as the demo's workers do")
    _check_checkpoint(model, tokenizer=True, required=True)
    from rose.rollout.addition_task import has_chat_template

    if not has_chat_template(model):
        fail(f"--model {model!r}: its tokenizer has no chat template, which renders the task's prompts")
    return {"model": str(Path(model).resolve())}


def _trl_args(model: str, engine: str, plot: str) -> dict:
    """`rose bench trl`'s options, checked: its workers run the hf engine on `model` (with a tokenizer)."""
    if engine not in ("", "hf"):
        fail(f"--engine {engine!r}: bench trl runs hf-engine workers that follow the trainer's weights")
    _check_checkpoint(model, tokenizer=True)
    if plot and not plot.endswith(".png"):
        fail(f"--plot {plot!r}: expected a path ending in .png")
    return {"model": str(Path(model).resolve()) if model else "", "plot": plot}


def _gateway_args(mod, engine: str, model: str, load: tuple[int, ...], python: str) -> dict:
    """`rose bench gateway`'s options, checked (one line and exit 2 for a bad one); `load`: turns,
    max_tokens, concurrency, rounds (then cycles, not its); `python`: the engines' interpreter
    (`rollout.python`; "" = this one)."""
    turns, max_tokens, concurrency, rounds = load[:4]
    if engine not in ("", "vllm"):
        fail(f"--engine {engine!r}: bench gateway runs vLLM (its own server beside the gateway's workers)")
    _check_checkpoint(model)
    if turns < 0:
        fail(f"--turns {turns}: expected a positive number (0: the default)")
    if not 0 <= max_tokens <= mod.MAX_MODEL_LEN - mod.PROMPT_TOKENS:
        fail(f"--max-tokens {max_tokens}: expected 1..{mod.MAX_MODEL_LEN - mod.PROMPT_TOKENS} (0: the default)")
    if concurrency < 1:
        fail(f"--concurrency {concurrency}: expected at least 1")
    if rounds < 0:
        fail(f"--rounds {rounds}: expected a positive number (0: the default)")
    if not python and importlib.util.find_spec("vllm") is None:
        fail("bench gateway: vLLM is not installed in this environment (docs/engines.md)")
    return {
        "model": str(Path(model).resolve()) if model else "",
        "turns": turns,
        "max_tokens": max_tokens,
        "concurrency": concurrency,
        "rounds": rounds,
    }


def _replica_args(engine: str, model: str, load: tuple[int, ...], python: str) -> dict:
    """`rose bench replica`'s options, checked: its serving replicas are vLLM servers on `model`
    (default a tiny checkpoint), its rollout workers the configured engine or `engine` on it;
    `load`'s last is --cycles."""
    turns, max_tokens, concurrency, rounds, cycles = load
    if turns or max_tokens or concurrency != 8 or rounds:
        fail("--turns/--max-tokens/--concurrency/--rounds: bench replica does not take them (its load is fixed)")
    if engine not in ("", "vllm", "hf", "reference"):
        fail(f"--engine {engine!r}: expected vllm, hf or reference (the rollout workers' engine)")
    _check_checkpoint(model)
    if cycles < 0:
        fail(f"--cycles {cycles}: expected a positive number (0: the default)")
    if not python and importlib.util.find_spec("vllm") is None:
        fail("bench replica: vLLM is not installed in this environment (docs/engines.md)")
    if importlib.util.find_spec("vllm_router") is None:
        fail("bench replica: vllm-router is not installed; install it with `pip install -e .[router]`")
    return {"model": str(Path(model).resolve()) if model else "", "engine": engine, "cycles": cycles}


# name -> its options checked into `run`'s keyword arguments: (module, engine, model, plot, load, python);
# `load`: turns, max_tokens, concurrency, rounds, cycles
_OWN_OPTIONS = {
    "gateway": lambda mod, engine, model, plot, load, python: _gateway_args(mod, engine, model, load, python),
    "trl": lambda mod, engine, model, plot, load, python: _trl_args(model, engine, plot),
    "decode": lambda mod, engine, model, plot, load, python: _decode_args(model, engine),
    "task_reward": lambda mod, engine, model, plot, load, python: _task_reward_args(model, engine),
    "learning": lambda mod, engine, model, plot, load, python: _task_reward_args(model, engine, "learning"),
    "replica": lambda mod, engine, model, plot, load, python: _replica_args(engine, model, load, python),
}
