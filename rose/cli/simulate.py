"""`rose simulate`: a trace-driven what-if of a serving cluster lending capacity to agentic RL."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:  # noqa: C901 - the commands it defines are nested in it and counted with it
    @app.command()
    def simulate(  # noqa: C901 - one exit-2 line per bad option or trace, then the run
        trace: Path = typer.Option(
            ..., "--trace", help="Request trace: Azure LLM CSV, BurstGPT CSV or Mooncake JSONL."
        ),
        gpus: int = typer.Option(64, "--gpus", help="Serving GPUs."),
        dedicated: int = typer.Option(0, "--dedicated", help="Dedicated rollout GPUs (0: gpus/8, at least 1)."),
        model_size: str = typer.Option(
            "7B", "--model-size", help="7B | 8B | 14B | 32B | 70B (served and RL policy; docs/simulator.md)."
        ),
        gpu: str = typer.Option("H100", "--gpu", help="H100 | H200."),
        tp: int = typer.Option(0, "--tp", help="Serving tensor parallel GPUs (0: the fewest that host the model)."),
        rollout_tp: int = typer.Option(
            0, "--rollout-tp", help="Rollout tensor parallel GPUs, gang leases when > 1 (0: as serving)."
        ),
        policy: str = typer.Option(
            "all",
            "--policy",
            help="static | elastic | share-all | rose | rose-coresident | rose-replica | all (the first four; "
            "comma list ok).",
        ),
        duration: float = typer.Option(0.0, "--duration", help="Seconds of trace time (0: the trace, at most 1 h)."),
        seed: int = typer.Option(0, "--seed", help="Seed of trace replication and load balancing."),
        seeds: int = typer.Option(
            1, "--seeds", help="Run seeds SEED..SEED+K-1: every figure as a mean with its 95 % interval."
        ),
        load: float = typer.Option(0.7, "--load", help="Roofline utilisation of the busiest minute (0..1]."),
        decide_every: int = typer.Option(
            0, "--decide-every", help="Windows per policy event (0: auto, 1 up to 2M decide calls)."
        ),
        workers: int = typer.Option(
            0,
            "--workers",
            help="Processes: 1 runs every policy in one; 2 runs ROSE in a second one, same results "
            "(0: 2 for runs of 1M GPU-windows or more).",
        ),
        interference_profile: Path = typer.Option(
            None,
            "--interference-profile",
            help="A rose.interference_profile.v1 file (default: docs/measured/h200/interference-profile-8b-separate_process.json).",
        ),
        interference_bench: Path = typer.Option(
            None, "--interference-bench", help="`rose bench interference --json` output, read as a profile."
        ),
        interference_alpha: float = typer.Option(
            None, "--interference-alpha", help="Sweep option: the linear profile 1 + alpha × share instead."
        ),
        weights_bench: Path = typer.Option(
            None, "--weights-bench", help="`rose bench weights --json` output: the delta bytes ratio."
        ),
        lease_start_s: float = typer.Option(
            None,
            "--lease-start-s",
            help="Seconds from a lease's start to its worker decoding (default: a warm worker's "
            "wake-up, its weight shard copied to the GPU; docs/simulator.md).",
        ),
        resume_s: float = typer.Option(
            None,
            "--resume-s",
            help="Seconds from a paused lease's resume to its worker decoding (default 0.046, measured).",
        ),
        elastic_provision_s: float = typer.Option(
            None, "--elastic-provision-s", help="Seconds from elastic's request to a usable GPU (default 180, assumed)."
        ),
        warm_workers: int = typer.Option(
            1, "--warm-workers", help="Warm workers each node's executor keeps (executor.warm_workers; 0: all cold)."
        ),
        cold_start_s: float = typer.Option(
            None,
            "--cold-start-s",
            help="Seconds from a lease's start to decoding with no warm worker (default: sourced per model size).",
        ),
        json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
        report: Path = typer.Option(None, "--report", help="Write report.json, report.md and PNG plots here."),
        series: bool = typer.Option(False, "--series", help="Include per-window series in --json output."),
    ) -> None:
        """Simulate serving + agentic RL under static, elastic, share-all and ROSE; the same policy code as the scheduler."""
        import orjson

        from rose.cli import cli_config, fail
        from rose.sim.engine import ALL_POLICIES, POLICIES, SimConfig, calibration, simulate_seeds
        from rose.sim.lease_kinds_run import configured_pool
        from rose.sim.models import RESUME_S
        from rose.sim.report import with_ci
        from rose.sim.runs import ELASTIC_PROVISION_S
        from rose.sim.traces import TraceError, load_trace

        names = POLICIES if policy.strip() == "all" else tuple(p.strip() for p in policy.split(",") if p.strip())
        bad = [p for p in names if p not in ALL_POLICIES]
        if bad or not names:
            fail(f"--policy: unknown {', '.join(bad) or policy!r} (known: {', '.join(ALL_POLICIES)}, all)")
        for flag, v, least in (("--gpus", gpus, 1), ("--dedicated", dedicated, 0), ("--seeds", seeds, 1),
                               ("--duration", duration, 0)):  # fmt: skip
            if v < least:
                fail(f"{flag} must be >= {least}, got {v}")
        if not 0 < load <= 1:
            fail(f"--load must be in (0, 1], got {load}")
        if decide_every < 0:
            fail(f"--decide-every must be >= 0, got {decide_every}")
        if workers not in (0, 1, 2):
            fail(f"--workers must be 0, 1 or 2, got {workers}")
        for flag, v in (("--lease-start-s", lease_start_s), ("--resume-s", resume_s),
                        ("--elastic-provision-s", elastic_provision_s), ("--cold-start-s", cold_start_s)):  # fmt: skip
            if v is not None and not v >= 0:
                fail(f"{flag} must be >= 0 seconds, got {v}")
        if warm_workers < 0:
            fail(f"--warm-workers must be >= 0, got {warm_workers}")
        if tp < 0 or rollout_tp < 0:
            fail(f"--tp and --rollout-tp must be >= 0, got {tp} and {rollout_tp}")
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
        given = [f for f, v in (("--interference-profile", interference_profile), ("--interference-bench",
                 interference_bench), ("--interference-alpha", interference_alpha)) if v is not None]  # fmt: skip
        if len(given) > 1:
            fail(f"{' and '.join(given)}: give at most one interference model")
        if interference_profile is not None:
            from rose.sim.interference import read_profile

            try:
                cal["interference"] = read_profile(interference_profile)
            except ValueError as e:
                fail(f"--interference-profile: {e}")
        if interference_alpha is not None:
            if not interference_alpha >= 0:
                fail(f"--interference-alpha must be >= 0, got {interference_alpha}")
            cal.update(alpha=interference_alpha, alpha_source="rose simulate --interference-alpha (sweep)")
        cfg = cli_config()
        try:
            sc = SimConfig(
                n_gpus=gpus,
                dedicated=dedicated,
                model=model_size,
                gpu=gpu,
                tp=tp,
                rollout_tp=rollout_tp,
                duration_s=duration,
                seed=seed,
                load=load,
                decide_every=decide_every,
                workers=workers,
                policies=names,
                policy=cfg.policy,
                replica_pool=configured_pool(cfg.policy),
                record_series=bool(report) or series,
                lease_start_s=lease_start_s,
                warm_workers=warm_workers,
                cold_start_s=cold_start_s,
                resume_s=RESUME_S if resume_s is None else resume_s,
                elastic_provision_s=ELASTIC_PROVISION_S if elastic_provision_s is None else elastic_provision_s,
                **cal,
            )
            result = simulate_seeds(tr, sc, seeds)
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
        ip = result["interference_profile"]
        typer.echo(f"interference ({ip['mechanism']}): {ip['source']}")
        typer.echo(
            f"{'policy':15s} {'episodes/h':>11s} {'RL steps/h':>10s} {'gain':>15s} {'SLO att.':>19s} "
            f"{'harvest':>7s} {'revokes':>7s} {'weights GB':>10s}"
        )
        for p, r in result["policies"].items():
            typer.echo(
                f"{p:15s} {r['episodes_per_hour']:11.1f} {r['rl_steps_per_hour']:10.2f} "
                f"{with_ci(r, 'gain_vs_static', 3):>15s} {with_ci(r, 'slo_attainment', 5):>19s} "
                f"{r['harvest_per_serving_gpu']:7.4f} {r['revokes']:7g} {r['weight_sync_bytes'] / 1e9:10.1f}"
            )
        fl = result["fleet"]
        typer.echo(
            f"gain ≈ 1 + (G/M) × harvest, G/M = {fl['serving_gpus']}/{fl['dedicated_gpus']}; harvest: rollout work on "
            "serving GPUs in dedicated-GPU equivalents per serving GPU"
        )
        if report is not None:
            typer.echo(f"report: {report / 'report.md'}")

    @app.command("paper-check")
    def paper_check(  # noqa: C901 - one exit-2 line per bad option, then the run
        traces: Path = typer.Option(None, "--traces", envvar="ROSE_TRACES", help="Folder of the shared traces."),
        gpus: int = typer.Option(64, "--gpus", help="Serving GPUs per run."),
        gm: int = typer.Option(8, "--gm", help="Serving GPUs per dedicated rollout GPU (G/M)."),
        duration: float = typer.Option(3600.0, "--duration", help="Seconds of trace time per run."),
        seeds: int = typer.Option(3, "--seeds", help="Seeds of every main run (mean and 95 % interval)."),
        gpu: str = typer.Option("H100", "--gpu", help="H100 | H200."),
        models: str = typer.Option(
            "8B,70B,70B@H200/tp4",
            "--models",
            help="Model cells SIZE\\[@GPU]\\[/tpN], comma list (e.g. 8B,70B@H200/tp4).",
        ),
        trace_names: str = typer.Option(
            "",
            "--trace-names",
            help="Trace files in --traces, comma list (default: Azure code, Azure conv, BurstGPT, Mooncake).",
        ),
        interference_profile: Path = typer.Option(
            None,
            "--interference-profile",
            help="The main runs' rose.interference_profile.v1 file; each mechanism it holds is swept "
            "(default: docs/measured/h200/interference-profile-8b-separate_process.json).",
        ),
        alphas: str = typer.Option(
            "0.1,0.3,1.0", "--alphas", help="Linear-model alphas swept beside the measured profiles (comma list)."
        ),
        gpu_alpha_bench: Path = typer.Option(
            None,
            "--gpu-alpha-bench",
            help="A GPU's interference.json (deploy/gpu-check.sh): its alpha fit is one labelled linear row of the "
            "profile sweep (default: docs/measured/h200/interference.json when present).",
        ),
        gm_sweep: str = typer.Option("1,2,4,8", "--gm-sweep", help="G/M values swept (comma list)."),
        caps: str = typer.Option("0.25,0.5,1.0", "--elastic-caps", help="Elastic cost caps swept, × M (comma list)."),
        provision: str = typer.Option(
            "60,180,600", "--elastic-provision", help="Elastic provisioning delays swept, s (comma list)."
        ),
        sweep_seeds: int = typer.Option(1, "--sweep-seeds", help="Seeds of every sweep run."),
        jobs: int = typer.Option(1, "--jobs", help="Worker processes."),
        out: Path = typer.Option(None, "--out", help="Write the generated markdown here (default: stdout)."),
        doc: Path = typer.Option(
            None, "--doc", help="Replace the generated block of this markdown file (docs/paper-check.md)."
        ),
        json_path: Path = typer.Option(None, "--json", help="Write every run and the targets as JSON here."),
        from_json: Path = typer.Option(
            None, "--from-json", help="Run nothing: write the tables again from a record --json wrote."
        ),
    ) -> None:
        """`rose simulate` on the public request traces beside the paper's claim: targets, sweeps, intervals."""
        import shlex
        import sys

        import orjson

        from rose.cli import cli_config, fail
        from rose.sim.paper_check import check, from_record, replace_block
        from rose.sim.paper_plan import TRACES, CheckConfig

        def floats(flag: str, text: str) -> tuple[float, ...]:
            try:
                return tuple(float(x) for x in text.split(",") if x.strip())
            except ValueError:
                fail(f"{flag}: expected a comma list of numbers, got {text!r}")

        folder = traces or Path(__file__).resolve().parents[2].parent / "shared" / "traces"
        names = tuple(n.strip() for n in trace_names.split(",") if n.strip()) or TRACES
        missing = [n for n in names if not (folder / n).is_file()]
        if missing or not names:
            fail(f"--traces: {', '.join(missing) or 'no trace'} not found in {folder}")
        if jobs < 1:
            fail(f"--jobs must be >= 1, got {jobs}")
        repo = Path(__file__).resolve().parents[2]
        bench = gpu_alpha_bench or repo / "docs" / "measured" / "h200" / "interference.json"
        gpu_alpha: dict = {}
        if gpu_alpha_bench is not None or bench.is_file():
            from rose.sim.engine import calibration

            try:
                raw = orjson.loads(bench.read_bytes())
                if raw.get("alpha_per_share") is None:
                    raise ValueError("no alpha_per_share: not a GPU's interference.json (deploy/gpu-check.sh)")
                cal = calibration({**raw, "_source": bench.name}, None)
            except (OSError, ValueError) as e:
                fail(f"--gpu-alpha-bench: {bench}: {e}")
            gpu_alpha = {
                "gpu_alpha": cal["alpha"],
                "gpu_alpha_source": f"{raw.get('gpu_name', 'a GPU')}, priority streams, "
                f"{bench.relative_to(repo) if bench.is_relative_to(repo) else bench}",
            }
        if interference_profile is not None:
            from rose.sim.interference import read_profile

            try:
                read_profile(interference_profile)
            except ValueError as e:
                fail(f"--interference-profile: {e}")
        try:
            cc = CheckConfig(
                **gpu_alpha,
                profile_file=str(interference_profile or ""),
                traces=names,
                models=tuple(m.strip() for m in models.split(",") if m.strip()),
                gpus=gpus,
                gm=gm,
                duration_s=duration,
                seeds=seeds,
                gpu=gpu,
                alphas=floats("--alphas", alphas),
                gm_sweep=tuple(int(x) for x in floats("--gm-sweep", gm_sweep)),
                elastic_caps=floats("--elastic-caps", caps),
                elastic_provision=floats("--elastic-provision", provision),
                sweep_seeds=sweep_seeds,
                policy=cli_config().policy,
            )
        except ValueError as e:
            fail(str(e))
        command = "rose " + " ".join(shlex.quote(a) for a in sys.argv[1:] if a)

        def progress(job, r) -> None:
            ro = r["policies"].get("rose")
            what = f"ROSE ×{ro['gain_vs_static']:.3f}, SLO {ro['slo_attainment']:.5f}" if ro else "elastic"
            value = job.value if isinstance(job.value, str) else f"{job.value:g}"
            typer.echo(
                f"{job.kind} {job.trace} {job.model} {value} seed {job.seed}: {what}, {r['wall_s']:.0f} s", err=True
            )

        try:
            if from_json is not None:
                md, record = from_record(orjson.loads(from_json.read_bytes())), None
            else:
                md, record = check(folder, cc, command, jobs, progress)
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as e:
            fail(f"--from-json: cannot read {from_json}: {e}")
        except ValueError as e:
            fail(str(e))
        if json_path is not None and record is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_bytes(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY))
        if doc is not None:
            try:
                doc.write_text(replace_block(doc.read_text(), md))
            except (OSError, ValueError) as e:
                fail(f"--doc: {doc}: {e}")
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(md)
        elif doc is None:
            typer.echo(md)
