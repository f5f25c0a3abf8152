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
        result = mod.run(cli_config(), quick=quick)
        if json_out:
            typer.echo(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode())
        else:
            for k, v in result.items():
                typer.echo(f"{k}: {v}")
