"""Every `rose` command answers `--help` with its usage (exit 0): help texts are rendered as rich
markup, and a stray bracket pair in one (``[/tpN]``) made that command's help a traceback."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from rose.cli import app


def _paths(group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [prefix]
    for name, cmd in getattr(group, "commands", {}).items():
        out += _paths(cmd, (*prefix, name)) if hasattr(cmd, "commands") else [(*prefix, name)]
    return out


def test_every_command_answers_help():
    paths = _paths(typer.main.get_command(app))
    assert {("simulate",), ("paper-check",), ("bench",)} <= set(paths)
    runner = CliRunner()
    for path in paths:
        r = runner.invoke(app, [*path, "--help"])
        assert r.exit_code == 0 and "Usage" in r.output, (path, r.output[-400:], r.exception)
