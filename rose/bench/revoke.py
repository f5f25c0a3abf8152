"""Revoke latency: command through Kafka to the rollout worker paused and to `revoked` published with its memory freed; and the local guard path."""

from __future__ import annotations

import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from rose.bench._stack import engine_lease_bytes, engine_report, last_heartbeat, lease_state, wait_for

if TYPE_CHECKING:
    from rose.contract.records import Heartbeat

GOAL_KAFKA_PAUSED_P99_MS = 20.0
GOAL_GUARD_PAUSED_P99_MS = 2.0
GPU = "sim/0"


def run(cfg, quick: bool) -> dict:
    import psutil
    import redis

    from rose.bench._stack import lease_io, leased_workers, percentiles_ms, private_stack
    from rose.contract.events import Command, Latency
    from rose.contract.wire import encode
    from rose.executor.guard import LatencySample, default_latency_dir, write_latency
    from rose.executor.service import Executor
    from rose.kafka.producer import produce
    from rose.obs.logs import setup_logging
    from rose.rollout.pause_flag import PAUSE, RUN

    setup_logging("WARNING")
    cycles, guard_per_cycle = (3, 3) if quick else (20, 10)
    with private_stack(cfg, "revoke") as c:
        lat_dir = default_latency_dir() / c.kafka.topic_prefix.rstrip(".")
        c = leased_workers(c, "bench-revoke", 400 if quick else 4000, latency_dir=str(lat_dir), guard_period_s=0.0005)
        slo = Latency(ttft_p99=1000.0, tpot_p99=100.0)
        calm = LatencySample(time.time(), Latency(300.0, 30.0), slo)
        spike = LatencySample(time.time(), Latency(300.0, 97.0), slo)  # headroom 0.03 < 0.10
        write_latency(lat_dir, GPU, calm)
        ex = Executor(c, [GPU]).start()
        stop = threading.Event()
        loop = threading.Thread(target=ex.run, args=(stop,), daemon=True)
        loop.start()
        producer, states = lease_io(c)
        k_flag, k_paused, k_revoked, g_flag, g_paused = [], [], [], [], []
        freed = []
        beats: list[Heartbeat | None] = []
        r = redis.Redis.from_url(c.redis.url)
        try:
            for epoch in range(1, cycles + 1):
                now = time.time()
                base: dict[str, Any] = dict(
                    gpu=GPU,
                    lease_id=f"{GPU}#{epoch}",
                    epoch=epoch,
                    mem_bytes=engine_lease_bytes(c),
                    compute_share=0.5,
                    ts=now,
                    expires_at=now + 120,
                    reason="bench",
                    cause_event_id=f"bench-{epoch}",
                )
                produce(
                    producer, c.kafka.commands_topic, encode(Command(command_id=f"g{epoch}", kind="grant", **base)), GPU
                )
                producer.flush(10)
                h = wait_for(
                    lambda: ex.workers.get(GPU) if ex.workers.get(GPU) and ex.workers[GPU].epoch == epoch else None, 30
                )
                flag = h.flag
                beat0 = flag.heartbeat
                wait_for(lambda: flag.heartbeat > beat0 + 50, 600)  # in its decode loop (a cold engine starts first)
                for _ in range(guard_per_cycle):  # the local guard path
                    t0 = time.monotonic_ns()
                    write_latency(lat_dir, GPU, spike)
                    wait_for(lambda: flag.get() == PAUSE and flag.paused_seen_ns > t0, 5)
                    g_flag.append(flag.set_ns - t0)
                    g_paused.append(flag.paused_seen_ns - t0)
                    write_latency(lat_dir, GPU, calm)
                    wait_for(lambda: flag.get() == RUN, 5)
                    b = flag.heartbeat
                    wait_for(lambda: flag.heartbeat > b + 5, 5)
                pid = h.proc.pid
                t0 = time.monotonic_ns()  # the Kafka path: revoke command -> paused -> revoked
                produce(
                    producer,
                    c.kafka.commands_topic,
                    encode(Command(command_id=f"r{epoch}", kind="revoke", **base)),
                    GPU,
                )
                producer.poll(0)
                wait_for(lambda: flag.paused_seen_ns > t0 if flag._buf is not None else True, 10)
                k_flag.append(flag.set_ns - t0)
                k_paused.append(flag.paused_seen_ns - t0)
                revoked = wait_for(lambda: lease_state(states, "revoked", epoch), 15)
                k_revoked.append(time.monotonic_ns() - t0)
                beats.append(last_heartbeat(r, c, f"{socket.gethostname()}:{GPU}:{epoch}"))
                freed.append(revoked.rollout_mem_bytes == 0 and not psutil.pid_exists(pid))
            engine_fields = engine_report(c, beats)
        finally:
            stop.set()
            loop.join(20)
            states.close()
            r.close()
            try:
                (lat_dir / "sim%2F0.json").unlink()
                lat_dir.rmdir()
            except OSError:
                pass
    kp, gp = percentiles_ms(k_paused), percentiles_ms(g_paused)
    return {
        **engine_fields,
        "path": "command→executor",
        "path_note": "the revoke command is produced to rose.commands directly (the scheduler's decision time "
        "is measured by its own bench); t0 is just before produce()",
        "cycles": cycles,
        "kafka_flag_raised_ms": percentiles_ms(k_flag),
        "kafka_worker_paused_ms": kp,
        "kafka_revoked_published_ms": percentiles_ms(k_revoked),
        "memory_freed_fraction": sum(freed) / len(freed) if freed else None,
        "guard_flag_raised_ms": percentiles_ms(g_flag),
        "guard_worker_paused_ms": gp,
        "goal_kafka_paused_p99_ms": GOAL_KAFKA_PAUSED_P99_MS,
        "kafka_paused_p99_over_goal": round(kp["p99_ms"] / GOAL_KAFKA_PAUSED_P99_MS, 3) if kp["n"] else None,
        "goal_guard_paused_p99_ms": GOAL_GUARD_PAUSED_P99_MS,
        "guard_paused_p99_over_goal": round(gp["p99_ms"] / GOAL_GUARD_PAUSED_P99_MS, 3) if gp["n"] else None,
        "revoke_deadline_s": c.executor.revoke_deadline_s,
        "note": "paused = the worker itself recorded that it saw the flag (it checks between decode steps); "
        "revoked = the `revoked` lease state read back from Kafka, worker process gone, rollout_mem_bytes 0",
    }
