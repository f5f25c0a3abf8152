"""Telemetry events/s through one scheduler process vs raw consume+decode, and decision latency."""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import os
import queue
import time
from collections import Counter

from rose.bench._stack import private_stack
from rose.config import Config
from rose.contract.events import Telemetry
from rose.contract.wire import decode, encode
from rose.obs.stats import percentile
from rose.sim.telemetry_workload import workload

GOAL_EVENTS_PER_S = 100_000
GOAL_RATIO = 0.6  # scheduler events/s over raw consume+decode of the same messages
GOAL_P99_MS = 20.0
INSTANCES = (1, 2, 4)  # scheduler processes of the scale-out part, one consumer group


def _fill(cfg: Config, events) -> None:
    from rose.kafka.producer import make_producer, produce

    p = make_producer(cfg.kafka, **{"linger.ms": 20})
    topic = cfg.kafka.telemetry_topic
    for ev in events:
        produce(p, topic, encode(ev), ev.gpu)
    p.flush(60)


def _raw_rate(cfg: Config, n: int) -> float:
    """Consume and decode the same messages, no decisions: the ceiling for the scheduler. Timed
    as `_scheduler_rate` is: from the end of the first batch to the end of the last, over the
    events in between."""
    from rose.kafka.consumer import make_consumer

    c = make_consumer(cfg.kafka, f"{cfg.kafka.topic_prefix}raw", **{"fetch.wait.max.ms": 5})
    c.subscribe([cfg.kafka.telemetry_topic])
    got, got0, t0 = 0, 0, None
    deadline = time.monotonic() + 120
    while got < n and time.monotonic() < deadline:
        for m in c.consume(5000, timeout=0.2):
            if m.error():
                continue
            decode(m.value(), Telemetry)
            got += 1
        if got and t0 is None:
            t0, got0 = time.perf_counter(), got
    dt = time.perf_counter() - (t0 or time.perf_counter())
    c.close()
    return (got - got0) / dt if dt > 0 else 0.0


def _scheduler_rate(cfg: Config, n: int) -> tuple[float, int, float]:
    """The scheduler's rate, from the end of its first batch to the end of the last, over the
    events in between (as `_raw_rate`)."""
    from rose.scheduler.service import Scheduler

    s = Scheduler(cfg, instance="bench-throughput", batch_max=10000)
    s.start()
    t0, got0 = None, 0
    deadline = time.monotonic() + 180
    try:
        while s.stats.events < n and time.monotonic() < deadline:
            if s.step(0.2) and t0 is None:
                t0, got0 = time.perf_counter(), s.stats.events
        dt = time.perf_counter() - (t0 or time.perf_counter())
    finally:
        s.close()
    per_traced_us = 1e6 * s.stats.traced_s / s.stats.traced_commands if s.stats.traced_commands else 0.0
    return ((s.stats.events - got0) / dt if dt > 0 else 0.0), s.stats.commands, per_traced_us


def _instance(cfg: Config, name: str, group: str, total: int, consumed, out, ready, joined_all) -> None:
    """One scheduler process of the scale-out bench: join the group with its partitions paused
    until all instances hold partitions (`joined_all`, shared; else the first to join would
    drain the topic alone), then step until the group has consumed `total` events (`consumed`,
    shared); report when it joined and its own (time, events) after each batch."""
    from rose.obs.logs import setup_logging
    from rose.scheduler.service import Scheduler

    setup_logging("WARNING")  # as `rose bench` runs the in-process instances
    s = Scheduler(cfg, instance=name, group=group, batch_max=10000)
    ready.wait(120)  # every instance imported and built: they join the group together
    s.start()
    counted = False

    def whole(held: bool) -> bool:
        nonlocal counted
        if held and not counted:
            counted = True
            with joined_all.get_lock():
                joined_all.value += 1
        return joined_all.value >= ready.parties

    marks = []
    deadline = time.monotonic() + 240
    try:
        joined = s.join_paused(whole, timeout_s=240)
        while consumed.value < total and time.monotonic() < deadline:
            n = s.step(0.1)
            if n:
                with consumed.get_lock():
                    consumed.value += n
                marks.append((time.time(), n))
    finally:
        s.close()
    out.put({"name": name, "joined": joined, "marks": marks})


def _collect(q, procs, timeout_s: float) -> list[dict]:
    """Each process's report; RuntimeError naming the exit code of one that died without one."""
    reports: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while len(reports) < len(procs) and time.monotonic() < deadline:
        try:
            reports.append(q.get(timeout=1.0))
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"scale-out instance exited with code {dead[0].exitcode} without a report") from None
    for p in procs:
        p.join(30)
    if len(reports) < len(procs):
        raise RuntimeError(f"scale-out: {len(procs) - len(reports)} instance(s) gave no report in {timeout_s:.0f} s")
    return reports


def _scale_out(cfg: Config, n_gpus: int, n_ticks: int, instances: tuple[int, ...], partitions: int) -> dict:
    """Events/s of k scheduler processes in one consumer group over a topic of `partitions`
    partitions, filled before they start; counted from the moment the last of them holds
    partitions (before that the first joiner consumes alone) to the last event."""
    ctx = multiprocessing.get_context("spawn")
    out: dict = {}
    for k in instances:
        with private_stack(cfg, f"scale{k}", partitions=partitions) as c:
            events = workload(n_gpus, n_ticks, seed=2, prefix=f"scale{k}")
            _fill(c, events)
            consumed, q, ready, joined_all = ctx.Value("q", 0), ctx.Queue(), ctx.Barrier(k), ctx.Value("i", 0)
            procs = [
                ctx.Process(
                    target=_instance,
                    args=(
                        c,
                        f"scale-{k}-{i}",
                        f"{c.kafka.topic_prefix}group",
                        len(events),
                        consumed,
                        q,
                        ready,
                        joined_all,
                    ),
                )
                for i in range(k)
            ]
            for pr in procs:
                pr.start()
            reports = _collect(q, procs, timeout_s=300)
        joined = [r["joined"] for r in reports]
        if any(j is None for j in joined):
            out[str(k)] = {"events_per_s": None, "reason": "an instance never held a partition"}
            continue
        t_all = max(joined)
        after = [(t, n) for r in reports for t, n in r["marks"] if t >= t_all]
        end = max((t for t, _ in after), default=t_all)
        n_after = sum(n for _, n in after)
        out[str(k)] = {
            "events_per_s": round(n_after / (end - t_all)) if end > t_all else None,
            "events_measured": n_after,
            "events_before_all_joined": len(events) - n_after,
            # per instance; their sum exceeds the events only where a batch was redone after a rebalance
            "events_per_instance": sorted(sum(n for _, n in r["marks"]) for r in reports),
        }
    one = (out.get("1") or {}).get("events_per_s")
    for v in out.values():
        r = v.get("events_per_s")
        v["speedup_vs_1"] = round(r / one, 2) if r and one else None
    return out


def _feed(cfg: Config, n_gpus: int, ticks: int, rate_per_s: int) -> None:
    """The latency bench's telemetry source: a tick of every GPU's event at `rate_per_s`."""
    from rose.kafka.producer import make_producer, produce

    events = workload(n_gpus, ticks, seed=5, prefix="lat")
    p = make_producer(cfg.kafka)
    # connected, with the topic's metadata, before the first tick: an agent is a long-running
    # producer, and a record stamped before its producer could send is not decision latency
    p.list_topics(cfg.kafka.telemetry_topic, timeout=10)
    for i in range(ticks):
        t_next = time.perf_counter() + n_gpus / rate_per_s
        for ev in events[i * n_gpus : (i + 1) * n_gpus]:
            produce(p, cfg.kafka.telemetry_topic, encode(ev), ev.gpu)
        p.flush(5)
        time.sleep(max(0.0, t_next - time.perf_counter()))


def _latency(cfg: Config, rate_per_s: int, seconds: float) -> dict:
    """Decision latency at moderate load: record timestamp of the telemetry to the commit of
    its command, with the scheduler keeping up (not draining a backlog). The telemetry comes
    from another process, as it does from agents: a feeder thread would share the
    scheduler's interpreter lock and its time would count as decision latency."""

    from rose.scheduler.service import Scheduler

    s = Scheduler(cfg, instance="bench-latency", group="rose-scheduler-latency", batch_max=2000, record_latencies=True)
    s.start()
    deadline = time.monotonic() + 60
    while not s.consumer.assignment() and time.monotonic() < deadline:  # joined before the load starts
        s.step(0.1)
    for _ in range(5):
        s.step(0.1)
    n_gpus = 200
    ticks = int(seconds * rate_per_s / n_gpus)
    feeder = multiprocessing.get_context("spawn").Process(
        target=_feed, args=(cfg, n_gpus, ticks, rate_per_s), daemon=True
    )
    feeder.start()
    try:
        while feeder.is_alive():
            s.step(0.01)
        while s.step(0.2):
            pass
    finally:
        feeder.join(10)
        s.close()
    lat_ms = [x * 1000 for x in s.stats.latencies_s]
    if not lat_ms:
        return {"p50_ms": None, "p99_ms": None, "commands": 0}
    parts = s.stats.latency_parts_s
    return {
        "p50_ms": percentile(lat_ms, 0.5, 3),
        "p99_ms": percentile(lat_ms, 0.99, 3),
        "commands": len(lat_ms),
        "load_events_per_s": rate_per_s,
        # each command's latency in three parts, each part's own percentiles: the telemetry's
        # record time to the consume that returned it (producer linger, broker append, fetch,
        # and the previous batch still in the scheduler), its batch's processing, the commit
        "parts_ms": {
            name: {
                "p50": percentile([p[i] * 1000 for p in parts], 0.5, 3),
                "p99": percentile([p[i] * 1000 for p in parts], 0.99, 3),
            }
            for i, name in enumerate(("until_consumed", "processing", "commit"))
        },
        "transactions": s.stats.transactions,
        "feeder_exit": feeder.exitcode,
    }


def _pure_rate(cfg: Config, events) -> dict:
    """decode + the core's apply (admit, decide) over the same messages in this process, without Kafka and
    without spans: what the per-event Python work alone allows one process."""

    from rose.policy.core import Arrival, Batch, SchedulingCore

    records = [(encode(ev), ev.gpu.encode(), int(ev.ts * 1000)) for ev in events]
    kinds: Counter[str] = Counter()
    runs = []
    for _ in range(3):  # the headline is the first, one run like each Kafka figure; all three show the spread
        core = SchedulingCore(cfg.policy)
        kinds.clear()
        t0 = time.perf_counter()
        for value, key, ts_ms in records:
            for c in core.apply(Batch(telemetry=(Arrival(decode(value, Telemetry), ts_ms, key),))).commands:
                kinds[c.kind] += 1
        runs.append(round(len(records) / (time.perf_counter() - t0)))
    return {"events_per_s": runs[0], "runs_events_per_s": runs, "commands_by_kind": dict(kinds)}


def run(cfg: Config, quick: bool = False) -> dict:
    n_gpus, n_ticks = (200, 100) if quick else (1000, 200)
    with private_stack(cfg, "sched") as c:
        c = dataclasses.replace(c, kafka=dataclasses.replace(c.kafka, partitions=1))
        events = workload(n_gpus, n_ticks, seed=1, prefix="bench")
        n = len(events)
        t0 = time.perf_counter()
        _fill(c, events)
        fill_s = time.perf_counter() - t0
        raw = _raw_rate(c, n)
        sched, commands, per_traced_us = _scheduler_rate(c, n)
    pure = _pure_rate(cfg, events)
    # the latency part's scheduler runs in this process: without the workload's million objects,
    # whose traversal by Python's full collections would stall it as a real scheduler never is
    del events
    gc.collect()
    with private_stack(cfg, "lat") as c:
        latency = _latency(c, rate_per_s=2000 if quick else 5000, seconds=3 if quick else 8)
    cores = os.cpu_count() or 1
    scale = _scale_out(cfg, n_gpus, n_ticks * (1 if quick else 2), INSTANCES, partitions=max(INSTANCES))
    out = {
        "events": n,
        "gpus": n_gpus,
        "commands": commands,
        "produce_events_per_s": round(n / fill_s),
        "raw_consume_decode_events_per_s": round(raw),
        "scheduler_events_per_s": round(sched),
        "policy_alone_events_per_s": pure["events_per_s"],
        "policy_alone_runs_events_per_s": pure["runs_events_per_s"],
        "commands_by_kind": pure["commands_by_kind"],
        "renew_sample_every": cfg.tracing.renew_sample_every,
        # an event's commands with their spans (process, lease.decide, send) and log lines, per command
        "traced_command_us": round(per_traced_us, 1),
        "scheduler_vs_raw_ratio": round(sched / raw, 3) if raw else None,
        "goal_scheduler_vs_raw_ratio": GOAL_RATIO,
        "scheduler_vs_goal_events_per_s_ratio": round(sched / GOAL_EVENTS_PER_S, 3),
        "goal_events_per_s": GOAL_EVENTS_PER_S,
        "decision_latency": latency,
        "decision_latency_p99_vs_goal_ratio": (
            round(latency["p99_ms"] / GOAL_P99_MS, 3) if latency.get("p99_ms") is not None else None
        ),
        "goal_decision_latency_p99_ms": GOAL_P99_MS,
        "scale_out": {
            "instances": scale,
            "partitions": max(INSTANCES),
            "cpus": cores,
            "note": "k scheduler processes in one consumer group; the broker and every instance share the "
            f"machine's {cores} cores, so throughput can scale at most to what the cores leave the instances",
        },
        "note": "throughput and latency: one process, one partition, local single-node broker on the same "
        "machine as the producer; scheduler and raw consume+decode each one run, timed from the end of their "
        "first batch to the end of the last; policy_alone: decode + admit + decide() over the same events in "
        "the bench process, no Kafka and no spans, one run (runs_events_per_s: it and two more)",
    }
    out["goals_not_met"] = _not_met(out)
    return out


def _not_met(out: dict) -> dict[str, str]:
    """Each goal this run missed, with what holds it back, from this run's own figures."""
    missed: dict[str, str] = {}
    sched, pure, raw = (
        out["scheduler_events_per_s"],
        out["policy_alone_events_per_s"],
        out["raw_consume_decode_events_per_s"],
    )
    kinds = out["commands_by_kind"]
    traced = sum(n for k, n in kinds.items() if k != "renew") + kinds.get("renew", 0) / max(
        1, out["renew_sample_every"]
    )
    cores = out["scale_out"]["cpus"]
    why_rate = (
        f"the policy alone (decode + decide, no Kafka, no spans) ran {pure} ev/s in this process; consuming, "
        f"producing {out['commands']} commands and the views' changelog, and the spans of about {traced:.0f} traced "
        f"commands ({3 * traced / max(1, out['events']):.2f} spans an event) take the rest, on {cores} cores "
        "shared with the broker and its fetches"
    )
    if sched < GOAL_EVENTS_PER_S:
        missed["scheduler_events_per_s"] = f"{sched} of {GOAL_EVENTS_PER_S}: " + why_rate
    if raw and sched / raw < GOAL_RATIO:
        missed["scheduler_vs_raw_ratio"] = f"{sched / raw:.3f} of {GOAL_RATIO}: " + why_rate
    lat = out["decision_latency"]
    p99 = lat.get("p99_ms")
    if p99 is not None and p99 > GOAL_P99_MS:
        parts = lat.get("parts_ms", {})
        worst = max(parts, key=lambda k: parts[k]["p99"] or 0.0) if parts else None
        missed["decision_latency_p99_ms"] = (
            f"{p99} ms over {GOAL_P99_MS} ms: per part p99 "
            + ", ".join(f"{k} {v['p99']} ms" for k, v in parts.items())
            + (f"; {worst} holds it back most" if worst else "")
            + f"; a traced command (grant, throttle, revoke) took {out['traced_command_us']} µs of spans and log "
            "line, and a tick of the fleet can bring one for every GPU into one batch"
        )
    return missed
