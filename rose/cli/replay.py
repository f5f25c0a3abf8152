"""`rose record` (topics to NDJSON) and `rose replay` (the policy over a recorded log)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import typer

DEFAULT_TOPICS = "telemetry,commands,lease-state"


def register(app: typer.Typer) -> None:  # noqa: C901 - the commands it defines are nested in it and counted with it
    @app.command()
    def record(
        out: Path = typer.Option(..., "--out", help="NDJSON file to write (one Kafka message a line)."),
        topics: str = typer.Option(
            DEFAULT_TOPICS,
            "--topics",
            help="Comma-separated topics: contract names (telemetry, commands, lease-state, "
            "dlq) take the configured prefix; full names are used as given.",
        ),
        timeout: float = typer.Option(60.0, "--timeout", help="Seconds allowed to read each topic to its end."),
    ) -> None:
        """Export topics to NDJSON, each line {topic, partition, offset, timestamp_ms, key, headers, value}.

        Reads committed messages only (read_committed), each topic up to its end offsets at
        the time it is read."""
        import orjson

        from rose.cli import cli_config, fail
        from rose.kafka.admin import KafkaException, wait_for_broker
        from rose.kafka.consumer import message_record, read_all

        k = cli_config().kafka
        names = [t.strip() for t in topics.split(",") if t.strip()]
        if not names:
            fail("--topics: no topic given")
        full = [t if t.startswith(k.topic_prefix) else k.topic(t) for t in names]
        try:
            wait_for_broker(k, timeout_s=min(timeout, 15.0))
        except TimeoutError as e:
            fail(str(e))
        total = 0
        try:
            fh = open(out, "wb")
        except OSError as e:
            fail(f"--out: cannot write {out}: {e.strerror}")
        with fh:
            for t in full:
                typer.echo(f"record: reading {t} ...", err=True)
                try:
                    msgs = read_all(k, [t], timeout_s=timeout)
                except KafkaException as e:
                    fail(f"--topics: cannot read topic {t}: {e.args[0].str() if e.args else e}")
                except TimeoutError as e:
                    fail(f"{e} (raise --timeout)")
                for m in msgs:
                    fh.write(orjson.dumps(message_record(m)) + b"\n")
                total += len(msgs)
                typer.echo(f"record: {t}: {len(msgs)} messages", err=True)
        typer.echo(f"record: wrote {total} messages from {len(full)} topics to {out}", err=True)

    @app.command()
    def replay(  # noqa: C901 - one exit-2 line per bad option, then the replay's modes (diff, explain, out)
        log: str = typer.Argument(..., help="A `rose record` log or plain telemetry NDJSON; '-' reads stdin."),
        config: Path | None = typer.Option(None, "--config", help="TOML config for a what-if ([policy] thresholds)."),
        out: Path | None = typer.Option(None, "--out", help="Write the commands here (default: stdout)."),
        diff: bool = typer.Option(
            False, "--diff", help="Compare with the commands recorded in LOG; exit 1 on a divergence."
        ),
        explain: str | None = typer.Option(
            None,
            "--explain",
            metavar="GPU",
            help="Print, per event of this GPU, the view and why a decision was or was not taken.",
        ),
        telemetry_only: bool = typer.Option(
            False, "--telemetry-only", help="Do not fold the executors' lease states into the views."
        ),
    ) -> None:
        """Re-run the lease policy over the telemetry in LOG; one command a line, byte-identical every run."""
        from rose.cli import cli_config, fail
        from rose.config import ConfigError, load_config
        from rose.policy.replay import encode_commands, explain_lease_state, explain_step, first_divergence, read_log
        from rose.policy.replay import replay as run_replay

        try:
            cfg = load_config(config) if config is not None else cli_config()
        except ConfigError as e:
            fail(f"--config: {e}")
        name = "stdin" if log == "-" else log
        try:
            fh = sys.stdin.buffer if log == "-" else open(log, "rb")
        except OSError as e:
            fail(f"LOG: cannot read {log}: {e.strerror}")

        def on_error(lineno: int, msg: str) -> None:
            typer.echo(f"rose: {name}:{lineno}: {msg} (line skipped)", err=True)

        with fh:
            parsed = read_log(fh, cfg.policy, on_error)
        if explain is not None and not any(ev.gpu == explain for _, ev in parsed.telemetry):
            gpus = sorted({ev.gpu for _, ev in parsed.telemetry})
            fail(
                f"--explain: no telemetry for gpu {explain!r} in {name} (it has {len(gpus)} GPUs"
                + (f", e.g. {', '.join(gpus[:5])})" if gpus else ")")
            )

        on_decision = on_lease_state = None
        if explain is not None:

            def on_decision(lineno, ev, before, d):
                if ev.gpu == explain:
                    typer.echo(explain_step(lineno, ev, before, d))

            def on_lease_state(lineno, ls, before, after):
                if ls.gpu == explain:
                    typer.echo(explain_lease_state(lineno, ls, before, after))

        commands, views = run_replay(
            parsed.telemetry,
            cfg.policy,
            on_decision,
            () if telemetry_only else parsed.lease_states,
            parsed.record_ms,
            on_lease_state,
        )
        data = encode_commands(commands)
        if out is not None:
            try:
                out.write_bytes(data)
            except OSError as e:
                fail(f"--out: cannot write {out}: {e.strerror}")
        elif not diff and explain is None:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
        kinds = Counter(c.kind for c in commands)
        ignored = sum(v.ignored_stale for v in views.values())
        typer.echo(
            f"replay: {len(parsed.telemetry)} telemetry events on {len(views)} GPUs ({ignored} stale or "
            f"duplicate ignored, {parsed.skipped} lines skipped) -> {len(commands)} commands "
            f"({', '.join(f'{k} {kinds[k]}' for k in ('grant', 'renew', 'revoke'))})",
            err=True,
        )
        if diff:
            if not parsed.commands:
                typer.echo(f"rose: --diff: {name} holds no recorded commands to compare with", err=True)
            d = first_divergence(parsed.commands, commands)
            if d is not None:
                typer.echo(d.describe(parsed.lease_states))
                raise typer.Exit(1)
            typer.echo(
                f"no divergence: {len(commands)} commands on {len({c.gpu for c in commands})} GPUs match the log"
            )
