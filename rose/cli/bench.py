"""`rose bench NAME --json`."""

from __future__ import annotations

import orjson
import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def bench(
        name: str = typer.Argument(..., help="Benchmark name; `rose bench list` lists them."),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
        quick: bool = typer.Option(False, "--quick", help="A short run (smoke test of the bench)."),
        engine: str = typer.Option(
            "", "--engine", help="Rollout engine of the benches that run workers (coelastic, revoke): vllm | hf."
        ),
        model: str = typer.Option("", "--model", help="The engine's Hugging Face checkpoint directory."),
        cycles: int = typer.Option(0, "--cycles", help="coelastic: warm grants to measure (0: the bench's default)."),
    ) -> None:
        """Run a benchmark; figures are measured in this run, goals shown beside them."""
        from rose import bench as benches
        from rose.cli import cli_config, fail

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
        if engine or model:
            import dataclasses
            from pathlib import Path

            if name not in ("coelastic", "revoke"):
                fail(f"--engine/--model: bench {name!r} runs no rollout engine (coelastic and revoke do)")
            if engine not in ("vllm", "hf"):
                fail(f"--engine {engine!r}: expected vllm or hf")
            if not (Path(model) / "config.json").is_file():
                fail(
                    f"--model {model!r}: not a Hugging Face checkpoint directory (no config.json); make one with `rose model init`"
                )
            cfg = dataclasses.replace(
                cfg, rollout=dataclasses.replace(cfg.rollout, engine=engine, model=str(Path(model).resolve()))
            )
        result = mod.run(cfg, quick=quick, **({"cycles": cycles} if cycles and name == "coelastic" else {}))
        if json_out:
            typer.echo(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode())
        else:
            for k, v in result.items():
                typer.echo(f"{k}: {v}")
