"""Replica leases: grant → drained and lent, revoke → readmitted and answering, under load through vllm-router over two vLLM replicas.

The stack: two vLLM OpenAI servers (`rose.vllm_server`) on one checkpoint (by default a tiny one
made for the run), vllm-router (`rose.router.process`) in front of both, and an executor in this
process (its loop on a thread) that owns GPU `LENT` (the first replica, `replicas={LENT: url}`,
the router through `VllmRouterAdapter`) and GPU `DEDICATED` (no replica). Commands are produced to
the run's own commands topic directly (the scheduler's decision time is measured by its own
bench); lease states are read from the executor's published list.

A steady load runs through the router from start to end: `RATE_PER_S` streamed completions a
second of `MAX_TOKENS` tokens on `PROMPT_TOKENS`-id prompts (`ignore_eos`), each from a thread of a
pool. A request attains the serving SLO when its time to first token is within
`telemetry.slo_ttft_ms` and its mean time per output token within `telemetry.slo_tpot_ms` (the
SLO the config gives every serving GPU); a failure (an error, a status other than 200, fewer
tokens than asked, no end of stream) counts as not attained, and `failed_requests` counts them
over the whole run. The phases, in order, each request counted in the phase it was sent in:

- no lease: the load alone for `phase_s`;
- leases: `cycles` replica leases on `LENT`, one after the other. Per cycle: a grant (`lease_kind:
  replica`), `drain_s` from just before it is produced to the `active` state's timestamp (the
  router drops the replica, the requests in flight end, the lease machine starts the worker);
  then the lent replica's rollout worker measured for `window_s` from its first heartbeat with
  tokens; then a revoke, `reclaim_to_serving_s` from just before it is produced to the replica
  listed by the router again and answering a one-token completion sent straight to it;
- dedicated: one ordinary lease on `DEDICATED`, its worker measured for `cycles × window_s`.

`rollout_tokens_per_s`: the tokens the worker's heartbeats count over their timestamps' span,
pooled over the windows: `lent_replica` over the cycles, `dedicated_same_device` over the
dedicated lease, the same engine on the same machine in the same run. On CPU vLLM cannot sleep
(docs/executor.md "Replica leases"): the lent replica's engine stays up and idle beside the worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rose.bench._stack import (
    checkpoint_or_tiny,
    engine_lease_bytes,
    engine_report,
    fill_tasks,
    last_heartbeat,
    private_stack,
    progress,
)
from rose.bench.serving_load import Load, answers_directly
from rose.obs.stats import percentile

LENT, DEDICATED = "sim/0", "sim/1"
JOB, MODEL = "bench-replica", "bench-replica"
# the load: light next to what one replica of the tiny model serves on one CPU thread (a decode
# step of a few ms), so the lent phase, one replica carrying it all, measures the lease's cost and
# not a saturated replica; the pool's threads cover a request's time at that rate many times over
RATE_PER_S, MAX_TOKENS, PROMPT_TOKENS, LOAD_THREADS = 4.0, 8, 4, 16
CYCLES, QUICK_CYCLES = 10, 3  # the "at least 10 cycles"; a quick run's few
PHASE_S, QUICK_PHASE_S = 60.0, 5.0  # the no-lease phase
WINDOW_S, QUICK_WINDOW_S = 10.0, 3.0  # a lent worker's measured tokens, per cycle
MAX_MODEL_LEN = 512
REQUEST_TIMEOUT_S = 60.0
ENGINE_START_S = 900.0  # a vLLM engine's import and start on a busy 2-core machine
LEASE_TTL_S = 3600.0  # longer than any phase: a lease ends by its revoke, not by expiry
POLL_S = 0.02  # readmission and lease states are read this often: well below the seconds they take


def _until(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll `fn` every POLL_S until it returns something true; TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(POLL_S)
    raise TimeoutError(f"bench replica: {what} not within {timeout_s:g}s")


# -- the stack ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Stack:
    cfg: Any  # the run's config: its own topics and keys, the job, the rollout engine
    servers: list  # the two vLLM servers (rose.vllm_server.VllmServer)
    router: Any  # rose.router.process.RouterProcess
    adapter: Any  # rose.router.vllm_router.VllmRouterAdapter
    ex: Any  # rose.executor.service.Executor, its loop on a thread
    producer: Any
    redis: Any

    @property
    def lent_url(self) -> str:
        return self.servers[0].url


@contextlib.contextmanager
def servers(model: str, logs: Path, python: str) -> Iterator[list]:
    """Two vLLM OpenAI servers on `model`, started side by side (each on one thread, unbound). The
    threads that started them live until they are stopped: a server gets SIGTERM when the thread
    that spawned it ends (PR_SET_PDEATHSIG, `rose.rollout.launcher.spawn`)."""
    from rose.vllm_server import start_server, stop_server

    def one(i: int):
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        return start_server(
            model,
            logs / f"vllm-server-{i}.log",
            max_model_len=MAX_MODEL_LEN,
            python=python,
            timeout_s=ENGINE_START_S,
            env=env,
        )

    pool = ThreadPoolExecutor(2, thread_name_prefix="bench-replica-server")
    futures = [pool.submit(one, i) for i in range(2)]
    up = [f.result() for f in futures if f.exception() is None]
    errors = [e for e in (f.exception() for f in futures) if e is not None]
    try:
        if errors:
            raise errors[0]
        yield up
    finally:
        for s in up:
            stop_server(s)
        pool.shutdown(wait=True)


@contextlib.contextmanager
def stack(cfg: Any, model: str, logs: Path) -> Iterator[Stack]:
    """The servers, the router over both, and the executor (LENT the first replica, DEDICATED none)."""
    import redis

    from rose.executor.service import Executor
    from rose.kafka.producer import make_producer
    from rose.router.process import start_router, stop_router
    from rose.router.vllm_router import VllmRouterAdapter

    with servers(model, logs, cfg.rollout.python) as srvs:
        rp = start_router([s.url for s in srvs], logs / "router.log")
        r = redis.Redis.from_url(cfg.redis.url)
        stop = threading.Event()
        try:
            fill_tasks(cfg, JOB, 4000)
            adapter = VllmRouterAdapter(rp.url, rp.metrics_url)
            ex = Executor(cfg, [LENT, DEDICATED], guard=False, replicas={LENT: srvs[0].url}, router=adapter).start()
            loop = threading.Thread(target=ex.run, args=(stop,), daemon=True, name="bench-replica-executor")
            loop.start()
            try:
                yield Stack(cfg, srvs, rp, adapter, ex, make_producer(cfg.kafka, **{"linger.ms": 0}), r)
            finally:
                stop.set()
                loop.join(60)
        finally:
            r.close()
            stop_router(rp)


# -- the leases ---------------------------------------------------------------------------------


def command(st: Stack, kind: str, gpu: str, epoch: int) -> None:
    """Produce a grant or a revoke of lease `gpu#epoch`: a replica lease on LENT, an ordinary one
    elsewhere; the whole device's share, the engine's memory."""
    from rose.contract.events import Command
    from rose.contract.wire import encode
    from rose.kafka.producer import produce

    now, end = time.time(), kind == "revoke"
    cmd = Command(
        command_id=f"{kind}-{gpu}-{epoch}",
        ts=now,
        kind=kind,
        gpu=gpu,
        lease_id=f"{gpu}#{epoch}",
        epoch=epoch,
        mem_bytes=0 if end else engine_lease_bytes(st.cfg),
        compute_share=0.0 if end else 1.0,
        expires_at=now if end else now + LEASE_TTL_S,
        reason="bench",
        cause_event_id=f"bench-{kind}-{gpu}-{epoch}",
        lease_kind="replica" if gpu == LENT else "coresident",
    )
    produce(st.producer, st.cfg.kafka.commands_topic, encode(cmd), gpu)
    st.producer.flush(10)


def state(st: Stack, gpu: str, epoch: int, want: str, timeout_s: float) -> Any:
    """The lease state `want` of lease `gpu#epoch` once the executor published it; RuntimeError when
    the lease ended otherwise first (with its reason)."""
    ends = ("rejected", "expired", "revoked")

    def seen() -> Any:
        for s in list(st.ex.published):
            if s.gpu == gpu and s.epoch == epoch and (s.state == want or s.state in ends):
                return s
        return None

    s = _until(seen, timeout_s, f"lease {gpu}#{epoch} {want}")
    if s.state != want:
        raise RuntimeError(f"bench replica: lease {gpu}#{epoch} {s.state} before {want}: {s.reason or 'no reason'}")
    return s


def tokens_window(st: Stack, gpu: str, epoch: int, window_s: float) -> tuple[int, float, Any]:
    """(tokens, seconds, last heartbeat) of the lease's worker over `window_s` from its first
    heartbeat with tokens (a cold engine starts first), by its heartbeats' counts and timestamps."""
    worker = f"{socket.gethostname()}:{gpu}:{epoch}"

    def beat(after: float, tokens: int) -> Any:
        if any(s.gpu == gpu and s.epoch == epoch and s.state in ("revoked", "expired") for s in st.ex.published):
            raise RuntimeError(f"bench replica: lease {gpu}#{epoch} ended while measured (worker logs: executor)")
        h = last_heartbeat(st.redis, st.cfg, worker)
        return h if h is not None and h.ts >= after and h.tokens >= tokens else None

    first = _until(lambda: beat(0.0, 1), ENGINE_START_S, f"worker {worker}'s first tokens")
    time.sleep(window_s)  # the window measured
    last = _until(lambda: beat(first.ts + window_s, 0), 60, f"worker {worker}'s heartbeat")
    return last.tokens - first.tokens, last.ts - first.ts, last


def cycle(st: Stack, epoch: int, window_s: float, model: str) -> dict:
    """One replica lease on LENT: grant → active, the worker's window, revoke → serving again."""
    from rose.router.base import replica_url

    t_grant = time.time()
    command(st, "grant", LENT, epoch)
    active = state(st, LENT, epoch, "active", st.cfg.executor.drain_timeout_s + 60)
    tokens, span, hb = tokens_window(st, LENT, epoch, window_s)
    url = replica_url(st.lent_url)
    t_revoke = time.monotonic()
    command(st, "revoke", LENT, epoch)
    _until(lambda: url in st.adapter.serving(), 300, f"replica {url} readmitted")
    _until(lambda: answers_directly(url, model, REQUEST_TIMEOUT_S), 300, f"replica {url} answering")
    reclaim = time.monotonic() - t_revoke
    state(st, LENT, epoch, "revoked", 120)
    return {"drain_s": active.ts - t_grant, "reclaim_s": reclaim, "tokens": tokens, "span_s": span, "beat": hb}


def dedicated(st: Stack, window_s: float) -> tuple[int, float, Any]:
    """One ordinary lease on DEDICATED, its worker measured for `window_s`, then revoked."""
    command(st, "grant", DEDICATED, 1)
    state(st, DEDICATED, 1, "active", 120)
    got = tokens_window(st, DEDICATED, 1, window_s)
    command(st, "revoke", DEDICATED, 1)
    state(st, DEDICATED, 1, "revoked", 120)
    return got


# -- the run ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    cycles: int
    phase_s: float
    window_s: float


@dataclasses.dataclass
class Figures:
    cycles: list[dict]
    dedicated: tuple[int, float, Any]
    load: Load
    router_version: str | None
    serving_version: str | None


def measure(c: Any, model: str, logs: Path, plan: Plan, say: Callable[[str], None]) -> Figures:
    """The stack up, the load through the router, then the phases in order (the module's doc)."""
    vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    say("starting two vLLM servers, vllm-router and the executor")
    shape = {"max_tokens": MAX_TOKENS, "prompt_tokens": PROMPT_TOKENS, "threads": LOAD_THREADS}
    with (
        stack(c, model, logs) as st,
        Load(st.router.url, model, vocab, rate_per_s=RATE_PER_S, timeout_s=REQUEST_TIMEOUT_S, **shape) as load,
    ):
        _until(lambda: sum(a.ok for a in list(load.answers)) >= RATE_PER_S, 300, "the load's first answers")
        say(f"load running ({RATE_PER_S:g}/s through the router); {plan.phase_s:g} s without a lease")
        load.phase = "no_lease"
        time.sleep(plan.phase_s)  # the phase measured
        load.phase = "with_replica_leases"
        cycles = []
        for epoch in range(1, plan.cycles + 1):
            cycles.append(cycle(st, epoch, plan.window_s, model))
            d = cycles[-1]
            say(
                f"cycle {epoch}/{plan.cycles}: drain {d['drain_s']:.3f} s, reclaim to serving "
                f"{d['reclaim_s']:.3f} s, lent worker {d['tokens'] / d['span_s']:.1f} tokens/s"
            )
        load.phase = "dedicated"
        say(f"a dedicated lease on {DEDICATED}, measured {plan.cycles * plan.window_s:g} s")
        ded = dedicated(st, plan.cycles * plan.window_s)
        load.phase = "end"
        serving = _served_version(st.lent_url)
    return Figures(cycles, ded, load, _router_version(), serving)


def _served_version(url: str) -> str | None:
    """The version vLLM's server answers at GET /version (None where it does not)."""
    import httpx

    try:
        return str(httpx.get(url + "/version", timeout=10).json()["version"])
    except Exception:  # a server without it: the figure says None
        return None


def _router_version() -> str | None:
    """The installed vllm-router's version: `rose.router.process` runs the one beside this interpreter."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm-router")
    except PackageNotFoundError:
        return None


def _seconds(xs: list[float]) -> dict:
    return {"p50": percentile(xs, 0.5, 4), "p99": percentile(xs, 0.99, 4), "n": len(xs)}


def report(c: Any, f: Figures, plan: Plan) -> dict:
    slo = (c.telemetry.slo_ttft_ms, c.telemetry.slo_tpot_ms)
    phases = {k: f.load.attainment(k, *slo) for k in ("no_lease", "with_replica_leases", "dedicated")}
    failed = f.load.failed()
    lent_tokens, lent_s = sum(d["tokens"] for d in f.cycles), sum(d["span_s"] for d in f.cycles)
    lent = round(lent_tokens / lent_s, 3) if lent_s > 0 else None
    ded = round(f.dedicated[0] / f.dedicated[1], 3) if f.dedicated[1] > 0 else None
    no_lease, leased = phases["no_lease"]["fraction"], phases["with_replica_leases"]["fraction"]
    engine = engine_report(c, [d["beat"] for d in f.cycles] + [f.dedicated[2]])["engine"]
    return {
        "engine": engine,
        "serving_engine": {"name": "vllm", "version": f.serving_version, "replicas": 2},
        "router": {"name": "vllm-router", "version": f.router_version},
        "drain_s": _seconds([d["drain_s"] for d in f.cycles]),
        "reclaim_to_serving_s": _seconds([d["reclaim_s"] for d in f.cycles]),
        "cycles": plan.cycles,
        "failed_requests": len(failed),
        "failures_first": [a.error for a in failed[:5]],
        "goal_failed_requests": 0,
        "serving_slo_attainment": {"no_lease": no_lease, "with_replica_leases": leased},
        "serving_requests": {k: v["n"] for k, v in phases.items()},
        "serving_slo": {"ttft_ms": slo[0], "tpot_ms": slo[1]},
        "attainment_with_leases_minus_without": round(leased - no_lease, 4)
        if leased is not None and no_lease is not None
        else None,
        "goal_attainment_with_leases_minus_without_min": -0.01,
        "rollout_tokens_per_s": {"lent_replica": lent, "dedicated_same_device": ded},
        "lent_over_dedicated_tokens_per_s": round(lent / ded, 4) if lent and ded else None,
        "goal_lent_over_dedicated_tokens_per_s_min": 0.8,
        "load": {"rate_per_s": RATE_PER_S, "max_tokens": MAX_TOKENS, "prompt_tokens": PROMPT_TOKENS},
        "no_lease_s": plan.phase_s,
        "window_s": {"lent_per_cycle": plan.window_s, "dedicated": plan.cycles * plan.window_s},
        "note": "drain_s: grant produced → `active`'s timestamp; reclaim_to_serving_s: revoke produced → the "
        "replica listed by the router and answering a completion sent straight to it; attainment: the "
        "requests sent in each phase within both serving SLOs (a failure is not within); tokens/s: the "
        "workers' heartbeat counts over their timestamps, pooled over the windows. On CPU vLLM cannot sleep: "
        "the lent replica's engine stays up, idle, beside the rollout worker",
    }


def bench_config(cfg: Any, engine: str, model: str) -> Any:
    """The run's executor (its job) and the rollout engine: `engine`
    ("" = the configured one) on `model` where it loads a checkpoint."""
    engine = engine or cfg.rollout.engine
    rollout = dataclasses.replace(cfg.rollout, engine=engine, model=model if engine != "reference" else "")
    return dataclasses.replace(cfg, executor=dataclasses.replace(cfg.executor, job=JOB, model=MODEL), rollout=rollout)


def run(cfg: Any, quick: bool, *, model: str = "", engine: str = "", cycles: int = 0) -> dict:
    import shutil
    import tempfile

    import redis

    with contextlib.closing(redis.Redis.from_url(cfg.redis.url)) as r:
        r.ping()  # Redis away: say so before making a checkpoint or starting an engine
    t0 = time.monotonic()
    plan = Plan(
        cycles or (QUICK_CYCLES if quick else CYCLES),
        QUICK_PHASE_S if quick else PHASE_S,
        QUICK_WINDOW_S if quick else WINDOW_S,
    )
    logs = Path(tempfile.mkdtemp(prefix="rose-bench-replica-"))  # the servers' logs, kept should the run fail
    progress("replica", t0, f"server and router logs in {logs} (removed when the run succeeds)")
    with tempfile.TemporaryDirectory(prefix="rose-bench-replica-model-") as tmp:
        model = checkpoint_or_tiny(model, Path(tmp))
        progress("replica", t0, f"checkpoint {model}")
        with private_stack(cfg, "replica") as c:
            c = bench_config(c, engine, model)
            f = measure(c, model, logs, plan, lambda m: progress("replica", t0, m))
            out = report(c, f, plan)
    shutil.rmtree(logs, ignore_errors=True)
    progress("replica", t0, f"failed requests {out['failed_requests']}; tokens/s {out['rollout_tokens_per_s']}")
    return out
