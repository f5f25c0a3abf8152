"""`rose demo`: the whole system end to end on the local stack, with a live view and a report."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def demo(
        duration: float = typer.Option(180.0, "--duration", help="Seconds of the measured run (start-up not counted)."),
        report: str = typer.Option("reports/demo", "--report", help="Directory for report.json, report.md and plots."),
        gpus: int = typer.Option(3, "--gpus", help="Trace-driven serving GPUs sim/0 … sim/{N-1} (plus real/0)."),
        trace: str | None = typer.Option(
            None, "--trace", help="Request trace (default: $ROSE_TRACES/azure_llm2023_conv.csv)."
        ),
        speed: float = typer.Option(0.5, "--speed", help="Play the trace this many times faster (0.5: half its rate)."),
        real_replicas: int = typer.Option(
            1,
            "--real-replicas",
            help="real/0 serves 1/N of the trace at its recorded rate, as one replica of N (its load).",
        ),
        keep: bool = typer.Option(False, "--keep", help="Keep the run's topics and Redis keys afterwards."),
        engine: str = typer.Option(
            "reference",
            "--engine",
            help="Rollout engine: reference (the toy byte-level policy and task), vllm or hf (on --model: "
            "one-digit addition, trained by a transformers copy of the checkpoint).",
        ),
        model: str | None = typer.Option(
            None, "--model", help="Hugging Face checkpoint directory for --engine vllm|hf (`rose model import`)."
        ),
    ) -> None:
        """Serving (trace-driven + one real co-served device), scheduler, executors, rollout workers and a
        trainer closing the RL loop; a live view; a report in --report."""
        from rose.cli import cli_config, fail
        from rose.demo.orchestrator import DemoError, DemoOptions, run_demo
        from rose.sim.traces import TraceError, load_trace

        if not duration >= 20:
            fail(f"--duration must be >= 20 seconds, got {duration}")
        if not 1 <= gpus <= 16:
            fail(f"--gpus must be between 1 and 16, got {gpus}")
        if not speed > 0:
            fail(f"--speed must be > 0, got {speed}")
        if not 1 <= real_replicas <= 1000:
            fail(f"--real-replicas must be between 1 and 1000, got {real_replicas}")
        if engine not in ("reference", "vllm", "hf"):
            fail(f"--engine must be reference, vllm or hf, got {engine!r}")
        if engine != "reference":
            from pathlib import Path

            if not model:
                fail(f"--engine {engine} needs --model DIR (a Hugging Face checkpoint: `rose model import`)")
            elif not (Path(model) / "config.json").is_file():
                fail(f"--model: {model} is not a checkpoint directory (no config.json)")
        elif model:
            fail("--model needs --engine vllm or hf")
        opts = DemoOptions(
            duration_s=duration,
            report_dir=report,
            gpus=gpus,
            trace=trace,
            speed=speed,
            real_replicas=real_replicas,
            keep=keep,
            engine=engine,
            model=model or "",
            max_batch=4 if engine == "reference" else 8,
            # an engine on a checkpoint starts in a minute or more on a CPU: longer windows let the
            # executors' warm workers take the leases of an on window and finish episodes in it
            window_s=20.0 if engine == "reference" else 45.0,
            drain_s=15.0 if engine == "reference" else 30.0,
            startup_timeout_s=240.0 if engine == "reference" else 900.0,  # engines load the checkpoint
        )
        try:
            from rose.demo.orchestrator import default_trace

            load_trace(trace or default_trace())
        except TraceError as e:
            fail(f"--trace: {e}")
        from rose.obs.logs import setup_logging

        setup_logging("WARNING")
        cfg = cli_config()
        try:
            rep = run_demo(cfg, opts, echo=lambda s: typer.echo(s, err=True))
        except DemoError as e:
            fail(str(e), code=1)
        except KeyboardInterrupt:
            fail("interrupted", code=130)
        tp = rep["throughput"]
        typer.echo(
            f"serving SLO attainment {rep['serving_slo_attainment']}; episodes/min dedicated-only "
            f"{tp['dedicated_only']} → with leases {tp['with_leases']}; revoke p50/p99 "
            f"{rep['revoke_latency_ms']['p50']}/{rep['revoke_latency_ms']['p99']} ms; weight bytes ratio "
            f"{rep['weight_bytes_ratio']}"
        )
        typer.echo(f"report: {report}/report.md")
