"""An executor process for the demo: `rose.executor.service.Executor`, unchanged, whose rollout
workers get the demo's slot count and, on the co-served device, its CPU.

    python -m rose.demo.executor_node --gpus sim/0,sim/1 [--device cpu] [--no-guard] \
        [--max-batch 4] [--worker-cpus 3] [--worker-sched-idle]

Config comes from `load_config()` (the demo hands every process its run's config file); the
workers follow the trainer's weights when `executor.worker_weights = "follow"`, with
`security.weights_hmac_key`. The executor builds each worker's `WorkerConfig`
(`rose.executor.workers.worker_config`); this process only replaces two of its fields.
`--worker-sched-idle` sets this executor's `executor.worker_sched_idle` (its workers run under
SCHED_IDLE: on the co-served device's core they get only the time serving leaves idle).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


def demo_worker_config(max_batch: int, cpus: tuple[int, ...] = ()):
    """A `worker_config` for Executor: the stock WorkerConfig with `max_batch` KV slots, pinned
    to `cpus` (empty: any) — the demo's co-served "device" core."""
    from rose.executor.workers import worker_config

    def make(cfg, start, flag_name: str, device: str, seed: int):
        return dataclasses.replace(
            worker_config(cfg, start, flag_name, device, seed), max_batch=max_batch, cpus=tuple(cpus)
        )

    return make


def _cpu_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rose.demo.executor_node")
    ap.add_argument("--gpus", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-guard", action="store_true")
    ap.add_argument("--max-batch", type=int, default=4, help="KV-cache slots of each rollout worker")
    ap.add_argument("--worker-cpus", type=_cpu_list, default=(), help="Run the workers on these CPUs (0,1,...)")
    ap.add_argument(
        "--worker-sched-idle", action="store_true", help="Run the workers under SCHED_IDLE (executor.worker_sched_idle)"
    )
    ap.add_argument("--ready-key", default="demo:ready", help="Redis hash (under the key prefix) set when started")
    a = ap.parse_args(argv)
    import redis

    from rose.config import load_config
    from rose.executor.service import Executor
    from rose.kafka.admin import wait_for_broker
    from rose.obs.logs import setup_logging

    setup_logging("INFO")
    cfg = load_config()
    if a.worker_sched_idle:
        cfg = dataclasses.replace(cfg, executor=dataclasses.replace(cfg.executor, worker_sched_idle=True))
    gpus = [g for g in a.gpus.split(",") if g]
    wait_for_broker(cfg.kafka, timeout_s=30)
    ex = Executor(
        cfg,
        gpus,
        device=a.device,
        guard=not a.no_guard,
        worker_config=demo_worker_config(a.max_batch, a.worker_cpus),
        log_name="rose.demo.executor",
    )
    ex.start()
    r = redis.Redis.from_url(cfg.redis.url)
    r.hset(cfg.redis.key(a.ready_key), f"executor:{a.gpus}", 1)
    r.close()
    ex.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
