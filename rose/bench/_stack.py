"""Shared set-up of the executor benches: a private topic and Redis key prefix on the running
stack (so a bench never touches a live system's topics), and a queue of rollout tasks."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rose.config import Config
from rose.obs.stats import percentile

if TYPE_CHECKING:  # the GPU check imports this module with nothing but torch (tests/test_gpu_check.py)
    from rose.contract.records import Heartbeat


@contextlib.contextmanager
def private_stack(cfg: Config, tag: str, kafka: bool = True, partitions: int = 1):
    """`cfg` with its own topics of `partitions` partitions (created, deleted after; only with
    `kafka`) and Redis keys (deleted after)."""
    import redis

    from rose.kafka.admin import wait_for_broker
    from rose.kafka.topics import create_topics, delete_topics, topic_specs

    u = uuid.uuid4().hex[:8]
    c = dataclasses.replace(
        cfg,
        kafka=dataclasses.replace(
            cfg.kafka, topic_prefix=f"{cfg.kafka.topic_prefix}bench-{tag}-{u}.", partitions=partitions
        ),
        redis=dataclasses.replace(cfg.redis, key_prefix=f"{cfg.redis.key_prefix}bench-{tag}-{u}:"),
    )
    if kafka:
        wait_for_broker(c.kafka, timeout_s=30)
        create_topics(c.kafka)
    r = redis.Redis.from_url(c.redis.url)
    try:
        yield c
    finally:
        if kafka:
            delete_topics(c.kafka, list(topic_specs(c.kafka)))
        keys = list(r.scan_iter(match=f"{c.redis.key_prefix}*", count=1000))
        if keys:
            r.delete(*keys)
        r.close()


def fill_tasks(cfg: Config, job: str, n: int, turns: int = 4, tokens_per_turn: int = 32) -> None:
    """`n` agentic episodes with short tool calls, so a worker always has decoding to do."""
    import redis

    from rose.rollout.episode import Task, ToolLatency
    from rose.rollout.tasks import TaskQueue

    q = TaskQueue(redis.Redis.from_url(cfg.redis.url), cfg.redis, job)
    q.ensure_group()
    for i in range(n):
        q.submit(
            Task(
                task_id=f"bench-{i}",
                prompt=[1 + i % 250, 7, 9, 11],
                max_turns=turns,
                tokens_per_turn=tokens_per_turn,
                obs_tokens=8,
                tool=ToolLatency(mu=-5.0, sigma=0.0),
                seed=i,
            )
        )


def leased_workers(c: Config, job: str, tasks: int, **executor) -> Config:
    """`c` for a bench of leased workers on `job` (`tasks` episodes queued), with the executor's
    `executor` settings: workers at nice 10 that verify every weight version; on a checkpoint
    engine they follow the weight stream, on which version 1 is published (every warm engine
    applies it before its lease)."""
    engine = c.rollout.engine
    weights = "follow" if engine != "reference" else c.executor.worker_weights
    ex = dataclasses.replace(
        c.executor, job=job, worker_nice=10, worker_weights=weights, model=f"bench-{engine}", **executor
    )
    c = dataclasses.replace(c, executor=ex, rollout=dataclasses.replace(c.rollout, verify_weights=1))
    fill_tasks(c, job, tasks)
    if engine != "reference":
        publish_test_version(c, 1)
    return c


def lease_io(c: Config) -> tuple:
    """A producer of the bench's commands and a consumer of the lease states published from now on."""
    from rose.kafka.consumer import make_consumer
    from rose.kafka.producer import make_producer

    producer = make_producer(c.kafka, **{"linger.ms": 0})
    states = make_consumer(c.kafka, f"bench-{time.monotonic_ns()}", **{"fetch.wait.max.ms": 5})
    states.subscribe([c.kafka.lease_state_topic])
    return producer, states


def lease_state(states, state: str, epoch: int):
    """The lease state `state` of epoch `epoch` among the next ones `states` reads (None if not there)."""
    from rose.contract.events import LeaseState
    from rose.contract.wire import decode

    for m in states.consume(50, timeout=0.002):
        if m.error():
            continue
        ls = decode(m.value(), expect=LeaseState)
        if ls.state == state and ls.epoch == epoch:
            return ls
    return None


def percentiles_ms(samples_ns: list[int]) -> dict:
    """p50/p99/max in milliseconds of nanosecond samples (nearest rank; None for no samples)."""
    ms = [x / 1e6 for x in samples_ns]
    return {
        "p50_ms": percentile(ms, 0.50, 3),
        "p99_ms": percentile(ms, 0.99, 3),
        "max_ms": percentile(ms, 1.0, 3),
        "n": len(ms),
    }


def progress(bench: str, t0: float, msg: str) -> None:
    """A bench's progress line on stderr (stdout carries only its JSON), at seconds since `t0`."""
    print(f"[bench {bench} {time.monotonic() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def child_result(q, p, what: str):
    """What a bench's child process (`p`, spawned for vLLM's process-wide settings) put on `q`,
    or one line naming `what` when it died without putting it there."""
    import queue

    while True:
        try:
            out = q.get(timeout=1.0)
        except queue.Empty:
            if not p.is_alive():
                raise SystemExit(f"{what} exited {p.exitcode}; its error is above") from None
            continue
        p.join(60)
        return out


def wait_for(fn, timeout_s: float):
    """Poll `fn` (every 0.2 ms: the benches time sub-millisecond events) until it returns
    something true, and return that; TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.0002)
    raise TimeoutError(f"bench: condition not met within {timeout_s}s")


# a lease on a checkpoint engine holds the engine's libraries, its weights and (vLLM on CPU) its fixed
# KV space: the benches' grants say so, or the executor's memory cap would stop the worker
ENGINE_LEASE_BYTES = 6 << 30


def engine_lease_bytes(cfg: Config) -> int:
    """mem_bytes of a bench's grant for the configured rollout engine."""
    return (1 << 30) if cfg.rollout.engine == "reference" else ENGINE_LEASE_BYTES


def publish_test_version(cfg: Config, version: int) -> None:
    """A trainer's version for a bench: the checkpoint's tensors nudged (seeded by `version`), in bf16,
    on the weight stream `executor.model`."""
    import redis
    import torch
    from safetensors.torch import load_file

    from rose.weights.stream import WeightPublisher

    g = torch.Generator().manual_seed(version)
    sd: dict = {}
    for f in sorted(Path(cfg.rollout.model).glob("*.safetensors")):
        sd.update(load_file(str(f)))
    r = redis.Redis.from_url(cfg.redis.url)
    try:
        pub = WeightPublisher(r, cfg.redis, cfg.executor.model, hmac_key=cfg.security.weights_hmac_key)
        pub.publish(
            {k: (v.float() + 1e-3 * torch.randn(v.shape, generator=g)).to(torch.bfloat16) for k, v in sd.items()}
        )
    finally:
        r.close()


def last_heartbeat(r, cfg: Config, worker_id: str) -> Heartbeat | None:
    """A worker's heartbeat as it is now (None once it expired)."""
    from rose.contract.records import WorkerRegistry

    return WorkerRegistry(r, cfg.redis.key).read(worker_id)


def engine_report(cfg: Config, beats: Sequence[Heartbeat | None]) -> dict:
    """`engine: {name, version, device}` and `weights: {versions_applied, versions_verified, bit_exact}`
    from the last heartbeat of each worker the bench ran, read when it ended (CONTRACT §6)."""
    hbs = [h for h in beats if h is not None]
    engine: dict = {"name": cfg.rollout.engine, "version": None, "device": None}
    for h in hbs:
        if h.engine_library:
            engine = {"name": h.engine, "version": h.engine_library, "device": h.device}
            break
    verified = sum(h.versions_verified for h in hbs)
    return {
        "engine": engine,
        "weights": {
            "versions_applied": sum(h.versions_applied for h in hbs),
            "versions_verified": verified,
            "bit_exact": all(h.versions_mismatched == 0 for h in hbs) if verified else None,
        },
    }


def step_report(beats: Sequence[Heartbeat | None]) -> dict:
    """The workers' decode-step wall time (heartbeat `step_ms_p50`/`step_ms_p99`, each over a
    worker's last steps): per lease, the median and the largest of their p50s and p99s."""
    p50 = sorted(h.step_ms_p50 for h in beats if h is not None and h.step_ms_p50 is not None)
    p99 = sorted(h.step_ms_p99 for h in beats if h is not None and h.step_ms_p99 is not None)
    if not p99:
        return {"leases": 0}
    return {
        "leases": len(p99),
        "p50_ms_median": p50[len(p50) // 2],
        "p99_ms_median": p99[len(p99) // 2],
        "p99_ms_max": p99[-1],
        "note": "each worker's last heartbeat: nearest-rank p50/p99 of its last 512 token-producing steps",
    }


@contextlib.contextmanager
def rollout_workers(
    c: Config, tag: str, logs: Path, fields: dict, paused: Sequence[str] = ()
) -> Iterator[tuple[dict, dict]]:
    """Two rollout workers `w0`, `w1` (WorkerConfig fields `fields` beside their own gpu, id and
    pause flag), each with a pause flag (RUN, or PAUSE for those in `paused`), each logging to
    `logs/worker-<w>.log`; yields (flags, processes), then sets STOP and reaps them."""
    import subprocess

    from rose.rollout.launcher import WorkerConfig, launch
    from rose.rollout.pause_flag import PAUSE, STOP, PauseFlag

    suffix = uuid.uuid4().hex[:8]
    flags = {w: PauseFlag(f"rose-bench-{tag}-{suffix}-{w}", create=True) for w in ("w0", "w1")}
    for w in paused:
        flags[w].set(PAUSE)
    procs: dict = {}
    try:
        for w, f in flags.items():
            wc = WorkerConfig.from_config(c, **{"gpu": f"cpu/{w}", "worker_id": w, "pause_flag": f.name, **fields})
            with open(logs / f"worker-{w}.log", "wb") as out:
                procs[w] = launch(wc, stdout=subprocess.DEVNULL, stderr=out)
        yield flags, procs
    finally:
        for f in flags.values():
            f.set(STOP)
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for f in flags.values():
            f.close()
            f.unlink()


class ServedGateway:
    """The gateway app served by uvicorn in a thread of this process."""

    def __init__(self, cfg: Config):
        import threading

        import uvicorn

        from rose.child_server import free_port
        from rose.gateway.app import create_app

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(cfg), host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="bench-gateway")
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("bench gateway: the gateway did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def checkpoint_or_tiny(model: str, folder: Path, tokenizer: bool = False) -> str:
    """`model`, or where none is given a tiny random-init checkpoint made in `folder` (with a
    tokenizer where asked): the benches' default engine checkpoint."""
    if model:
        return model
    from rose.model.random_init import init_checkpoint

    return str(init_checkpoint(folder / ("tiny-qwen2-tok" if tokenizer else "tiny-qwen2"), tokenizer=tokenizer))
