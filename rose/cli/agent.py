"""`rose agent`: serving-node telemetry, simulated from a trace or read from NVML + Prometheus."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def agent(
        simulate: str | None = typer.Option(
            None, "--simulate", metavar="TRACE", help="Trace file (Azure LLM CSV, BurstGPT CSV, Mooncake JSONL)."
        ),
        gpus: int = typer.Option(1, "--gpus", help="Simulated GPUs (ids {node}/0 … {node}/N-1)."),
        duration: float | None = typer.Option(None, "--duration", help="Seconds to run (default: the trace)."),
        speed: float = typer.Option(1.0, "--speed", help="Play the trace this many times faster."),
        model_size: str | None = typer.Option(None, "--model-size", help="7B, 14B, 32B or 70B (simulated)."),
        gpu_type: str | None = typer.Option(None, "--gpu-type", help="H100 or H200 (simulated)."),
        node: str | None = typer.Option(None, "--node", help="Node name (default: sim, or the host name)."),
        seed: int = typer.Option(0, "--seed", help="Load-balancer seed (simulated)."),
        no_pace: bool = typer.Option(False, "--no-pace", help="Do not wait for the wall clock (simulated)."),
        nvml: bool = typer.Option(False, "--nvml", help="Read this node's GPUs through NVML."),
        metrics_url: list[str] = typer.Option(
            [], "--metrics-url", help="Serving engine Prometheus URL; once per GPU, or once for all."
        ),
        replica: list[str] = typer.Option(
            [],
            "--replica",
            help="GPU=REPLICA: the GPU (e.g. node-3/0) belongs to serving replica REPLICA, as its telemetry "
            "says (CONTRACT §7; default: each GPU is a replica of its own); repeat per GPU (--nvml).",
        ),
        rollout_pids: str | None = typer.Option(
            None, "--rollout-pids", metavar="FILE", help="File listing rollout process PIDs (one a line)."
        ),
        metrics_port: int | None = typer.Option(
            None, "--metrics-port", help="Serve /metrics and /healthz on this port."
        ),
        feed_guard: bool = typer.Option(
            False,
            "--feed-guard",
            help="Also write each window's p99 for the executor's local guard (executor.latency_dir).",
        ),
    ) -> None:
        """Publish one rose.telemetry.v1 per GPU per period until the run ends or SIGTERM."""
        import socket
        import sys

        import orjson

        from rose.cli import cli_config, fail, gpu_pairs

        if bool(simulate) == nvml:
            fail("give exactly one of --simulate TRACE or --nvml")
        replicas = gpu_pairs("--replica", replica, "GPU=REPLICA, e.g. node-3/0=replica-a")
        if replicas and not nvml:
            fail("--replica goes with --nvml (a simulated GPU's replica follows its model's tensor parallelism)")
        if gpus < 1:
            fail(f"--gpus must be >= 1, got {gpus}")
        if not speed > 0:
            fail(f"--speed must be > 0, got {speed}")
        if duration is not None and not duration > 0:
            fail(f"--duration must be > 0, got {duration}")
        cfg = cli_config()
        if not cfg.telemetry.period_s > 0:
            fail(f"telemetry.period_s must be > 0, got {cfg.telemetry.period_s}")

        from rose.shutdown import Shutdown

        shutdown = Shutdown.install(name="rose-agent")
        stop = shutdown.stop.is_set

        from rose.obs.logs import setup_logging
        from rose.obs.tracing import setup_tracing

        setup_logging()
        setup_tracing(cfg.tracing, service="rose-agent")
        if metrics_port is not None:
            from rose.obs import metrics

            metrics.serve(metrics_port, health=lambda: not shutdown.requested)

        if nvml:
            from rose.node.nvml import Nvml, NvmlUnavailable

            if not metrics_url:
                fail("--nvml needs --metrics-url URL (the serving engine's Prometheus endpoint)")
            try:
                nv = Nvml()
            except NvmlUnavailable as e:
                fail(str(e), code=3)
            from rose.node import prometheus

            try:
                prometheus.metric_names(cfg.telemetry.engine, cfg.telemetry.metrics)
            except ValueError as e:
                fail(str(e))
            if len(metric_url_set := metric_url_list(metrics_url)) not in (1, len(nv)):
                fail(f"--metrics-url given {len(metric_url_set)} times for {len(nv)} GPUs (give 1 or {len(nv)})")
            node_name = node or socket.gethostname()
            if unknown := sorted(set(replicas) - {f"{node_name}/{i}" for i in range(len(nv))}):
                fail(f"--replica: {unknown[0]!r} is no GPU of this node ({node_name}/0 … {node_name}/{len(nv) - 1})")
            from rose.executor.guard import default_latency_dir
            from rose.kafka.telemetry_publisher import TelemetryPublisher
            from rose.node.agent import NvmlOptions, run_nvml

            pub = TelemetryPublisher.for_config(cfg)
            try:
                guard_dir = (cfg.executor.latency_dir or str(default_latency_dir())) if feed_guard else None
                summary = run_nvml(
                    cfg,
                    NvmlOptions(metric_url_set, node_name, rollout_pids, guard_dir=guard_dir, replicas=replicas),
                    nv,
                    stop,
                    publisher=pub,
                )
            finally:
                left = pub.flush(5.0)
                nv.close()
        else:
            from rose.kafka.telemetry_publisher import TelemetryPublisher
            from rose.node.simulated_agent import SimOptions, run_simulated

            assert simulate is not None  # exactly one of --simulate / --nvml, checked above
            _check_simulated(cfg, simulate, model_size, gpu_type)  # before connecting anywhere
            from rose.executor.guard import default_latency_dir

            pub = TelemetryPublisher.for_config(cfg)
            opt = SimOptions(
                trace=simulate,
                gpus=gpus,
                duration_s=duration,
                speed=speed,
                model_size=model_size,
                gpu_type=gpu_type,
                node=node or "sim",
                seed=seed,
                pace=not no_pace,
                guard_dir=(cfg.executor.latency_dir or str(default_latency_dir())) if feed_guard else None,
            )
            try:
                summary = run_simulated(cfg, opt, stop, publisher=pub)
            finally:
                left = pub.flush(5.0)
        summary.update(pub.counters(), undelivered=left)
        sys.stderr.write(orjson.dumps({"agent": summary}).decode() + "\n")


def metric_url_list(urls: list[str]) -> list[str]:
    """--metrics-url values, also accepting comma-separated lists."""
    return [u.strip() for x in urls for u in x.split(",") if u.strip()]


def _check_simulated(cfg, trace: str, model_size: str | None, gpu_type: str | None) -> None:
    """`--simulate`'s inputs, each read once: one line and exit status 2 for a bad one."""
    from pathlib import Path

    from rose.cli import fail
    from rose.sim.interference import ProfileError, read_profile
    from rose.sim.models import gpu_spec
    from rose.sim.models import model_size as model_preset
    from rose.sim.traces import TraceError, load_trace

    try:
        load_trace(trace)
    except TraceError as e:
        fail(str(e))
    try:
        model_preset(model_size or cfg.telemetry.model_size)
        gpu_spec(gpu_type or cfg.telemetry.gpu_type)
    except ValueError as e:
        fail(f"--model-size/--gpu-type: {e}")
    if cfg.telemetry.interference_profile:
        try:
            read_profile(Path(cfg.telemetry.interference_profile))
        except ProfileError as e:
            fail(f"telemetry.interference_profile: {e}")
