"""`rose stack up|down|status` and `rose topics create`."""

from __future__ import annotations

import typer


def _echo_kafka_cluster(s, brokers: int) -> None:
    """`up --brokers 3`: the cluster's bootstrap and the settings that put the contract on it."""
    if brokers == 3:
        typer.echo(
            f"kafka cluster:   {s.kafka_cluster_bootstrap}; ROSE_KAFKA_BOOTSTRAP={s.kafka_cluster_bootstrap} "
            "ROSE_KAFKA__REPLICATION=3 ROSE_KAFKA__MIN_INSYNC_REPLICAS=2"
        )


def _kafka_cluster_note(s, service: str, required: set[str]) -> str:
    if service != "kafka-cluster":
        return ""
    return f" ({s.kafka_cluster_bootstrap})" if service in required else " (not started; rose stack up --brokers 3)"


def register(app: typer.Typer) -> None:
    stack = typer.Typer(
        help="The local Apache Kafka (KRaft) + Redis (+ Jaeger) stack on loopback.", no_args_is_help=True
    )
    topics = typer.Typer(help="Kafka topics of the contract.", no_args_is_help=True)
    app.add_typer(stack, name="stack")
    app.add_typer(topics, name="topics")

    def _stack():
        from rose.cli import cli_config
        from rose.stack import LocalStack

        return LocalStack.from_config(cli_config())

    @stack.command("up")
    def up(
        jaeger: bool = typer.Option(
            False, "--jaeger", help="Also run Jaeger v2 (traces UI; built once from the Go module proxy)."
        ),
        own: bool = typer.Option(
            False, "--own", help="Fail, starting nothing, when another stack or program holds this stack's ports."
        ),
        redis_cluster: bool = typer.Option(
            False,
            "--redis-cluster",
            help="Also run a Redis Cluster, 3 masters + 3 replicas (the six ports after Redis's), for sharded weight streams.",
        ),
        brokers: int = typer.Option(
            1,
            "--brokers",
            help="3: also run a 3-node KRaft Kafka cluster (RF 3, min ISR 2) on ports 9192-9194 "
            "(controllers 9292-9294; stack.kafka_cluster_port moves them).",
        ),
    ) -> None:
        """Start Kafka and Redis (idempotent); wait until both answer. Says whose stack it uses
        when another checkout's stack already answers on these ports."""
        from rose.cli import fail
        from rose.stack import StackError

        s = _stack()
        try:
            s.up(jaeger=jaeger, own=own, redis_cluster=redis_cluster, brokers=brokers)
        except StackError as e:
            fail(str(e), code=1)
        typer.echo(f"kafka bootstrap: {s.kafka_bootstrap}")
        typer.echo(f"redis url:       {s.redis_url}")
        if redis_cluster:
            typer.echo(
                f"redis cluster:   {s.redis_cluster_nodes}; ROSE_REDIS__CLUSTER_NODES={s.redis_cluster_nodes} "
                "ROSE_REDIS__SHARD_STREAMS=3"
            )
        _echo_kafka_cluster(s, brokers)
        if jaeger:
            typer.echo(f"jaeger ui:       {s.jaeger_query_url}")
            typer.echo(
                f"otlp endpoint:   {s.jaeger_otlp_endpoint} (http), {s.jaeger_otlp_grpc_endpoint} (grpc); "
                f"ROSE_TRACING__EXPORTER=otlp ROSE_TRACING__OTLP_ENDPOINT={s.jaeger_otlp_endpoint}/v1/traces"
            )

    @stack.command("down")
    def down() -> None:
        """Stop what `rose stack up` started (nothing else)."""
        stopped = _stack().down()
        typer.echo(f"stopped: {', '.join(stopped) or 'nothing (not started by rose stack up)'}")

    @stack.command("status")
    def status() -> None:
        """Exit 0 only when both Kafka and Redis answer (and Jaeger, if `up --jaeger` started it;
        the Redis Cluster, cluster_state ok, if `up --redis-cluster` did; the Kafka cluster,
        three brokers and every partition led, if `up --brokers 3` did). Names the other
        stack when one answers on this stack's ports."""
        s = _stack()
        st = s.status(jaeger=True, redis_cluster=True, kafka_cluster=True)
        required = (
            {"kafka", "redis"}
            | ({"jaeger"} if s.jaeger_started() else set())
            | ({"redis-cluster"} if s.redis_cluster_started() else set())
            | ({"kafka-cluster"} if s.kafka_cluster_started() else set())
        )
        theirs = {h.service: h for h in s.foreign(list(st))}
        for k, v in st.items():
            note = f" ({theirs[k].describe()})" if k in theirs else ""
            if k == "jaeger" and not v and k not in required:
                note = " (not started; rose stack up --jaeger)"
            if k == "redis-cluster" and not note:
                note = (
                    f" ({s.redis_cluster_nodes}, cluster_state ok)"
                    if v
                    else f" ({s.redis_cluster_nodes}: {s._said()})"
                    if k in required
                    else " (not started; rose stack up --redis-cluster)"
                )
            note = note or _kafka_cluster_note(s, k, required)
            typer.echo(f"{k}: {'up' if v else 'down'}{note}")
        raise typer.Exit(0 if all(st[k] for k in required) else 1)

    @topics.command("create")
    def create() -> None:
        """Create telemetry, commands, lease-state (compacted), scheduler-state, dlq; idempotent."""
        from rose.cli import cli_config, fail
        from rose.kafka.admin import KafkaException, wait_for_broker
        from rose.kafka.topics import create_topics

        cfg = cli_config()
        try:
            wait_for_broker(cfg.kafka, timeout_s=15)
            for name, what in create_topics(cfg.kafka).items():
                typer.echo(f"{name}: {what}")
        except (TimeoutError, KafkaException) as e:
            fail(f"cannot create topics on {cfg.kafka.bootstrap}: {e}", code=1)
