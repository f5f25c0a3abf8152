"""`rose gateway`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def gateway(
        host: str = typer.Option(None, "--host", help="Address to listen on (default: the config's gateway.host)."),
        port: int = typer.Option(None, "--port", help="Port to listen on (default: the config's gateway.port)."),
        job: str = typer.Option(
            None, "--job", help="Rollout job whose task queue turns go to (default: the config's executor.job)."
        ),
        log_level: str = typer.Option("INFO"),
    ) -> None:
        """The OpenAI-compatible front door over the rollout pool: one turn per request, token ids in and out."""
        import dataclasses

        from rose.cli import cli_config, fail

        if port is not None and not 0 <= port <= 65535:
            fail(f"--port: expected a port 0..65535, got {port}")
        try:
            import fastapi  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError as e:
            fail(f"the gateway needs FastAPI and uvicorn ({e.name} is missing): pip install 'rose-rl[gateway]'")
        from rose.gateway.app import serve
        from rose.obs.logs import setup_logging

        cfg = cli_config()
        if job:
            cfg = dataclasses.replace(cfg, executor=dataclasses.replace(cfg.executor, job=job))
        setup_logging(log_level)
        import redis

        try:
            redis.Redis.from_url(cfg.redis.url, socket_connect_timeout=5).ping()
        except redis.RedisError as e:
            fail(f"redis at {cfg.redis.safe_url} does not answer ({e}); start it (rose stack up) or set redis.url", 1)
        serve(cfg, host, port, log_level="warning" if log_level.upper() == "INFO" else log_level)
