"""One configuration object: defaults, then a TOML file, then ROSE_* environment variables.

Sections map to frozen dataclasses. Any key in `[kafka.librdkafka]` is passed to
librdkafka untouched (security.protocol, sasl.*, ssl.*, ...), so ROSE joins an existing,
secured cluster without code changes. Environment variables override the file:
`ROSE_KAFKA_BOOTSTRAP`, `ROSE_REDIS_URL` (the contract's two), and generally
`ROSE_<SECTION>__<FIELD>` (e.g. `ROSE_POLICY__TTL_S=8`); `ROSE_LIBRDKAFKA__<NAME>` adds a
librdkafka property with dots written as underscores (`ROSE_LIBRDKAFKA__SASL_MECHANISM`;
`ROSE_LIBRDKAFKA__LOG_LEVEL` is librdkafka's `log_level`).
Secrets (passwords, HMAC keys) may be given as `*_file` paths and are never logged.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from rose.config_checks import ConfigError, check_sections

GiB = 1 << 30


@dataclass(frozen=True)
class KafkaConfig:
    bootstrap: str = "127.0.0.1:9092"
    topic_prefix: str = "rose."
    partitions: int = 8
    replication: int = 1
    # the topics' min.insync.replicas (0 = the broker's default): with acks=all a write needs this
    # many in-sync replicas; 2 with replication 3 on the three-node cluster (`rose stack up --brokers 3`)
    min_insync_replicas: int = 0
    librdkafka: Mapping[str, str] = field(default_factory=dict)

    def topic(self, name: str) -> str:
        """Full topic name for a contract name such as 'telemetry' or 'lease-state'."""
        return f"{self.topic_prefix}{name}"

    @property
    def telemetry_topic(self) -> str:
        return self.topic("telemetry")

    @property
    def commands_topic(self) -> str:
        return self.topic("commands")

    @property
    def lease_state_topic(self) -> str:
        return self.topic("lease-state")

    @property
    def dlq_topic(self) -> str:
        return self.topic("dlq")

    @property
    def pool_samples_topic(self) -> str:
        """The GPU stage's samples of pools with replica leases, key = pool."""
        return self.topic("pool-samples")

    @property
    def pool_intents_topic(self) -> str:
        """The pool stage's intents, key = gpu, co-partitioned with telemetry."""
        return self.topic("pool-intents")


@dataclass(frozen=True)
class RedisConfig:
    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "rose:"
    # Redis Cluster: comma-separated `host:port` startup nodes ("" = the single Redis at `url`);
    # the url's scheme (rediss = TLS), user and password apply to every node, its host does not
    cluster_nodes: str = ""
    # weights only: 0 = one stream per model (docs/contract.md §6.1); N > 0 = each model's
    # shards spread over N shard streams, hash-tagged onto different cluster slots, and a
    # version made visible by one commit entry (docs/weights.md, "Redis Cluster")
    shard_streams: int = 0
    # weights only: a publisher's writes count once this many replicas hold them (WAIT on each
    # shard stream's node before the commit entry, then on the commit's; on a cluster, with
    # shard_streams > 0); 0 = no WAIT (a single Redis without replicas). A WAIT short of it
    # after wait_timeout_ms fails the publish (docs/weights.md, "Failover and WAIT")
    wait_replicas: int = 0
    wait_timeout_ms: int = 1000

    def key(self, *parts: str) -> str:
        return self.key_prefix + ":".join(parts)

    @property
    def safe_url(self) -> str:
        """The URL with its password replaced, for logs and error messages."""
        return _redact_url(self.url)


@dataclass(frozen=True)
class PoolConfig:
    """One pool's settings (`policy.pools.<pool>`; a pool named there lends whole replicas by
    replica leases, docs/policy.md "Pool decisions"). The reclaim horizon is the time from the
    load rising to a lent replica serving again; each term's source is in docs/policy.md."""

    # requests/s one replica serves within its SLO; 0: estimated from the pool's own telemetry
    # (the highest rps a serving replica showed with the grant headroom on every SLO metric)
    replica_capacity_rps: float = 0.0
    headroom: float = 0.30  # as PolicyConfig.grant_headroom: the kept capacity is forecast × (1 + this)
    decision_latency_s: float = 1.0  # telemetry period 0.5 s + the scheduler's batch and transaction
    stop_rollout_s: float = 2.0  # executor.revoke_deadline_s: rollout is gone (or killed) by then
    wake_s: float = 0.4  # vLLM level-1 wake: 0.1 s + 16 GB (8B, bf16) / 55.3 GB/s host->device
    readmit_s: float = 1.0  # health check and router add; CPU's whole reclaim p99 0.56 s (docs/policy.md)
    forecast: str = "peak"  # one of FORECASTS (docs/policy.md: the traces' evidence)
    window_s: float = 300.0  # the forecast's look-back; never shorter than the horizon
    bin_s: float = 5.0  # load is summed over replicas per bin of this length

    @property
    def horizon_s(self) -> float:
        return self.decision_latency_s + self.stop_rollout_s + self.wake_s + self.readmit_s


@dataclass(frozen=True)
class PolicyConfig:
    """Thresholds of the lease policy (docs/contract.md §4 defaults)."""

    grant_headroom: float = 0.30  # every SLO metric: p99 <= (1 - this) * SLO to grant
    grant_streak: int = 3  # ... for this many consecutive telemetry events of the GPU
    revoke_headroom: float = 0.10  # any metric below this headroom revokes at once
    mem_margin_frac: float = 0.10  # safety margin of total memory never lent
    min_lease_bytes: int = 2 * GiB
    lease_granularity_bytes: int = 64 << 20  # lease sizes are rounded down to this (allocator-friendly)
    ttl_s: float = 5.0
    renew_before_s: float = 2.5  # renew a lease once it has less than this left
    cooldown_s: float = 10.0
    cooldown_backoff: float = 2.0  # cooldown multiplies by this on each revoke in a row
    cooldown_max_s: float = 300.0
    cooldown_reset_s: float = 120.0  # a lease that lived this long resets the backoff
    # a grant leaves serving room to grow back to its recent memory peak, held this long after
    # serving last reached it; as cooldown_reset_s: the life at which a lease counts as one that held
    kv_peak_hold_s: float = 120.0
    max_compute_share: float = 0.5
    trend_horizon_s: float = 0.5  # predict p99 this far ahead (one sampling period)
    kv_growth_revoke_frac: float = 0.5  # serving memory growth eating this much of the margin per period revokes
    max_ts_skew_s: float = 300.0  # event ts vs Kafka record ts beyond this goes to the dlq
    # v1.1, two levels: latency pauses (throttle to share 0), memory revokes
    max_pause_s: float = 60.0  # a lease paused this long is revoked (its memory serves nobody)
    # serving's p99 slowdown per unit of rollout compute share, before this GPU has shown its
    # own: 1.0 is pessimistic on purpose (two equal-priority streams sharing SMs slow each
    # other about 1 + share); the online estimate replaces it after the first leased events
    interference_prior: float = 1.0
    interference_weight: float = 0.1  # EWMA weight of each new observation (base load and slowdown)
    # v1.1 gang leases: GPUs per lease, the rollout model's tensor-parallel degree. Above 1 a lease
    # spans that many GPUs of one node, granted all or none (docs/policy.md "Gang leases")
    group_size: int = 1
    # the interference profile's prior (docs/contract.md §6, rose.interference_profile.v1): the
    # (share, serving p99 ratio) points of the mechanism in use. A share whose predicted p99
    # (current p99 × the ratio at that share) would leave less than grant_headroom is never
    # granted. In TOML or the environment: a profile file's path, or an array of [share, ratio]
    # pairs. Empty: no prior (the online estimate alone)
    interference_profile: tuple[tuple[float, float], ...] = ()
    # the pools whose replicas replica leases may lend, by pool name: `[policy.pools.<pool>]`
    # tables in TOML (docs/scheduler.md "Pool decisions and partitioning"). Empty: none
    pools: Mapping[str, PoolConfig] = field(default_factory=dict)


@dataclass(frozen=True)
class TelemetryConfig:
    period_s: float = 0.5
    pool: str = "serving"
    slo_ttft_ms: float = 1000.0  # serving SLO of every GPU this agent reports (p99)
    slo_tpot_ms: float = 100.0
    engine: str = "auto"  # metric names of the serving engine: vllm | sglang | auto (either)
    metrics: Mapping[str, str] = field(default_factory=dict)  # role -> "name,name" overrides (see rose.prometheus)
    buffer_max: int = 100_000  # events kept while Kafka is unreachable (oldest dropped beyond)
    linger_ms: int = 5  # producer batching delay: low latency, still batches a fleet's period
    model_size: str = "7B"  # simulated serving (rose.serving_model presets)
    gpu_type: str = "H100"
    interference_alpha: float = 1.0  # serving slowdown per unit of rollout compute share
    # a rose.interference_profile.v1 file whose mechanism in use slows the simulated GPUs under a
    # lease ("" = the linear model of interference_alpha); rose.sim.interference validates it
    interference_profile: str = ""


@dataclass(frozen=True)
class TracingConfig:
    exporter: str = "none"  # none | console | otlp | memory
    otlp_endpoint: str = "http://127.0.0.1:4318/v1/traces"
    service_name: str = "rose"
    # the scheduler traces and logs one renew in N (chosen by command id, so a replay of the
    # same log picks the same ones); grants, throttles and revokes always. Renews are most of
    # the commands, and a span costs more than the decision behind it. 1: every renew
    renew_sample_every: int = 10


@dataclass(frozen=True)
class SecurityConfig:
    command_hmac_key: str = ""  # when set, commands are signed and executors refuse unsigned ones
    weights_hmac_key: str = ""


@dataclass(frozen=True)
class ExecutorConfig:
    """The executor on each serving node (`rose executor`)."""

    revoke_deadline_s: float = 2.0  # PAUSE+STOP at revoke; SIGKILL if the worker has not exited by then
    restart_backoff_s: float = 1.0  # a worker that died inside a lease is restarted after this
    tick_s: float = 0.005  # main loop period: expiry, kill deadlines, worker exits
    lookback_s: float = 30.0  # first start (no committed offset): read commands from this far back
    # the most this host's wall clock may differ from the scheduler's (docs/contract.md §5.1): a
    # command's transit age is this clock less the record's timestamp, so a lease may outlive its
    # `expires_at` here by up to this, or end that much early. Below policy.renew_before_s, else
    # a renewal could always arrive after the lease ended here
    max_clock_skew_s: float = 2.0
    latency_dir: str = ""  # the local guard's latency files; "" = /dev/shm/rose-latency
    guard_period_s: float = 0.0005  # the local guard's poll period; 0 turns the guard off
    worker_nice: int = 19  # OS priority of rollout workers on a serving node (CPU protection)
    # run rollout workers under SCHED_IDLE as well: a SCHED_IDLE thread gets the CPU only when
    # nothing else on its core wants it (Linux CFS weight 3 against 1024 for a nice-0 thread, and
    # a waking nice-0 thread preempts it; nice 19 alone still has weight 15). A stopping worker
    # gets SCHED_OTHER back, so it drains and exits within the revoke deadline (docs/executor.md)
    worker_sched_idle: bool = False
    job: str = "default"  # the rollout job whose task queue workers serve
    model: str = "reference"  # the rollout policy the workers load
    metrics_port: int = 0  # Prometheus /metrics and /healthz; 0 = off
    worker: str = "rollout"  # rollout | placeholder (a `sleep` process: control-plane load and soak runs)
    worker_weights: str = "static"  # static (seeded policy) | follow (apply the trainer's versions of `model`)
    # started, paused rollout workers kept ready (model built, newest weights, no lease memory):
    # a grant hands one its lease instead of starting a process; 0 = every lease starts cold
    warm_workers: int = 1
    max_staleness: int = 1  # a worker takes tasks only with a policy at most this many versions behind
    # Enforced memory caps of CPU lease workers (rose.executor.memory_cap). The watchdog samples
    # each worker's RSS (summed over its process tree) every mem_cap_poll_s. 0.25 s is half the
    # telemetry period: with mem_cap_samples = 2 an overage is caught within one telemetry window
    # (0.5 s), the time the scheduler would need to see it as memory pressure, while a sample
    # costs a few /proc reads per worker (~0.2 ms; under 0.1% of a core). 0 turns the watchdog off.
    mem_cap_poll_s: float = 0.25
    mem_cap_samples: int = 2  # consecutive samples over the grant that stop the worker (a fork's double count is 1)
    mem_cap_grace_s: float = 1.0  # SIGKILL an over-cap worker still there this long after its stop
    mem_cap_cgroup: str = "auto"  # cgroup v2 memory.max per worker: auto | off | a delegated cgroup v2 directory
    # a replica lease's drain: the longest wait, after the replica left its router, for its
    # requests in flight to finish; past it the grant is rejected and the replica readmitted
    # (CONTRACT §7). 30 s: Kubernetes' default termination grace period, the time a pod's
    # in-flight requests get before it is stopped
    drain_timeout_s: float = 30.0


@dataclass(frozen=True)
class RouterConfig:
    """The router a pool's replicas sit behind, which replica leases take a replica out of (docs/router.md)."""

    kind: str = "vllm-router"  # vllm-router (its worker API) | readiness (an endpoint per replica a balancer polls)
    # vllm-router: its API (30000 is its default port); readiness: where the endpoint listens
    url: str = "http://127.0.0.1:30000"
    metrics_url: str = ""  # vllm-router's Prometheus exporter (requests in flight per worker); "" = not read


@dataclass(frozen=True)
class RolloutConfig:
    """The inference engine rollout workers run (docs/engines.md)."""

    engine: str = "reference"  # vllm | hf | reference (the toy byte-level model; a test double)
    model: str = ""  # a local Hugging Face checkpoint directory (vllm, hf); nothing is downloaded
    python: str = ""  # the interpreter of the engine's environment; "" = the executor's own
    # the engine's compute dtype; "native": bfloat16 where the CPU has bf16 arithmetic (or on a
    # GPU), else float32 (rose.rollout.compute_dtype)
    dtype: str = "float32"
    max_model_len: int = 2048  # longest sequence (prompt, turns, observations) a worker admits
    # vLLM on CPU fixes its KV space when the engine starts (VLLM_CPU_KVCACHE_SPACE, whole GiB):
    # a warm engine holds it before any lease, and the worker's memory counts it
    kv_cache_bytes: int = GiB
    threads: int = 1  # engine compute threads (OMP) per worker on CPU
    # tokens one engine step may batch (decodes and prefill chunks; vLLM's max_num_batched_tokens,
    # the hf engine's prefill chunk); 0 = the engine's default. A pause waits for the step in
    # flight and a resume's first token for the next one: the step's size bounds both
    step_tokens: int = 0
    verify_weights: int = 0  # 1: workers check every applied version bit-exact (a read-back per version)


@dataclass(frozen=True)
class StackConfig:
    """The local development stack (`rose stack up`)."""

    data_dir: str = ".rose-stack"
    kafka_version: str = "4.1.1"
    kafka_port: int = 9092
    controller_port: int = 9093
    sasl_port: int = 9094  # SASL_PLAINTEXT listener with SCRAM-SHA-256/512
    tls_port: int = 9095  # SSL listener (throw-away local CA under data_dir/tls)
    redis_port: int = 6379
    kafka_heap: str = "512m"
    # `up --brokers 3`: three KRaft nodes (broker+controller each), node i on PLAINTEXT
    # kafka_cluster_port + i and CONTROLLER kafka_cluster_port + 100 + i (9192-9194, 9292-9294)
    kafka_cluster_port: int = 9192
    kafka_cluster_heap: str = "384m"  # per node
    jaeger_version: str = "v1.76.0"  # Go module version of github.com/jaegertracing/jaeger (`up --jaeger`)
    jaeger_otlp_grpc_port: int = 4317
    jaeger_otlp_http_port: int = 4318
    jaeger_query_port: int = 16686  # UI and /api
    jaeger_ui_dir: str = ""  # a built jaeger-ui (index.html, static/) to serve; "" = the binary's placeholder page


@dataclass(frozen=True)
class GatewayConfig:
    """The OpenAI-compatible front door over the rollout pool (`rose gateway`, docs/gateway.md)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: str = field(default="", repr=False)  # comma-separated bearer tokens; "" = no auth
    max_inflight: int = 64  # turns on the task queue at once; beyond them requests wait ...
    max_queue: int = 256  # ... this many of them at most; the next one gets 429 with Retry-After
    request_timeout_s: float = 600.0  # a request's deadline: admission wait and turn together
    # no worker of the job running (all paused, revoked or gone) this long: new turns get 429
    pause_patience_s: float = 30.0
    # a Hugging Face checkpoint or tokenizer directory: /generate then takes `text` prompts and
    # answers with the decoded text (rose.gateway.text); "" = token ids only
    tokenizer: str = ""

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(k.strip() for k in self.api_keys.split(",") if k.strip())


@dataclass(frozen=True)
class Config:
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    stack: StackConfig = field(default_factory=StackConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    router: RouterConfig = field(default_factory=RouterConfig)

    def redacted(self) -> dict:
        """The config as a dict with secrets replaced, safe to log."""
        d = dataclasses.asdict(self)
        for k in list(d["kafka"]["librdkafka"]):
            if any(s in k for s in ("password", "secret", "key")):
                d["kafka"]["librdkafka"][k] = "***"
        for k, v in d["security"].items():
            if v:
                d["security"][k] = "***"
        d["redis"]["url"] = _redact_url(d["redis"]["url"])
        if d["gateway"]["api_keys"]:
            d["gateway"]["api_keys"] = "***"
        return d


# librdkafka properties whose names hold an underscore, which the environment form cannot tell
# from a dot: ROSE_LIBRDKAFKA__LOG_LEVEL=0 means `log_level`, not `log.level`
_UNDERSCORED = {"log.level": "log_level"}


def _redact_url(url: str) -> str:
    """redis://user:secret@host -> redis://user:***@host"""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not sep or not at:
        return url
    user, colon, _ = creds.partition(":")
    return f"{scheme}://{user}{':***' if colon else ''}@{host}"


_SECRET_FILE_SUFFIX = "_file"


_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}
_BOOL_WORDS = {"true": True, "1": True, "false": False, "0": False}


def _coerce(section: str, f: dataclasses.Field, raw: Any) -> Any:
    typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    name = f"{section}.{f.name}"
    if typ.startswith("tuple[tuple[float, float]"):
        return _profile_points(name, raw)
    try:
        if typ == "int":
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            return int(raw)
        if typ == "float":
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)
        if typ == "bool":  # TOML's true/false; from the environment: true, false, 1 or 0
            if isinstance(raw, bool):
                return raw
            return _BOOL_WORDS[str(raw).strip().lower()]
        if typ == "str":
            if not isinstance(raw, str | int | float):  # a table, an array or a date is a mistake
                raise ValueError
            return str(raw)
        if typ.startswith("Mapping") and not isinstance(raw, Mapping):
            raise ValueError
    except (TypeError, ValueError, OverflowError, KeyError):
        raise ConfigError(f"{name}: expected {_TYPE_WORDS.get(typ, 'a table')}, got {raw!r}") from None
    return raw


def _profile_points(name: str, raw: Any) -> tuple[tuple[float, float], ...]:
    """(share, serving p99 ratio) points: from a rose.interference_profile.v1 file (a path; the
    points of its mechanism in use) or an array of [share, ratio] pairs. Shares in (0, 1],
    increasing; ratios > 0."""
    import json

    if isinstance(raw, str):
        if not raw.strip():
            return ()
        try:
            doc = json.loads(Path(raw).read_text())
            pts = doc["points"] if "points" in doc else doc["mechanisms"][doc["mechanism"]]
            raw = [[p["share"], p["serving_p99_ratio"]] for p in pts]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"{name}: cannot read {raw} as a rose.interference_profile.v1 file ({type(e).__name__}: {e}); "
                "give a profile file or an array of [share, p99 ratio] pairs"
            ) from None
    if not isinstance(raw, list | tuple):
        raise ConfigError(f"{name}: expected a profile file's path or an array of [share, p99 ratio] pairs")
    out: list[tuple[float, float]] = []
    for p in raw:
        ok = isinstance(p, list | tuple) and len(p) == 2
        ok = ok and all(isinstance(x, int | float) and not isinstance(x, bool) for x in p)
        if not ok or not (0.0 < p[0] <= 1.0 and 0.0 < p[1] < float("inf")):
            raise ConfigError(f"{name}: expected [share in (0, 1], p99 ratio > 0] pairs, got {p!r}")
        out.append((float(p[0]), float(p[1])))
    if [s for s, _ in out] != sorted({s for s, _ in out}):
        raise ConfigError(f"{name}: shares must be distinct and increasing, got {[s for s, _ in out]}")
    return tuple(out)


def _apply(obj: Any, section: str, values: Mapping[str, Any]) -> Any:
    known = {f.name: f for f in fields(obj)}
    changes: dict[str, Any] = {}
    for key, raw in values.items():
        if key.endswith(_SECRET_FILE_SUFFIX) and key[: -len(_SECRET_FILE_SUFFIX)] in known:
            target = key[: -len(_SECRET_FILE_SUFFIX)]
            if not isinstance(raw, str):
                raise ConfigError(f"{section}.{key}: expected a file path, got {raw!r}")
            try:
                changes[target] = Path(raw).read_text().strip()
            except OSError as e:
                raise ConfigError(f"{section}.{key}: cannot read {raw}: {e.strerror or e}") from None
            except ValueError as e:  # not UTF-8 text, or a NUL in the path
                raise ConfigError(f"{section}.{key}: cannot read {raw!r}: {e}") from None
            continue
        if key not in known:
            raise ConfigError(f"{section}.{key}: unknown setting (known: {', '.join(sorted(known))})")
        if key == "pools" and section == "policy":
            changes[key] = _pools(raw)
        elif key == "librdkafka":
            if not isinstance(raw, Mapping):
                raise ConfigError(f"{section}.librdkafka: expected a table")
            changes[key] = {**getattr(obj, key), **{str(k): str(v) for k, v in raw.items()}}
        else:
            changes[key] = _coerce(section, known[key], raw)
    return replace(obj, **changes) if changes else obj


def _pools(raw: Any) -> dict[str, PoolConfig]:
    """`[policy.pools.<pool>]` tables, each read as its section (unknown keys and types named)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"policy.pools: expected [policy.pools.<pool>] tables, got {raw!r}")
    out: dict[str, PoolConfig] = {}
    for name, values in raw.items():
        where = f"policy.pools.{name}"
        if not isinstance(values, Mapping):
            raise ConfigError(f"{where}: expected a [{where}] table, got {values!r}")
        out[str(name)] = _apply(PoolConfig(), where, values)
    return out


def _read_toml(path: str | Path) -> dict[str, Any]:
    """The TOML document at `path`; every way it can fail is one ConfigError naming the file."""
    fix = "pass a readable TOML file with --config-file or ROSE_CONFIG"
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; {fix}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory; {fix}") from None
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot read it ({e.strerror or e}); {fix}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: not valid TOML ({e}); fix the file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path}: not valid TOML (not UTF-8 text); fix the file") from None
    except RecursionError:
        raise ConfigError(f"config file {path}: not valid TOML (nested too deeply); fix the file") from None
    except ValueError as e:  # a path the OS cannot take (a NUL byte)
        raise ConfigError(f"config file {path!r}: cannot read it ({e}); {fix}") from None


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Defaults < TOML file (`path` or $ROSE_CONFIG) < environment."""
    env = os.environ if env is None else env
    path = path or env.get("ROSE_CONFIG")
    sections: dict[str, dict[str, Any]] = {}
    if path:
        for k, v in _read_toml(path).items():
            if not isinstance(v, dict):
                raise ConfigError(f"{k}: expected a [section] table")
            sections[k] = dict(v)

    def put(section: str, key: str, value: Any) -> None:
        sections.setdefault(section, {})[key] = value

    if "ROSE_KAFKA_BOOTSTRAP" in env:
        put("kafka", "bootstrap", env["ROSE_KAFKA_BOOTSTRAP"])
    if "ROSE_REDIS_URL" in env:
        put("redis", "url", env["ROSE_REDIS_URL"])
    for k, v in env.items():
        if not k.startswith("ROSE_") or "__" not in k:
            continue
        section, _, key = k[5:].partition("__")
        section, key = section.lower(), key.lower()
        if section == "librdkafka":
            name = key.replace("_", ".")
            sections.setdefault("kafka", {}).setdefault("librdkafka", {})[_UNDERSCORED.get(name, name)] = v
        else:
            put(section, key, v)

    cfg = Config()
    known = {f.name for f in fields(cfg)}
    changes = {}
    for section, values in sections.items():
        if section not in known:
            raise ConfigError(f"[{section}]: unknown section (known: {', '.join(sorted(known))})")
        changes[section] = _apply(getattr(cfg, section), section, values)
    cfg = replace(cfg, **changes)
    check_sections(cfg)
    return cfg
