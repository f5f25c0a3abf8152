"""The rollout worker's process: `main()`, what `python -m rose.rollout.worker_process` runs (the
loop itself is rose.rollout.worker.Worker; `python -m rose.rollout.worker` runs this module too).

    python -m rose.rollout.worker_process --config-fd N      (rose.rollout.launcher.launch(WorkerConfig))

Its one configuration, `WorkerConfig`, arrives as JSON on descriptor N (default 0, stdin), never
on the command line: it carries the Redis connection and the weights HMAC key, from which the
process builds its engine, Redis client, task queue and weight source (`weight_source`).
Serving is protected (`protect`) by a hard memory cap, the lowest-priority CUDA stream, OS nice
and optionally SCHED_IDLE (both also set by the launcher before exec) and fewer threads on CPU;
on CPU the executor enforces the memory cap (rose.executor.memory_cap). A warm worker (`warm=True`, the executor's pool)
builds its model and follows the weights with no lease (`wait_for_lease`), then sizes itself to
the lease it is handed.
In full: docs/rollout.md.
On CUDA the lease's share and memory become the worker's MPS limits, and a worker with an MPS
share refuses its lease when the device fails the GEMM check or MPS is meant and the worker is
not attached to it (`check_device`).
Exit codes: 0 drained, 2 bad config, 3 memory budget too small, 4 the weights' Redis Cluster
(redis.cluster_nodes) not usable at start, 5 the lease refused by the device check.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from rose.rollout import mps
from rose.rollout.compute_dtype import resolve_dtype
from rose.rollout.gemm_check import GemmResult, first_failure, gemm_check
from rose.rollout.launcher import (
    EXIT_BAD_CONFIG,
    EXIT_BUDGET,
    EXIT_DEVICE_CHECK,
    EXIT_UNAVAILABLE,
    LeaseRecord,
    WorkerConfig,
    apply_nice,
    apply_sched_idle,
    read_config,
)
from rose.rollout.pause_flag import STOP, PauseFlag
from rose.rollout.worker import Worker, apply_version
from rose.shutdown import Shutdown

# TASKS_ON_URL: a worker holds two Redis clients. The weight streams are read through
# `weight_source` (rose.weights.clients.weights_client: the Redis Cluster of redis.cluster_nodes
# when set, else the client below). The task queue, heartbeats and worker views stay on the
# single Redis at redis.url even then: TaskQueue's Lua scripts and MULTI blocks span keys of
# different hash slots (tasks, results, done set, stats), which a cluster refuses (CROSSSLOT).

# Fault injection, for tests only: a worker whose environment sets this to N allocates and
# touches N more bytes of host memory once its lease runs, and holds them, so that the
# executor's memory cap (rose.executor.memory_cap) can be seen to act. Never set in production.
FAULT_ALLOCATE_BYTES_ENV = "ROSE_TEST_ALLOCATE_BYTES"
_fault_ballast: list[bytearray] = []


def lowest_priority_stream(device):
    """A CUDA stream at the lowest priority (PyTorch: larger number = lower priority)."""
    import torch

    low, _high = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]  # static; the stubs declare a method
    return torch.cuda.Stream(device=device, priority=low)


def protect(config: WorkerConfig):
    """Apply the serving protections to this process; the CUDA stream to run on (or None).
    Both: OS niceness `config.nice` and, with `config.sched_idle`, SCHED_IDLE on every thread the
    process has by now (the launcher set both before exec; again here for a worker started by
    hand, whose `main` already set SCHED_IDLE before any thread started). CPU: a thread count
    from compute_share. CUDA: the allocator's hard cap at mem_bytes (per-process memory
    fraction) and the lowest-priority stream."""
    import torch

    if config.nice:
        apply_nice(config.nice)
    if config.sched_idle:
        apply_sched_idle()
    if config.device == "cpu":
        torch.set_num_threads(max(1, int(config.compute_share * (os.cpu_count() or 1))))
        return None
    dev = torch.device(config.device)
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, config.mem_bytes / total), dev)
    return lowest_priority_stream(dev)


def wait_for_lease(
    config: WorkerConfig, flag: PauseFlag, engine, weights, stop, stats: dict | None = None
) -> LeaseRecord | None:
    """A warm worker's wait, started and paused with no lease: keep applying weight versions as
    they commit (so it starts at the newest), poll the flag's assignment counter, and return
    the lease record the executor announced; None on STOP or `stop` (a threading.Event).
    Raises ValueError for a record that is not valid."""
    from rose.weights.clients import unavailable_errors

    stats = {} if stats is None else stats
    next_weights = 0.0
    while not stop.is_set() and flag.get() != STOP:
        n = flag.assignment  # a fresh flag says 0; a warm worker is assigned once
        if n:
            try:
                rec = LeaseRecord.read(config.lease_file)
            except FileNotFoundError:
                rec = None
            if rec is not None and rec.assignment == n:
                return rec
        now = time.monotonic()
        if now >= next_weights:
            next_weights = now + Worker.WEIGHTS_S
            try:
                if weights.poll() is not None:
                    apply_version(engine, weights, flag, stats, config.verify_weights)
            except unavailable_errors():
                next_weights = now + 1.0  # Redis or a cluster node is away: retry later, the lease may come
        time.sleep(0.001)
    return None


def inject_memory_fault(env: Mapping[str, str] = os.environ) -> int:
    """The fault-injection hook (`FAULT_ALLOCATE_BYTES_ENV`): allocate, touch and keep that many
    bytes; how many (0 when unset or not a positive integer)."""
    try:
        n = int(env.get(FAULT_ALLOCATE_BYTES_ENV, "") or 0)
    except ValueError:
        return 0
    if n <= 0:
        return 0
    ballast = bytearray(n)
    ballast[:: mmap.PAGESIZE] = b"\x01" * len(range(0, n, mmap.PAGESIZE))  # every page resident
    _fault_ballast.append(ballast)
    print(f"rose-worker: fault injection: holding {n} bytes ({FAULT_ALLOCATE_BYTES_ENV})", file=sys.stderr, flush=True)
    return n


def check_device(
    config: WorkerConfig,
    env: MutableMapping[str, str] = os.environ,
    gemm: Callable[[str, tuple[str, ...]], list[GemmResult]] = gemm_check,
    clients: Callable[[str], set[int]] = mps.nvml_clients,
) -> str | None:
    """Before the worker loads weights onto a CUDA device: set its MPS limits from the lease
    (`mps.client_env`), then, with an MPS share (below 1, or MPS meant), run the GEMM check in
    bf16 and the model's dtype (rose.rollout.gemm_check) and check the MPS attachment
    (`mps.not_attached`). Why the lease is refused, or None. A check that cannot run refuses."""
    if not config.device.startswith("cuda"):
        return None
    env.update(mps.client_env(config.device, config.compute_share, config.mem_bytes))
    if config.compute_share >= 1.0 and mps.meant(env) is None:
        return None
    try:
        why = first_failure(gemm(config.device, ("bfloat16", resolve_dtype(config.dtype, "cuda"))))
    except Exception as e:  # noqa: BLE001 - a check that cannot run must not pass
        return f"the GEMM check could not run on {config.device}: {type(e).__name__}: {e}"
    return why or mps.not_attached(config.device, env, clients)


def _refuse(config: WorkerConfig, **kw: Any) -> int | None:
    why = check_device(config, **kw)
    return None if why is None else _fail(f"refusing the lease: {why}", EXIT_DEVICE_CHECK)


def _fail(msg: str, code: int) -> int:
    print(f"rose-worker: {msg}", file=sys.stderr, flush=True)
    return code


def weight_source(config: WorkerConfig, r):
    """The worker's policy source: the engine's initial policy (the seeded reference weights, or
    the checkpoint's own), or the trainer's weight stream followed with the config's HMAC key
    (unsigned or wrongly signed entries are refused). `r` is the worker's Redis at redis.url;
    the weight streams are read through `weights_client`, on the Redis Cluster of
    redis.cluster_nodes when set (ClusterUnavailable when it is not usable)."""
    from rose.rollout.engines import initial_weights
    from rose.rollout.weight_source import FollowedWeights, StaticWeights

    if config.weights == "static":
        return StaticWeights(initial_weights(config))
    from rose.weights.clients import weights_client
    from rose.weights.follower import WeightFollower

    # the weight streams on their own client: a RedisCluster with redis.cluster_nodes, else `r`
    f = WeightFollower(weights_client(config.redis, r), config.redis, config.model, hmac_key=config.weights_hmac_key)
    f.poll()
    return FollowedWeights(f, initial_weights(config))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rose.rollout.worker_process")
    ap.add_argument(
        "--config-fd", type=int, default=0, help="Descriptor to read the WorkerConfig JSON from (default: stdin)"
    )
    a = ap.parse_args(argv)
    try:
        config = read_config(a.config_fd)
    except ValueError as e:
        return _fail(str(e), EXIT_BAD_CONFIG)
    if config.sched_idle:  # on the main thread before any other starts: every later thread inherits it
        apply_sched_idle()
    _tracing(config)
    if config.warm:
        return _warm_main(config)
    refused = _refuse(config)  # before the CUDA context is used for anything else
    if refused is not None:
        return refused

    from rose.rollout.engine import BudgetError
    from rose.rollout.engines import build_engine
    from rose.rollout.tasks import TaskQueue

    stream = protect(config)
    try:
        engine = build_engine(config, config.device, config.mem_bytes, stream)
    except ValueError as e:
        return _fail(str(e), EXIT_BAD_CONFIG)
    except BudgetError as e:
        return _fail(str(e), EXIT_BUDGET)
    got = _redis_and_weights(config)
    if isinstance(got, int):
        return got
    r, weights = got
    flag = PauseFlag(config.pause_flag) if config.pause_flag else None
    stats: dict = {}
    apply_version(engine, weights, flag, stats, config.verify_weights, first=True)
    q = TaskQueue(r, config.redis, config.job)
    w = Worker(config, r, q, engine, weights, flag)
    w.stats.update(stats)
    # SIGTERM drains; a repeat of it (its executor's death, rose.shutdown) leaves the drain to end
    Shutdown.install(name="rose-worker", hooks=(lambda: setattr(w, "stop_requested", True),), repeat_ends=False)
    return _run_and_exit(w, flag, r)


def _redis_and_weights(config: WorkerConfig):
    """The task streams' Redis client and the weight source, or the exit status of a one-line
    failure (a bad weights setting, an unreachable weights cluster)."""
    import redis

    from rose.weights.clients import ClusterUnavailable

    r = redis.Redis.from_url(config.redis.url)  # the task streams: TASKS_ON_URL
    try:
        return r, weight_source(config, r)
    except ValueError as e:
        return _fail(str(e), EXIT_BAD_CONFIG)
    except ClusterUnavailable as e:
        return _fail(str(e), EXIT_UNAVAILABLE)


def _tracing(config: WorkerConfig) -> None:
    """Export the worker's spans as its config's tracing section says (none: no provider, and
    every span the worker opens is a no-op)."""
    if config.tracing.exporter == "none":
        return
    from rose.obs.tracing import setup_tracing

    try:
        setup_tracing(config.tracing, service="rose-worker")
    except Exception as e:  # noqa: BLE001 - a worker runs without traces rather than not at all
        print(f"rose-worker: tracing not set up ({e})", file=sys.stderr, flush=True)


def _run_and_exit(w: Worker, flag: PauseFlag | None, r) -> int:
    from rose.obs.tracing import flush_tracing

    inject_memory_fault()
    try:
        code = w.run()
    finally:
        if flag is not None:
            flag.close()
        r.close()
        flush_tracing(2000)  # os._exit below skips the exporter's own flush
    # Everything is drained and acknowledged in Redis: leave without the interpreter's and
    # torch's teardown, which takes seconds for a low-priority process on a busy host and
    # would hold the lease's memory past the revoke.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _warm_main(config: WorkerConfig) -> int:
    """A warm worker (the executor's pool; launched niced): import, build the model and apply the
    newest weights with no lease, wait for one (`wait_for_lease`), then size itself to it and
    run it like a worker started for it. Until assigned it holds no lease memory: the model
    waits in host memory with no KV cache (0 slots); the device, its memory cap, the stream and
    the KV cache are set up at assignment, from the lease's mem_bytes."""
    # until assigned, a stop has nothing to drain; once assigned, a repeated SIGTERM must not cut it short
    shutdown = Shutdown.install(name="rose-worker", repeat_ends=False)

    from rose.rollout.engine import BudgetError, MemoryBudget, TorchEngine
    from rose.rollout.engines import build_engine
    from rose.rollout.tasks import TaskQueue

    try:
        # the reference engine waits on the host with no KV cache; vLLM on CPU holds its fixed KV
        # space from the start (counted in the worker's memory), and runs on the device it starts on
        engine = build_engine(config, "cpu" if config.engine == "reference" else config.device, 0)
    except ValueError as e:
        return _fail(str(e), EXIT_BAD_CONFIG)
    got = _redis_and_weights(config)
    if isinstance(got, int):
        return got
    r, weights = got
    flag = PauseFlag(config.pause_flag)
    warm_stats: dict = {}
    apply_version(engine, weights, flag, warm_stats, config.verify_weights, first=True)
    flag.mark_ready()
    try:
        rec = wait_for_lease(config, flag, engine, weights, shutdown.stop, warm_stats)
    except ValueError as e:
        return _fail(f"lease record: {e}", EXIT_BAD_CONFIG)
    if rec is None:  # stopped while warm: nothing to hand back
        flag.close()
        r.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    config = rec.apply(config)
    refused = _refuse(config)  # the CUDA context starts only now, so MPS still reads the lease's limits
    if refused is not None:
        return refused
    stream = protect(config)
    if isinstance(engine, TorchEngine):
        try:
            engine.assign(MemoryBudget(config.mem_bytes, engine.spec), device=config.device, stream=stream)
        except BudgetError as e:
            return _fail(str(e), EXIT_BUDGET)
    q = TaskQueue(r, config.redis, config.job)
    w = Worker(config, r, q, engine, weights, flag)
    w.stats.update(warm_stats)  # versions applied while warm
    shutdown.hooks.append(lambda: setattr(w, "stop_requested", True))
    w.stop_requested = shutdown.requested
    return _run_and_exit(w, flag, r)


if __name__ == "__main__":
    sys.exit(main())
