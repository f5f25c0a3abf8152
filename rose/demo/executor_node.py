"""An executor process for the demo: `rose.executor.service.Executor`, unchanged, whose rollout
workers follow the trainer's weight stream (`weights="follow"`) with the demo's slot count.

    python -m rose.demo.executor_node --gpus sim/0,sim/1 [--device cpu] [--no-guard] [--worker-cpus 1] \
        --worker '<JSON>'

The stock `rose executor` starts workers on the seeded static policy (WorkerSpec's default),
which cannot close an RL loop; the executor takes the worker command line as a parameter
(`worker_argv`), so this process passes one that patches the WorkerSpec fields given in
`--worker` (e.g. {"weights": "follow", "max_batch": 4}). Config comes from ROSE_* env.
"""

from __future__ import annotations

import argparse
import json
import sys


def patched_worker_argv(overrides: dict, cpus: str = ""):
    """A `worker_argv` for Executor: the stock command with WorkerSpec fields overridden, run on
    the CPU list `cpus` (taskset syntax, "" = any) — the demo's co-served "device" core."""
    from rose.executor.service import worker_command

    def argv(cfg, start, flag_name: str, device: str, seed: int) -> list[str]:
        out = list(worker_command(cfg, start, flag_name, device, seed))
        i = out.index("--spec") + 1
        out[i] = json.dumps({**json.loads(out[i]), **overrides}, separators=(",", ":"))
        return ["taskset", "-c", cpus, *out] if cpus else out

    return argv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rose.demo.executor_node")
    ap.add_argument("--gpus", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-guard", action="store_true")
    ap.add_argument("--worker", default="{}", help="WorkerSpec fields to override, as JSON")
    ap.add_argument("--worker-cpus", default="", help="Run the workers on these CPUs (taskset list)")
    ap.add_argument("--ready-key", default="demo:ready", help="Redis hash (under the key prefix) set when started")
    a = ap.parse_args(argv)
    import redis

    from rose.executor.service import Executor
    from rose.config import load_config
    from rose.kafka.clients import wait_for_broker
    from rose.obs.logs import setup_logging

    setup_logging("INFO")
    cfg = load_config()
    gpus = [g for g in a.gpus.split(",") if g]
    wait_for_broker(cfg.kafka, timeout_s=30)
    ex = Executor(cfg, gpus, device=a.device, guard=not a.no_guard,
                  worker_argv=patched_worker_argv(json.loads(a.worker), a.worker_cpus), log_name="rose.demo.executor")
    ex.start()
    r = redis.Redis.from_url(cfg.redis.url)
    r.hset(cfg.redis.key(a.ready_key), f"executor:{a.gpus}", 1)
    r.close()
    ex.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
