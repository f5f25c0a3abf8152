"""`rose scheduler`."""

from __future__ import annotations

import socket

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def scheduler(
        instance: str = typer.Option(socket.gethostname(), help="Stable instance id (fences this instance's zombies)."),
        metrics_port: int = typer.Option(None, help="Serve /metrics and /healthz on this port."),
        duration: float = typer.Option(None, help="Stop after this many seconds (default: until SIGTERM)."),
        log_level: str = typer.Option("INFO"),
    ) -> None:
        """The stateless lease scheduler: telemetry in, commands out, exactly once, until SIGTERM."""
        from rose.cli import cli_config, fail
        from rose.kafka.admin import wait_for_broker
        from rose.obs.logs import setup_logging
        from rose.obs.tracing import setup_tracing
        from rose.scheduler.service import FatalSchedulerError
        from rose.scheduler.supervisor import run_scheduler
        from rose.shutdown import Shutdown

        cfg = cli_config()
        setup_logging(log_level)
        setup_tracing(cfg.tracing, service="rose-scheduler")
        shutdown = Shutdown.install(name="rose-scheduler")  # SIGTERM is bounded from here on
        # while Kafka is down: one line saying so, then retries until it answers or SIGTERM
        if not wait_for_broker(cfg.kafka, timeout_s=None, stop=shutdown.stop):
            return
        try:
            run_scheduler(cfg, instance, metrics_port, duration, shutdown=shutdown)
        except FatalSchedulerError as e:
            fail(f"scheduler stopped: {e}", code=1)
