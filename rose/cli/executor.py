"""`rose executor`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def executor(
        gpus: str = typer.Option(
            None, "--gpus", help="Comma-separated GPU ids this node serves, e.g. node-3/0,node-3/1."
        ),
        simulate: int = typer.Option(
            None, "--simulate", help="Manage N simulated GPUs sim/0 … sim/{N-1} (device cpu)."
        ),
        job: str = typer.Option(
            None, "--job", help="Rollout job whose task queue the workers serve (default: the config's executor.job)."
        ),
        device: str = typer.Option(
            None,
            "--device",
            help="Torch device of the workers: cpu, cuda, cuda:N (default: cpu "
            "with --simulate, cuda:<index> with --gpus when CUDA is present).",
        ),
        metrics_port: int = typer.Option(None, "--metrics-port", help="Serve /metrics and /healthz on this port."),
        no_guard: bool = typer.Option(False, "--no-guard", help="Turn the local fast guard off."),
        replica: list[str] = typer.Option(
            [],
            "--replica",
            help="GPU=URL: the GPU is the serving replica at URL (as its router knows it), lent whole "
            "on replica leases through [router] (docs/executor.md); repeat per replica.",
        ),
        log_level: str = typer.Option("INFO"),
    ) -> None:
        """Obey the lease command stream for this node's GPUs and run rollout workers inside the leases."""
        import dataclasses

        from rose.cli import cli_config, fail, gpu_pairs

        if (gpus is None) == (simulate is None):
            fail("give exactly one of --gpus ID,… or --simulate N")
        if simulate is not None and simulate < 1:
            fail(f"--simulate: expected a positive number of GPUs, got {simulate}")
        if gpus is not None:
            ids = [g.strip() for g in gpus.split(",") if g.strip()]
            if not ids:
                fail("--gpus: expected comma-separated GPU ids, got nothing")
        if device is not None and not (
            device == "cpu" or device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())
        ):
            fail(f"--device: expected cpu, cuda or cuda:N, got {device!r}")

        replicas = gpu_pairs(
            "--replica", replica, "GPU=http://host:port", lambda u: u.startswith(("http://", "https://"))
        )
        from rose.executor.service import Executor, simulated_gpus
        from rose.kafka.admin import wait_for_broker
        from rose.obs import metrics
        from rose.obs.logs import setup_logging
        from rose.obs.tracing import setup_tracing

        cfg = cli_config()
        if job:
            cfg = dataclasses.replace(cfg, executor=dataclasses.replace(cfg.executor, job=job))
        setup_logging(log_level)
        setup_tracing(cfg.tracing, service="rose-executor")
        if simulate is not None:
            ids, dev = simulated_gpus(simulate), device or "cpu"
        else:
            dev = device or _default_device(ids)
        from rose.shutdown import Shutdown

        shutdown = Shutdown.install(name="rose-executor")  # SIGTERM is bounded from here on
        # while Kafka is down: one line saying so, then retries until it answers or SIGTERM
        if not wait_for_broker(cfg.kafka, timeout_s=None, stop=shutdown.stop):
            return
        from rose.router.base import RouterError
        from rose.router.configured import router_for

        try:
            router = router_for(cfg.router, replicas.values()) if replicas else None
            ex = Executor(cfg, ids, device=dev, guard=not no_guard, replicas=replicas, router=router)
        except (ValueError, RouterError) as e:
            fail(str(e))
        port = metrics_port if metrics_port is not None else (cfg.executor.metrics_port or None)
        if port is not None:
            metrics.serve(port, health=lambda: ex.consumer is not None)
        try:
            ex.start()
        except RouterError as e:  # the router does not answer: one line, naming router.url
            ex.shutdown()
            fail(str(e))
        ex.run(shutdown.stop)


def _default_device(ids: list[str]) -> str:
    """`node/3` on a CUDA host runs on cuda:3 when the suffix is a local index; else cpu."""
    try:
        import torch

        if torch.cuda.is_available() and len(ids) == 1:
            idx = ids[0].rsplit("/", 1)[-1]
            if idx.isdigit() and int(idx) < torch.cuda.device_count():
                return f"cuda:{idx}"
    except ImportError:
        pass
    return "cpu"
