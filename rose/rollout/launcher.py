"""Starting rollout workers: the worker's one typed configuration and the launcher that hands
it over, plus the child-process set-up every ROSE supervisor uses.

`WorkerConfig` is everything a worker process needs: its lease (GPU, memory cap, compute
share, pause flag), device, job and model, the `RedisConfig` it connects with, and the one
secret it needs, `weights_hmac_key` (the command key stays with the executor). The worker
builds its Redis client, task queue and weight follower from this object alone.

`launch(config)` starts `python -m rose.rollout.worker_process --config-fd N`: the config travels as
JSON in an anonymous in-memory file (memfd; an unlinked 0600 temporary file where memfd is
missing) passed as descriptor N, which the worker reads once and closes. Neither the HMAC key
nor a Redis password ever appears on the command line (`ps`, /proc/<pid>/cmdline) or in the
environment. By hand: `python -m rose.rollout.worker_process < worker.json` (the default fd is stdin).

A warm worker (`warm=True`, the executor's pool) is launched the same way before any lease: it
gets its lease later, still without argv, as a `LeaseRecord` file next to its pause flag.

`spawn(argv)` is the shared way to start a supervised child: PR_SET_PDEATHSIG=SIGTERM, so
the child drains and exits when its parent dies, optionally pinned to a set of CPUs and set to
a niceness, and optionally SCHED_IDLE, before exec (every thread the child ever starts inherits
all three). `launch` starts every worker, cold or warm, at its config's `nice` (the executor's
`worker_nice`) and `sched_idle` (`worker_sched_idle`), so that even its imports and model build
yield the CPU to serving.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rose.config import Config, GiB, RedisConfig, TracingConfig

WORKER_MODULE = "rose.rollout.worker_process"
# the worker's exit codes, which its supervisor reads (docs/rollout.md)
EXIT_BAD_CONFIG = 2
EXIT_BUDGET = 3
EXIT_UNAVAILABLE = 4  # redis.cluster_nodes set, and that Redis Cluster not usable at start
EXIT_DEVICE_CHECK = 5  # the lease refused: the GEMM check failed, or MPS is meant and not attached
MAX_CONFIG_BYTES = 1 << 20
_PR_SET_PDEATHSIG = 1


ENGINES = ("reference", "vllm", "hf")


@dataclass(frozen=True)
class WorkerConfig:
    gpu: str
    worker_id: str
    redis: RedisConfig
    job: str
    model: str  # weights stream name (rose:weights:{model})
    weights_hmac_key: str = field(default="", repr=False)  # "" = followed weights are not verified
    device: str = "cpu"  # "cpu" or "cuda:N"
    mem_bytes: int = GiB  # hard cap of everything the worker allocates
    compute_share: float = 1.0
    pause_flag: str = ""  # shared-memory name of the PauseFlag; "" = none
    dedicated: bool = False
    nice: int = 10
    sched_idle: bool = False  # run under SCHED_IDLE too (the executor's worker_sched_idle; set before exec)
    cpus: tuple[int, ...] = ()  # CPUs the launcher pins the process to before exec; () = any
    seed: int = 0
    max_batch: int = 32  # KV-cache slots at most (the budget may allow fewer)
    min_idle_ms: int = 30_000  # reclaim other consumers' tasks idle this long
    reclaim_every_ms: int = 1_000
    affinity_grace_ms: int = 500
    long_tail_tokens: int = 192
    straggler_frac: float = 0.8
    weights: str = "static"  # "static" (seeded policy) | "follow" (rose.weights follower)
    model_spec: dict = field(default_factory=dict)  # ModelSpec overrides
    max_episodes: int = 0  # exit 0 after completing this many (0: run until STOP)
    temperature: float = 1.0
    max_staleness: int = 1  # take tasks only with a policy at most this many versions behind the newest
    # A warm worker (the executor's pool): started, paused and without a lease. It builds its
    # model and follows the weights, then waits for the `LeaseRecord` the executor writes to
    # `lease_file` (announced by the pause flag's assignment counter) and runs that lease.
    warm: bool = False
    lease_file: str = ""
    # the engine (rose.rollout.engines, docs/engines.md): "reference" (the toy) | "vllm" | "hf",
    # on the Hugging Face checkpoint directory `checkpoint`
    engine: str = "reference"
    checkpoint: str = ""
    python: str = ""  # interpreter to run the worker with; "" = the launcher's own
    dtype: str = "float32"
    max_model_len: int = 2048
    kv_cache_bytes: int = GiB
    threads: int = 1
    step_tokens: int = 0  # tokens one engine step may batch; 0 = the engine's default
    verify_weights: bool = False  # check each applied version bit-exact (engine.weights_match)
    # the worker's spans (`process {stream}` per task carrying trace context): its exporter, and
    # the lease it runs in: the id and the W3C traceparent of the grant command that decided it
    # (each span links to that context; "" for a dedicated worker, which has no lease)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    lease_id: str = ""
    lease_traceparent: str = ""

    @classmethod
    def from_config(cls, cfg: Config, **fields) -> WorkerConfig:
        """A worker of this deployment: `cfg`'s Redis connection, weights key, job and model,
        then `fields`."""
        base = {
            "redis": cfg.redis,
            "weights_hmac_key": cfg.security.weights_hmac_key,
            "job": cfg.executor.job,
            "model": cfg.executor.model,
            "engine": cfg.rollout.engine,
            "checkpoint": cfg.rollout.model,
            "python": cfg.rollout.python,
            "dtype": cfg.rollout.dtype,
            "max_model_len": cfg.rollout.max_model_len,
            "kv_cache_bytes": cfg.rollout.kv_cache_bytes,
            "threads": cfg.rollout.threads,
            "step_tokens": cfg.rollout.step_tokens,
            "verify_weights": bool(cfg.rollout.verify_weights),
            "tracing": cfg.tracing,
        }
        return cls(**{**base, **fields})

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerConfig:
        """Parse and check; ValueError names the field."""
        c = cls(**_typed_fields(cls, _json_object(text, "worker config")))
        if c.warm:
            if not c.pause_flag or not c.lease_file:
                raise ValueError("warm: a warm worker needs pause_flag and lease_file")
        elif c.mem_bytes <= 0:
            raise ValueError(f"mem_bytes: must be > 0, got {c.mem_bytes}")
        if not 0 <= c.compute_share <= 1:  # 0: a lease paused at share 0 (v1.1) restarts its worker paused
            raise ValueError(f"compute_share: must be in [0, 1], got {c.compute_share}")
        if c.max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {c.max_staleness}")
        if not (c.device == "cpu" or c.device.startswith("cuda")):
            raise ValueError(f"device: expected 'cpu' or 'cuda:N', got {c.device!r}")
        if c.weights not in ("static", "follow"):
            raise ValueError(f"weights: expected 'static' or 'follow', got {c.weights!r}")
        if c.max_batch < 1:
            raise ValueError("max_batch: must be >= 1")
        if c.engine not in ENGINES:
            raise ValueError(f"engine: expected one of {', '.join(ENGINES)}, got {c.engine!r}")
        if c.engine != "reference" and not c.checkpoint:
            raise ValueError(
                f"checkpoint: engine {c.engine!r} needs a Hugging Face checkpoint directory (rollout.model)"
            )
        return c

    def can_run_as(self, other: WorkerConfig) -> bool:
        """Whether this (warm) worker can take the lease of `other`: equal in everything but the
        fields a `LeaseRecord` sets and those fixed at its own start (flag, seed, warm set-up)."""
        own = dataclasses.replace(self, **_PER_WORKER_DEFAULTS)
        return own == dataclasses.replace(other, **_PER_WORKER_DEFAULTS)


# what a LeaseRecord sets, and what each process has of its own: ignored by `can_run_as`
_PER_WORKER_DEFAULTS: dict[str, Any] = {
    "gpu": "",
    "worker_id": "",
    "mem_bytes": 0,
    "compute_share": 0.0,
    "pause_flag": "",
    "seed": 0,
    "warm": False,
    "lease_file": "",
    "lease_id": "",
    "lease_traceparent": "",
}


@dataclass(frozen=True)
class LeaseRecord:
    """A warm worker's lease, handed over without a command line: the executor writes it next
    to the worker's pause flag (`write`, an atomic rename, 0600), then bumps the flag's
    assignment counter; the worker, which polls the counter, reads it (`read`) and checks that
    `assignment` matches, so it never acts on an older record."""

    assignment: int
    gpu: str
    worker_id: str
    lease_id: str
    epoch: int
    mem_bytes: int
    compute_share: float
    lease_traceparent: str = ""  # the grant command's trace context (WorkerConfig.lease_traceparent)

    def write(self, path: str) -> None:
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, json.dumps(dataclasses.asdict(self), separators=(",", ":")).encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: str) -> LeaseRecord:
        """The record in `path`; OSError if it cannot be read, ValueError (naming the field) if
        it is not a valid record."""
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
        r = cls(**_typed_fields(cls, _json_object(data, "lease record")))
        if r.mem_bytes <= 0:
            raise ValueError(f"mem_bytes: must be > 0, got {r.mem_bytes}")
        if not 0 <= r.compute_share <= 1:
            raise ValueError(f"compute_share: must be in [0, 1], got {r.compute_share}")
        return r

    def apply(self, config: WorkerConfig) -> WorkerConfig:
        """The warm worker's config turned into this lease's worker."""
        return dataclasses.replace(
            config,
            gpu=self.gpu,
            worker_id=self.worker_id,
            mem_bytes=self.mem_bytes,
            compute_share=self.compute_share,
            lease_id=self.lease_id,
            lease_traceparent=self.lease_traceparent,
            warm=False,
        )


_SCALARS: dict[str, type | tuple[type, ...]] = {
    "str": str,
    "int": int,
    "float": (int, float),
    "bool": bool,
    "dict": dict,
}


_NESTED: dict[str, type] = {"RedisConfig": RedisConfig, "TracingConfig": TracingConfig}


def _json_object(text: str | bytes, what: str) -> dict:
    """The JSON object in `text`; ValueError naming `what` otherwise."""
    try:
        d = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{what}: not valid JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{what}: expected a JSON object")
    return d


def _typed_fields(cls, d: dict, where: str = "") -> dict:
    """`d`'s values checked against `cls`'s field types (str, int, float, bool, dict,
    tuple[int, ...], a nested RedisConfig or TracingConfig); unknown and missing fields refused."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    for k in d:
        if k not in known:
            raise ValueError(f"{where}{k}: unknown {cls.__name__} field")
    out: dict[str, Any] = {}
    for f in known.values():
        name = where + f.name
        if f.name not in d:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{name}: missing required field")
            continue
        v = d[f.name]
        if f.type in _NESTED:
            if not isinstance(v, dict):
                raise ValueError(f"{name}: expected an object, got {v!r}")
            out[f.name] = _NESTED[f.type](**_typed_fields(_NESTED[f.type], v, name + "."))
        elif f.type == "tuple[int, ...]":
            if not isinstance(v, list) or any(not isinstance(x, int) or isinstance(x, bool) for x in v):
                raise ValueError(f"{name}: expected a list of integers, got {v!r}")
            out[f.name] = tuple(v)
        else:
            # a string here: both modules annotate with `from __future__ import annotations`
            want = _SCALARS.get(f.type, object) if isinstance(f.type, str) else object
            if not isinstance(v, want) or (f.type in ("int", "float") and isinstance(v, bool)):
                raise ValueError(f"{name}: expected {f.type}, got {v!r}")
            out[f.name] = v
    return out


# ---- child processes -----------------------------------------------------------------------
def apply_nice(nice: int) -> None:
    """Run this process at niceness `nice` (absolute, so applying it twice is harmless); never
    raises its priority above what it has, which would need CAP_SYS_NICE."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if nice > current:
        os.setpriority(os.PRIO_PROCESS, 0, nice)


def apply_sched_idle(pid: int = 0) -> int:
    """Put every thread of process `pid` (0: this one) under SCHED_IDLE, keeping its niceness;
    threads it starts later inherit the policy. Any process may enter SCHED_IDLE. How many
    threads were set (a thread that ended meanwhile is skipped)."""
    n = 0
    for tid in threads(pid or os.getpid()):
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            n += 1
        except ProcessLookupError:
            pass
    return n


def threads(pid: int) -> list[int]:
    """The thread ids of process `pid` (just `pid` where /proc is not there to list them)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (FileNotFoundError, NotADirectoryError, PermissionError, ValueError):
        return [pid]


def die_with_parent(cpus: Sequence[int] = (), nice: int = 0, sched_idle: bool = False) -> Callable[[], None]:
    """A `preexec_fn`: SIGTERM the child when its parent dies (PR_SET_PDEATHSIG), pin it to
    `cpus` (empty: any), set its niceness to `nice` (`apply_nice`) and, with `sched_idle`, its
    scheduling policy to SCHED_IDLE before it execs."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork; the child only calls it
    cpu_set = set(cpus)

    def setup() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if cpu_set:
            os.sched_setaffinity(0, cpu_set)
        if nice:
            apply_nice(nice)
        if sched_idle:  # after the niceness, which SCHED_IDLE keeps (/proc/stat counts it as nice time)
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))

    return setup


def spawn(
    argv: Sequence[str], *, cpus: Sequence[int] = (), nice: int = 0, sched_idle: bool = False, **popen
) -> subprocess.Popen:
    """`subprocess.Popen(argv, **popen)` for a supervised child (see `die_with_parent`)."""
    return subprocess.Popen(list(argv), preexec_fn=die_with_parent(cpus, nice, sched_idle), **popen)


def _config_file(data: bytes) -> int:
    """A descriptor of an anonymous file holding `data`, positioned at its start."""
    try:
        fd = os.memfd_create("rose-worker-config")
    except (AttributeError, OSError):  # no memfd: an unlinked temporary file, 0600
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    ok = False
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
        ok = True
    finally:
        if not ok:
            os.close(fd)
    return fd


# A worker writes its log lines to the stderr it shares with its executor; a progress bar
# (tqdm's, transformers' and vLLM's weight loading) writes partial lines there, which a line
# of the executor's can land inside, so that neither reads as a line any more.
NO_PROGRESS_BARS = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def launch(config: WorkerConfig, **popen) -> subprocess.Popen:
    """Start a rollout worker for `config` (see the module docstring); `popen` as for Popen
    (stdin, stdout, stderr, env, start_new_session, ...), its environment without progress bars."""
    fd = _config_file(config.to_json().encode())
    env = {**(popen.pop("env", None) or os.environ), **NO_PROGRESS_BARS}
    try:
        return spawn(
            [config.python or sys.executable, "-m", WORKER_MODULE, "--config-fd", str(fd)],
            cpus=config.cpus,
            nice=config.nice,  # cold or warm: imports and the model build already yield to serving
            sched_idle=config.sched_idle,
            pass_fds=(fd,),
            env=env,
            **popen,
        )
    finally:
        os.close(fd)


def read_config(fd: int = 0) -> WorkerConfig:
    """The worker's side: read its config from descriptor `fd` (and close it); ValueError if
    it is unreadable or invalid."""
    try:
        with os.fdopen(fd, "rb", closefd=fd != 0) as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ValueError(f"worker config: cannot read descriptor {fd} ({e.strerror})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"worker config: larger than {MAX_CONFIG_BYTES} bytes")
    return WorkerConfig.from_json(data)
