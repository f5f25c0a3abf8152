"""What a demo run is asked for (DemoOptions) and what it sets up before anything starts: the
run's own topic and key prefixes, its config file, its children's environment and what each
child runs.

Every process gets the run's configuration in one piece: `Demo.cfg` (the caller's config with
the run's topic and key prefixes, job, model and guard settings) is written to a 0600 TOML
file in a private directory, and each child loads it through `ROSE_CONFIG`, nothing else (the
caller's own ROSE_* settings are already in it and are not passed on). The dedicated rollout
worker gets its `WorkerConfig` from `rose.rollout.launcher.launch`, off the command line.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from rose.config import Config, GiB, load_config
from rose.demo.processes import REPO
from rose.rollout.launcher import WorkerConfig

DEFAULT_TRACE = "azure_llm2023_conv.csv"
# set once every other process runs: the vLLM device then measures its capacity (CoserveSpec)
MEASURE_KEY = "demo:measure-capacity"
# the trace's peak rate is taken over bins of this (as recorded): a minute of the Azure conversation
# trace holds about 330 requests, so its peak is the trace's rate, not the noise of a 5-s count
PEAK_BIN_S = 60.0
# what load_config reads from the environment: the children get none of it but ROSE_CONFIG
_CONFIG_VARS = ("ROSE_CONFIG", "ROSE_KAFKA_BOOTSTRAP", "ROSE_REDIS_URL")


class DemoError(RuntimeError):
    """The demo cannot run; the message says why."""


@dataclass(frozen=True)
class DemoOptions:
    duration_s: float = 180.0
    report_dir: str = "reports/demo"
    gpus: int = 3
    trace: str | None = None
    speed: float = 0.5  # trace arrival rate × this (0.5: the trace's load over 3 GPUs at half rate)
    # real/0 replays the trace at its recorded rate as one of this many replicas (CoserveSpec.replicas)
    real_replicas: int = 1
    # leases off / on windows of about this length (rose.demo.windows.plan): 4 lease TTLs
    # (policy.ttl_s, 5 s), so that the leases of an on window lapse within the first quarter of the
    # off window after it
    window_s: float = 20.0
    drain_s: float = 15.0  # after the run, wait at most this long for the episodes it started to finish
    max_batch: int = 4  # KV slots (concurrent episodes) per rollout worker
    keep: bool = False  # keep the run's topics and Redis keys
    live: bool | None = None  # None: rich view on a terminal, progress lines otherwise
    startup_timeout_s: float = 240.0
    line_every_s: float = 5.0
    # the rollout engine: "reference" (the toy byte-level policy and task) or "vllm" / "hf" on
    # the Hugging Face checkpoint `model` (one-digit addition, rose.rollout.addition_task)
    engine: str = "reference"
    model: str = ""
    max_model_len: int = 512
    tokens_per_turn: int = 14  # engine != reference: answer tokens per episode


def default_trace() -> Path:
    base = Path(os.environ.get("ROSE_TRACES", REPO.parent / "shared" / "traces"))
    return base / DEFAULT_TRACE


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


class DemoSetup:
    """A demo run's options, configuration and devices, and what its children get."""

    def __init__(self, cfg: Config, opts: DemoOptions, echo: Callable[[str], None] = print):
        from rose.executor.guard import default_latency_dir
        from rose.sim.interference import DEFAULT_PROFILE_PATH, default_profile

        self.opts, self.echo = opts, echo
        self.run_id = uuid.uuid4().hex[:8]
        self.trace = str(Path(opts.trace) if opts.trace else default_trace())
        self.job, self.model = "demo", "policy"
        self.latency_dir = default_latency_dir() / f"demo-{self.run_id}"
        # the trace-driven GPUs slow down under a lease by the simulator's default interference
        # profile (rose.sim.interference). The scheduler gets no prior: the run's devices differ
        # (that profile on sim/*, a CPU core with SCHED_IDLE workers on real/0), so it goes by
        # its online estimate per GPU alone
        prof = default_profile()
        self.interference = {"profile": str(DEFAULT_PROFILE_PATH), "mechanism": prof.mechanism, "source": prof.source}
        self.cfg = dataclasses.replace(
            cfg,
            telemetry=dataclasses.replace(cfg.telemetry, interference_profile=str(DEFAULT_PROFILE_PATH)),
            kafka=dataclasses.replace(
                cfg.kafka, topic_prefix=f"{cfg.kafka.topic_prefix}demo-{self.run_id}.", partitions=4
            ),
            redis=dataclasses.replace(cfg.redis, key_prefix=f"{cfg.redis.key_prefix}demo-{self.run_id}:"),
            executor=dataclasses.replace(
                cfg.executor,
                job=self.job,
                model=self.model,
                worker_weights="follow",
                latency_dir=str(self.latency_dir),
                guard_period_s=0.002,
            ),
        )
        if opts.engine != "reference":
            self.cfg = dataclasses.replace(
                self.cfg,
                rollout=dataclasses.replace(
                    self.cfg.rollout,
                    engine=opts.engine,
                    model=str(Path(opts.model).resolve()),
                    dtype="native",  # float32 on CPUs without bf16 arithmetic (rose bench decode)
                    max_model_len=opts.max_model_len,
                    threads=1,
                ),
            )
        self.config_dir: str | None = None  # holds the run's config file (secrets: 0700 / 0600)
        self.real_gpu = "real/0"
        self.cuda = _cuda()
        self.real_device = "cuda:0" if self.cuda else "cpu"
        self.report_dir = Path(opts.report_dir)
        # On CPU the co-served "device" is one core: the serving model and its leased rollout worker
        # run there, every other process of the demo on the remaining cores.
        cpus = sorted(os.sched_getaffinity(0))
        self.device_cpus: set[int] | None
        self.host_cpus: set[int] | None
        if not self.cuda and len(cpus) >= 2:
            self.device_cpus, self.host_cpus = {cpus[-1]}, set(cpus[:-1])
        else:
            self.device_cpus = self.host_cpus = None
        self.problems: list[str] = []
        self.timeline: dict = {}

    # ---- set-up ------------------------------------------------------------------------------
    def _write_config(self) -> str:
        """The run's config as a TOML file only this user can read; its path."""
        self.config_dir = tempfile.mkdtemp(prefix=f"rose-demo-{self.run_id}-")
        path = os.path.join(self.config_dir, "config.toml")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(config_toml(self.cfg))
        if load_config(path, env={}) != self.cfg:
            raise DemoError("the run's config does not survive its TOML file (a value TOML cannot hold?)")
        return path

    def _env(self) -> dict:
        env = {
            k: v for k, v in os.environ.items() if k not in _CONFIG_VARS and not (k.startswith("ROSE_") and "__" in k)
        }
        env.update(
            {
                "ROSE_CONFIG": self._write_config(),
                "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])),
            }
        )
        return env

    def _argv(self) -> dict[str, list[str] | WorkerConfig]:
        from rose.demo.coserve_device import CoserveSpec

        py, o = sys.executable, self.opts
        worker = ["--max-batch", str(o.max_batch)]
        sims = ",".join(f"sim/{i}" for i in range(o.gpus))
        return {
            "coserve": [
                py,
                "-m",
                "rose.demo.coserve",
                "--spec",
                CoserveSpec(
                    trace=self.trace,
                    gpu=self.real_gpu,
                    speed=1.0,
                    replicas=o.real_replicas,
                    device=self.real_device,
                    latency_dir=str(self.latency_dir),
                    **self._coserve_server(),
                ).to_json(),
            ],
            "agent": [
                py,
                "-m",
                "rose",
                "agent",
                "--simulate",
                self.trace,
                "--gpus",
                str(o.gpus),
                "--speed",
                str(o.speed),
            ],
            "trainer": [
                py,
                "-m",
                "rose.demo.trainer",
                "--spec",
                self._trainer_spec().to_json(),
            ],
            "dedicated": WorkerConfig.from_config(
                self.cfg,
                gpu="rollout/0",
                worker_id=f"dedicated-{self.run_id}",
                device="cpu",
                mem_bytes=2 * GiB,
                compute_share=0.5,
                dedicated=True,
                nice=0,
                seed=11,
                weights="follow",
                max_batch=o.max_batch,
            ),
            "executor-sim": [py, "-m", "rose.demo.executor_node", "--gpus", sims, "--no-guard", *worker],
            "executor-real": [
                py,
                "-m",
                "rose.demo.executor_node",
                "--gpus",
                self.real_gpu,
                "--device",
                self.real_device,
                *worker,
                "--worker-cpus",
                ",".join(map(str, sorted(self.device_cpus or ()))),
                # on the device's core a leased worker takes only the time serving leaves idle
                *(["--worker-sched-idle"] if self.device_cpus else []),
            ],
            "scheduler": [py, "-m", "rose", "scheduler", "--instance", f"demo-{self.run_id}"],
        }

    def _coserve_server(self) -> dict:
        """The measured device's engine: vLLM's OpenAI server on the run's checkpoint when the
        rollout runs vLLM, with the trace thinned to its measured capacity so the trace's peak is
        what the pool decision provisions for (1 / (1 + headroom) of capacity); else the small
        torch model."""
        from rose.config import PoolConfig

        o = self.opts
        if o.engine != "vllm":
            return {}
        pool = self.cfg.policy.pools.get(self.cfg.telemetry.pool, PoolConfig())
        return {
            "server": "vllm",
            "peak_fraction": round(1.0 / (1.0 + pool.headroom), 6),
            "peak_bin_s": PEAK_BIN_S,
            # not compressed: the off and on windows compare like with like only under a load that
            # keeps its level over the run (docs/demo.md "Load scaled to the measured capacity")
            "replay_s": 0.0,
            "measure_when_key": MEASURE_KEY,
            "model": self.cfg.rollout.model,
            "client_cpus": tuple(sorted(self.host_cpus or ())),
            "max_model_len": o.max_model_len,
            "startup_timeout_s": o.startup_timeout_s,
            "server_log": str((self.report_dir / "logs").resolve()),
        }

    def _trainer_spec(self):
        from rose.demo.trainer import TrainerSpec

        o = self.opts
        if o.engine == "reference":
            return TrainerSpec(job=self.job, model=self.model, inflight=max(24, 4 * o.max_batch * (o.gpus + 2)))
        # a real checkpoint on CPU: a few groups in flight per worker, a step every few seconds at most
        return TrainerSpec(
            job=self.job,
            model=self.model,
            engine=o.engine,
            checkpoint=self.cfg.rollout.model,
            lr=1e-4,
            inflight=32,  # four groups of 8
            tokens_per_turn=o.tokens_per_turn,
            max_turns=1,
            obs_tokens=0,
            min_step_s=2.0,
            group=8,
            groups_per_step=2,
            train_layers=1,
        )


def config_toml(cfg: Config) -> str:
    """`cfg` as a TOML document that `load_config` reads back to an equal Config."""
    lines: list[str] = []
    tables: list[tuple[str, Mapping]] = []
    for section in dataclasses.fields(cfg):
        part = getattr(cfg, section.name)
        lines.append(f"[{section.name}]")
        for f in dataclasses.fields(part):
            v = getattr(part, f.name)
            if isinstance(v, Mapping):
                tables.append((f"{section.name}.{f.name}", v))
            else:
                lines.append(f"{f.name} = {_toml_value(v)}")
    for name, table in tables:
        lines.append(f"[{name}]")
        lines += [f"{_toml_value(str(k))} = {_toml_value(str(v))}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)  # 0.5, 1e-05, inf: all TOML floats
    if isinstance(v, tuple | list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    body = "".join(
        {'"': '\\"', "\\": "\\\\"}.get(ch, ch) if ord(ch) >= 0x20 and ord(ch) != 0x7F else f"\\u{ord(ch):04x}"
        for ch in str(v)
    )
    return f'"{body}"'
