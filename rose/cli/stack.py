"""`rose stack up|down|status` and `rose topics create`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    stack = typer.Typer(help="The local Apache Kafka (KRaft) + Redis stack on loopback.", no_args_is_help=True)
    topics = typer.Typer(help="Kafka topics of the contract.", no_args_is_help=True)
    app.add_typer(stack, name="stack")
    app.add_typer(topics, name="topics")

    def _stack():
        from rose.cli import cli_config
        from rose.stack import LocalStack

        return LocalStack.from_config(cli_config())

    @stack.command("up")
    def up() -> None:
        """Start Kafka and Redis (idempotent); wait until both answer."""
        from rose.cli import fail
        from rose.stack import StackError

        s = _stack()
        try:
            s.up()
        except StackError as e:
            fail(str(e), code=1)
        typer.echo(f"kafka bootstrap: {s.kafka_bootstrap}")
        typer.echo(f"redis url:       {s.redis_url}")

    @stack.command("down")
    def down() -> None:
        """Stop what `rose stack up` started (nothing else)."""
        stopped = _stack().down()
        typer.echo(f"stopped: {', '.join(stopped) or 'nothing (not started by rose stack up)'}")

    @stack.command("status")
    def status() -> None:
        """Exit 0 only when both Kafka and Redis answer."""
        st = _stack().status()
        for k, v in st.items():
            typer.echo(f"{k}: {'up' if v else 'down'}")
        raise typer.Exit(0 if all(st.values()) else 1)

    @topics.command("create")
    def create() -> None:
        """Create telemetry, commands, lease-state (compacted), scheduler-state, dlq; idempotent."""
        from confluent_kafka import KafkaException

        from rose.cli import cli_config, fail
        from rose.kafka import wait_for_broker
        from rose.topics import create_topics

        cfg = cli_config()
        try:
            wait_for_broker(cfg.kafka, timeout_s=15)
            for name, what in create_topics(cfg.kafka).items():
                typer.echo(f"{name}: {what}")
        except (TimeoutError, KafkaException) as e:
            fail(f"cannot create topics on {cfg.kafka.bootstrap}: {e}", code=1)
