"""The `rose` command line.

Each module in this package adds its commands with `register(app)`; heavy imports
(torch, the Kafka client) happen inside the commands, so `rose --help` is instant and
the control plane runs without the rollout extra installed.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from typing import NoReturn

import typer

from rose.config import ConfigError, load_config
from rose.contract.events import InvalidEvent

app = typer.Typer(
    name="rose",
    help="ROSE: lend idle serving-GPU capacity to agentic-RL rollout without costing serving its SLO.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_state: dict = {"config_path": None}


@app.callback()
def _main(
    config: str = typer.Option(None, "--config-file", envvar="ROSE_CONFIG", help="TOML config file."),
) -> None:
    _state["config_path"] = config


def cli_config():
    """The config for a command: file from --config-file/$ROSE_CONFIG, then environment."""
    return load_config(_state["config_path"])


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one clear line to stderr and exit; for errors the user can fix."""
    typer.echo(f"rose: {message}", err=True)
    raise typer.Exit(code)


def gpu_pairs(option: str, values: list[str], expected: str, valid=bool) -> dict[str, str]:
    """Repeated `GPU=VALUE` options as {gpu: value}; a value without a GPU, or one `valid` refuses,
    is one line naming `option` and what was `expected`, and exit status 2."""
    out: dict[str, str] = {}
    for v in values:
        gpu, sep, value = v.partition("=")
        if not sep or not gpu.strip() or not valid(value.strip()):
            fail(f"{option}: expected {expected}, got {v!r}")
        out[gpu.strip()] = value.strip()
    return out


for _mod in pkgutil.iter_modules(__path__):
    if _mod.name == "__main__":
        continue
    importlib.import_module(f"{__name__}.{_mod.name}").register(app)


def main() -> None:
    try:
        app()
    except (ConfigError, InvalidEvent) as e:
        typer.echo(f"rose: {e}", err=True)
        sys.exit(2)
    except Exception as e:
        if not _redis_unreachable(e):
            raise
        typer.echo(
            f"rose: {_redis_where()} is unreachable ({e}): start it (`rose stack up`) or set redis.url", err=True
        )
        sys.exit(2)


def _redis_unreachable(e: BaseException) -> bool:
    """A command that reached for Redis and found no server; checked without importing redis,
    which only commands that use it import."""
    r = sys.modules.get("redis")
    return r is not None and isinstance(e, (r.ConnectionError, r.TimeoutError))


def _redis_where() -> str:
    try:
        cfg = cli_config()
    except ConfigError:
        return "Redis"
    nodes = cfg.redis.cluster_nodes.strip()
    return f"Redis Cluster at {nodes}" if nodes else f"Redis at {cfg.redis.safe_url}"
