"""`rose simulate`: a trace-driven what-if of a serving cluster lending capacity to agentic RL."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def simulate(
        trace: Path = typer.Option(
            ..., "--trace", help="Request trace: Azure LLM CSV, BurstGPT CSV or Mooncake JSONL."
        ),
        gpus: int = typer.Option(64, "--gpus", help="Serving GPUs."),
        dedicated: int = typer.Option(0, "--dedicated", help="Dedicated rollout GPUs (0: gpus/8, at least 1)."),
        model_size: str = typer.Option("7B", "--model-size", help="7B | 14B | 32B | 70B (served and RL policy)."),
        gpu: str = typer.Option("H100", "--gpu", help="H100 | H200."),
        policy: str = typer.Option(
            "all", "--policy", help="static | elastic | share-all | rose | all (comma list ok)."
        ),
        duration: float = typer.Option(0.0, "--duration", help="Seconds of trace time (0: the trace, at most 1 h)."),
        seed: int = typer.Option(0, "--seed", help="Seed of trace replication and load balancing."),
        load: float = typer.Option(0.7, "--load", help="Roofline utilisation of the busiest minute (0..1]."),
        decide_every: int = typer.Option(
            0, "--decide-every", help="Windows per policy event (0: auto, 1 up to 2M decide calls)."
        ),
        interference_bench: Path = typer.Option(
            None, "--interference-bench", help="`rose bench interference --json` output: calibrates alpha."
        ),
        weights_bench: Path = typer.Option(
            None, "--weights-bench", help="`rose bench weights --json` output: the delta bytes ratio."
        ),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
        report: Path = typer.Option(None, "--report", help="Write report.json, report.md and PNG plots here."),
        series: bool = typer.Option(False, "--series", help="Include per-window series in --json output."),
    ) -> None:
        """Simulate serving + agentic RL under static, elastic, share-all and ROSE; the same policy code as the scheduler."""
        import orjson

        from rose.cli import cli_config, fail
        from rose.sim.engine import POLICIES, SimConfig, calibration
        from rose.sim.engine import simulate as run_sim
        from rose.sim.traces import TraceError, load_trace

        names = POLICIES if policy.strip() == "all" else tuple(p.strip() for p in policy.split(",") if p.strip())
        bad = [p for p in names if p not in POLICIES]
        if bad or not names:
            fail(f"--policy: unknown {', '.join(bad) or policy!r} (known: {', '.join(POLICIES)}, all)")
        if gpus < 1:
            fail(f"--gpus must be >= 1, got {gpus}")
        if dedicated < 0:
            fail(f"--dedicated must be >= 0, got {dedicated}")
        if duration < 0:
            fail(f"--duration must be >= 0, got {duration}")
        if not 0 < load <= 1:
            fail(f"--load must be in (0, 1], got {load}")
        if decide_every < 0:
            fail(f"--decide-every must be >= 0, got {decide_every}")
        try:
            tr = load_trace(trace)
        except TraceError as e:
            fail(f"--trace: {e}")

        def bench_file(path: Path | None, flag: str):
            if path is None:
                return None
            try:
                d = orjson.loads(path.read_bytes())
            except (OSError, orjson.JSONDecodeError) as e:
                fail(f"{flag}: cannot read {path}: {e}")
            if not isinstance(d, dict):
                fail(f"{flag}: {path} is not one JSON object")
            d["_source"] = str(path)
            return d

        try:
            cal = calibration(
                bench_file(interference_bench, "--interference-bench"), bench_file(weights_bench, "--weights-bench")
            )
        except ValueError as e:
            fail(str(e))
        cfg = cli_config()
        try:
            sc = SimConfig(
                n_gpus=gpus,
                dedicated=dedicated,
                model=model_size,
                gpu=gpu,
                duration_s=duration,
                seed=seed,
                load=load,
                decide_every=decide_every,
                policies=names,
                policy=cfg.policy,
                record_series=bool(report) or series,
                **cal,
            )
            result = run_sim(tr, sc)
        except ValueError as e:
            fail(str(e))
        if report is not None:
            from rose.sim.report import write_report

            write_report(result, report)
        if not series:
            result.pop("series", None)
        if json_out:
            typer.echo(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode())
            return
        c = result["config"]
        typer.echo(
            f"{c['trace']} · {c['gpus']} serving GPUs ({c['gpu']}, {c['model_size']}) + {c['dedicated']} "
            f"dedicated · {c['duration_s']:g} s · SLO ttft {c['slo_ms']['ttft_p99']:g} ms, "
            f"tpot {c['slo_ms']['tpot_p99']:g} ms · wall {result['wall_s']:.1f} s"
        )
        typer.echo(
            f"{'policy':10s} {'episodes/h':>11s} {'RL steps/h':>10s} {'gain':>6s} {'SLO att.':>8s} "
            f"{'revokes':>7s} {'weights GB':>10s}"
        )
        for p, r in result["policies"].items():
            typer.echo(
                f"{p:10s} {r['episodes_per_hour']:11.1f} {r['rl_steps_per_hour']:10.2f} "
                f"{r['gain_vs_static']:6.3f} {r['slo_attainment']:8.5f} {r['revokes']:7d} "
                f"{r['weight_sync_bytes'] / 1e9:10.1f}"
            )
        if report is not None:
            typer.echo(f"report: {report / 'report.md'}")

    @app.command("paper-check")
    def paper_check(
        traces: Path = typer.Option(None, "--traces", envvar="ROSE_TRACES", help="Folder of the shared traces."),
        gpus: int = typer.Option(32, "--gpus", help="Serving GPUs per run."),
        duration: float = typer.Option(1800.0, "--duration", help="Seconds of trace time per run."),
        gpu: str = typer.Option("H100", "--gpu", help="H100 | H200."),
        out: Path = typer.Option(None, "--out", help="Write the markdown table here (default: stdout)."),
    ) -> None:
        """`rose simulate` on the Azure code/conv and BurstGPT traces for 7B–70B, beside the paper's claim."""
        from rose.cli import cli_config, fail
        from rose.sim.engine import SimConfig
        from rose.sim.engine import simulate as run_sim
        from rose.sim.report import paper_check_markdown
        from rose.sim.traces import TraceError, load_trace

        folder = traces or Path(__file__).resolve().parents[2].parent / "shared" / "traces"
        names = ("azure_llm2023_code.csv", "azure_llm2023_conv.csv", "burstgpt1_first400.csv")
        results = []
        pc = cli_config().policy
        for name in names:
            try:
                tr = load_trace(folder / name)
            except TraceError as e:
                fail(f"--traces: {e}")
            for size in ("7B", "14B", "32B", "70B"):
                r = run_sim(
                    tr, SimConfig(n_gpus=gpus, model=size, gpu=gpu, duration_s=duration, policy=pc, record_series=False)
                )
                results.append(r)
                typer.echo(
                    f"{name} {size}: ROSE ×{r['policies']['rose']['gain_vs_static']:.3f}, SLO "
                    f"{r['policies']['rose']['slo_attainment']:.5f} (static "
                    f"{r['policies']['static']['slo_attainment']:.5f}), {r['wall_s']:.1f} s",
                    err=True,
                )
        cmd = f"rose paper-check --gpus {gpus} --duration {duration:g} --gpu {gpu}"
        table = paper_check_markdown(results, cmd)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(table)
        else:
            typer.echo(table)
