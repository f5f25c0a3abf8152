"""Soak: simulated fleets through agent → scheduler instances → executors: measured event rates, decision latency over all decisions, lag, CPU and memory over time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from rose.bench._stack import percentiles_ms, private_stack
from rose.config import Config, ExecutorConfig
from rose.node.prometheus import Histogram, parse, quantile
from rose.stack import free_port

GOAL_P99_MS = 20.0
PERIOD_S = 0.5  # telemetry period of every simulated GPU: 2 Hz
TICK_S = ExecutorConfig().tick_s  # the executors run at the production main-loop period
PLOT = Path("reports") / "bench-soak.png"
# (GPUs, seconds, executors, scheduler instances) of each fleet
FLEETS = [(1000, 240, 2, 1), (5000, 180, 4, 2)]
QUICK_FLEETS = [(1000, 40, 2, 1)]

NOTES = [
    "schedulers: that many `rose scheduler` instances in one consumer group split the telemetry topic's "
    "partitions (at least one partition per instance), as a scaled-out deployment does",
    "measured: every figure except those named *_modelled; rates are counted on the topics over measured_s "
    "(the span from the first to the last sample, the agent's start-up excluded): telemetry produced = growth of "
    "the telemetry topic's end offsets, consumed = growth of the scheduler group's committed offsets (every "
    "instance's), commands = commands read from the commands topic (read_committed)",
    "decision_latency_ms: every command of the measured window, pooled into one set of percentiles: the event "
    "time of the telemetry that caused it (the command's ts, the record timestamp) to the moment a "
    "read_committed consumer in the bench process reads it (transaction committed, as an executor sees it). "
    "decision_p99_ms_scheduler_histogram: the schedulers' own histogram (telemetry record timestamp to "
    "commit returned), each instance's buckets summed, over the same window, one quantile interpolated within "
    "its buckets (above its top bucket, the top bound: *_above_top_bucket). "
    "decision_latency_until_command_produced_ms: the part of it until the scheduler produced the command in its "
    "transaction (the command's record timestamp); the rest is the commit and the read. The event time is the "
    "agent's schedule (simulation time on the wall clock), so an agent that cannot keep pace adds its growing "
    "delay to both (machine_allows says how far it fell behind)",
    "*_interval_min_max: the lowest and highest value over the sample intervals (sample_s each); where a "
    "figure varies from interval to interval, its range",
    f"executors run at the production main-loop period (executor.tick_s = {TICK_S} s, the default), with "
    "placeholder workers (a `sleep` process per lease) and the local guard off: it polls per-GPU latency "
    "files that simulated serving does not write, so the Kafka path is what is soaked",
    "the agent, the schedulers, the executors, the broker and this process share one machine (cpu_count); "
    "cpu_cores_mean says how much of it each process took, load_average_1m_* how busy the machine was "
    "(above cpu_count, processes waited for a core); machine_allows puts this run's figures together: whether "
    "this machine sustained the fleet (the agent kept pace, the schedulers kept up), at what cost",
]


def _trace() -> str:
    root = Path(os.environ.get("ROSE_TRACES", Path(__file__).resolve().parents[2].parent / "shared" / "traces"))
    return str(root / "azure_llm2023_conv.csv")


class _Offsets:
    """End offsets of the telemetry topic and the scheduler group's committed offsets on it."""

    def __init__(self, cfg: Config, group: str):
        from rose.kafka.admin import partitions_of
        from rose.kafka.consumer import TopicPartition, make_consumer

        topic = cfg.kafka.telemetry_topic
        self.c = make_consumer(cfg.kafka, group)  # never subscribes: reads the group's commits only
        self.tps = [TopicPartition(topic, p) for p in partitions_of(cfg.kafka, topic)]

    def read(self) -> tuple[int, int]:
        """(end offsets, committed offsets), summed over the partitions."""
        end = committed = 0
        for tp in self.c.committed(self.tps, timeout=10):
            _, hi = self.c.get_watermark_offsets(tp, timeout=10)
            end += hi
            committed += max(tp.offset, 0)
        return end, committed

    def close(self) -> None:
        self.c.close()


class _CommandTap:
    """Reads every committed command as an executor does (read_committed) and keeps, per
    command, when it became readable here (wall clock), and how long after the event time of the
    telemetry that caused it (the command's `ts`) the scheduler produced it (the command's record
    timestamp, stamped at produce inside the transaction) and it became readable."""

    def __init__(self, cfg: Config):
        from rose.kafka.admin import partitions_of
        from rose.kafka.consumer import OFFSET_BEGINNING, TopicPartition, make_consumer

        topic = cfg.kafka.commands_topic
        self.c = make_consumer(cfg.kafka, f"{cfg.kafka.topic_prefix}soak-tap", **{"fetch.wait.max.ms": 5})
        self.c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions_of(cfg.kafka, topic)])
        self.seen: list[tuple[float, float, float]] = []  # (readable at, wall s; produced, readable: s after the event)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="soak-command-tap", daemon=True)
        self._t.start()

    def _run(self) -> None:
        from rose.contract.events import Command, InvalidEvent
        from rose.contract.wire import decode
        from rose.kafka.consumer import consume_batch

        while not self._stop.is_set():
            msgs = consume_batch(self.c, 1000, 0.05)
            now = time.time()
            for m in msgs:
                if m.error():
                    continue
                try:
                    cmd = decode(m.value(), expect=Command)
                except InvalidEvent:
                    continue
                self.seen.append((now, m.timestamp()[1] / 1000 - cmd.ts, now - cmd.ts))

    def between(self, t0: float, t1: float) -> dict[str, list[int]]:
        """Latencies (ns) of the commands readable in (t0, t1] (wall clock): `readable` (the
        decision latency), `produced` (its part until the scheduler produced the command)."""
        rows = [r for r in list(self.seen) if t0 < r[0] <= t1]
        return {"produced": [int(r[1] * 1e9) for r in rows], "readable": [int(r[2] * 1e9) for r in rows]}

    def close(self) -> None:
        self._stop.set()
        self._t.join(5)
        self.c.close()


def _decision_hist(ports: list[int]):
    """The schedulers' decision-latency histograms from each instance's /metrics, merged into one
    (cumulative counts summed bucket by bucket); None unless every instance answered with the same
    bounds, since a partial sum would not subtract from the next one."""
    hists: list[Histogram] = []
    for port in ports:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            return None
        h = parse(text).histograms.get("rose_scheduler_decision_latency_seconds")
        if h is None or (hists and h.bounds != hists[0].bounds):
            return None
        hists.append(h)
    return Histogram(
        hists[0].bounds,
        [sum(c) for c in zip(*(h.cumulative for h in hists))],
        sum(h.count for h in hists),
        sum(h.sum for h in hists),
    )


def _hist_p99_ms(now, prev) -> tuple[float | None, bool]:
    """p99 of the decisions the histogram counted since `prev` (histogram delta), and whether it
    lies above the top finite bucket (then the value is that bucket's bound: a lower bound)."""
    if now is None:
        return None, False
    cum = now.cumulative if prev is None else [a - b for a, b in zip(now.cumulative, prev.cumulative)]
    q = quantile(0.99, now.bounds, cum)
    above = len(cum) > 1 and cum[-1] > 0 and cum[-2] < 0.99 * cum[-1]
    return (None if q is None else round(q * 1000, 2)), above


def _rate(a: float, b: float, dt: float) -> float | None:
    return round((b - a) / dt, 1) if dt > 0 else None


def _min_max(rows: list[dict], k: str) -> list[float] | None:
    vals = [r[k] for r in rows if r.get(k) is not None]
    return [min(vals), max(vals)] if vals else None


def _soak(cfg: Config, gpus: int, seconds: float, sample_s: float, executors: int, schedulers: int) -> dict:
    import psutil

    from rose.scheduler.service import SCHEDULER_GROUP

    env = {
        **os.environ,
        "ROSE_KAFKA_BOOTSTRAP": cfg.kafka.bootstrap,
        "ROSE_REDIS_URL": cfg.redis.url,
        "ROSE_KAFKA__TOPIC_PREFIX": cfg.kafka.topic_prefix,
        "ROSE_REDIS__KEY_PREFIX": cfg.redis.key_prefix,
        "ROSE_EXECUTOR__WORKER": "placeholder",
        "ROSE_EXECUTOR__TICK_S": str(TICK_S),
        "ROSE_EXECUTOR__GUARD_PERIOD_S": "0",
        "ROSE_TELEMETRY__PERIOD_S": str(PERIOD_S),
    }
    load_1m = round(os.getloadavg()[0], 2)  # what else ran on the machine as this fleet started
    ports = [free_port() for _ in range(schedulers)]
    rose = [sys.executable, "-m", "rose"]
    ids = [f"soak/{i}" for i in range(gpus)]
    procs: dict[str, subprocess.Popen] = {}
    logs = Path(cfg.stack.data_dir) / "soak-logs"
    logs.mkdir(parents=True, exist_ok=True)

    def spawn(name, argv):
        procs[name] = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(logs / f"{name}-{gpus}.log", "wb"),
            start_new_session=True,
        )

    for i, port in enumerate(ports):
        spawn(
            f"scheduler-{i}",
            rose + ["scheduler", "--instance", f"soak-{i}", "--metrics-port", str(port), "--log-level", "WARNING"],
        )
    for e in range(executors):
        spawn(
            f"executor-{e}",
            rose + ["executor", "--gpus", ",".join(ids[e::executors]), "--no-guard", "--log-level", "WARNING"],
        )
    time.sleep(3)
    tap = _CommandTap(cfg)
    offsets = _Offsets(cfg, f"{cfg.kafka.topic_prefix}{SCHEDULER_GROUP}")
    spawn(
        "agent",
        rose
        + [
            "agent",
            "--simulate",
            _trace(),
            "--gpus",
            str(gpus),
            "--node",
            "soak",
            "--speed",
            "4",
            "--duration",
            str(seconds + 5),
        ],
    )
    ps = {name: psutil.Process(p.pid) for name, p in procs.items()} | {"bench": psutil.Process()}

    def cpu_s(name: str) -> float | None:
        try:
            t = ps[name].cpu_times()
        except psutil.NoSuchProcess:
            return None
        return t.user + t.system

    series: list[dict[str, Any]] = []
    marks: list[dict[str, Any]] = []  # raw counters at each sample, for the window's totals
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < seconds:
            time.sleep(sample_s)
            end, committed = offsets.read()
            mark = {
                "mono": time.monotonic(),
                "wall": time.time(),
                "end": end,
                "committed": committed,
                "hist": _decision_hist(ports),
                "cpu_s": {n: cpu_s(n) for n in ps},
            }
            row: dict[str, Any] = {
                "t_s": round(mark["mono"] - t0, 1),
                "lag_messages": end - committed,
                "load_average_1m": round(os.getloadavg()[0], 2),
            }
            if marks:
                prev = marks[-1]
                dt = mark["mono"] - prev["mono"]
                lat = tap.between(prev["wall"], mark["wall"])["readable"]
                row["telemetry_produced_events_per_s"] = _rate(prev["end"], end, dt)
                row["telemetry_consumed_events_per_s"] = _rate(prev["committed"], committed, dt)
                row["commands_per_s"] = round(len(lat) / dt, 1)
                row["decision_p99_ms"] = percentiles_ms(lat)["p99_ms"]
                for n in ps:
                    a, b = prev["cpu_s"][n], mark["cpu_s"][n]
                    row[f"cpu_cores.{n}"] = None if a is None or b is None else round((b - a) / dt, 3)
            marks.append(mark)
            for name, p in procs.items():
                try:
                    row[f"rss_mb.{name}"] = round(psutil.Process(p.pid).memory_info().rss / 2**20, 1)
                except psutil.NoSuchProcess:
                    row[f"rss_mb.{name}"] = None
            series.append(row)
            print(
                f"[soak {gpus} GPUs] t={row['t_s']:.0f}s lag={row['lag_messages']} "
                f"in={row.get('telemetry_consumed_events_per_s')}/s cmd={row.get('commands_per_s')}/s "
                f"p99={row.get('decision_p99_ms')}ms",
                file=sys.stderr,
                flush=True,
            )
        alive = {n: p.poll() is None for n, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        tap.close()
        offsets.close()
    return {"load_average_1m_at_start": load_1m} | _summary(
        gpus, seconds, executors, schedulers, sample_s, series, marks, tap, alive
    )


def _machine_allows(gpus, schedulers, dt, produced, consumed, ratio, bounded, lag_s, cpu, load) -> str:
    """This run's figures in one line: what a machine of cpu_count cores, as busy as it was,
    sustained with this many scheduler instances. The fleet is sustained when the agent kept
    pace (its shortfall over the span is under one period of telemetry: event time stayed with
    the wall clock) and the schedulers kept up (the lag stayed bounded)."""

    def num(v):
        return "?" if v is None else f"{v:,.0f}"

    offered = gpus / PERIOD_S
    behind_s = (offered - produced) * dt / offered if produced is not None else None
    paced = behind_s is not None and behind_s * offered <= gpus
    plural = "s" if schedulers != 1 else ""
    cores = ", ".join("?" if v is None else f"{v:.2f}" for n, v in cpu.items() if n.startswith("scheduler"))
    fleet = f"{gpus:,} GPUs at {1 / PERIOD_S:g} Hz ({num(offered)} events/s offered)"
    verdict = f"sustains {fleet}" if paced and bounded else f"does not sustain {fleet}"
    agent = (
        "the agent kept pace"
        if paced
        else f"the agent produced {num(produced)}/s, its event time falling {num(behind_s)} s further behind the "
        f"wall clock over the {dt:.0f} s measured"
    )
    return (
        f"a {os.cpu_count()}-core machine (1-minute load average {f'{load[0]:g}–{load[1]:g}' if load else '?'}) "
        f"{verdict} with {schedulers} scheduler instance{plural}: {agent}; the scheduler{plural} "
        f"consumed {num(consumed)}/s of it (ratio {ratio}), lag {'bounded' if bounded else 'growing'} ({lag_s} s "
        f"of telemetry in the second half), taking {cores} cores each"
    )


def _summary(gpus, seconds, executors, schedulers, sample_s, series, marks, tap, alive) -> dict:
    half = len(series) // 2 or 1
    first, second = series[:half], series[half:] or series

    def mean(rows, k):
        vals = [r[k] for r in rows if r.get(k) is not None]
        return sum(vals) / max(1, len(vals))

    names = [k[len("rss_mb.") :] for k in (series[0] if series else {}) if k.startswith("rss_mb.")]
    growth = {}
    for name in names:
        k = f"rss_mb.{name}"
        a, b = mean(first[1:] or first, k), mean(second, k)
        growth[name] = round((b - a) / a, 3) if a else None
    w0, w1 = (marks[0], marks[-1]) if marks else ({}, {})
    dt = w1["mono"] - w0["mono"] if marks else 0.0
    produced = _rate(w0["end"], w1["end"], dt) if dt > 0 else None
    consumed = _rate(w0["committed"], w1["committed"], dt) if dt > 0 else None
    window = tap.between(w0["wall"], w1["wall"]) if dt > 0 else {"produced": [], "readable": []}
    lat, produced_ms = percentiles_ms(window["readable"]), percentiles_ms(window["produced"])
    p99 = lat["p99_ms"]
    hist_p99, hist_above = _hist_p99_ms(w1.get("hist"), w0.get("hist")) if marks else (None, False)
    cpu = {}
    for n in w0.get("cpu_s", {}):
        a, b = w0["cpu_s"][n], w1["cpu_s"][n]
        cpu[n] = None if a is None or b is None else round((b - a) / dt, 3)
    executors_cpu = sum(v or 0.0 for n, v in cpu.items() if n.startswith("executor"))
    lag_second = mean(second, "lag_messages")
    ratio = round(consumed / produced, 3) if produced and consumed is not None else None
    # bounded: the second half's lag is no more than half a second of telemetry above the first's
    bounded = lag_second <= mean(first, "lag_messages") + gpus
    lag_s = round(lag_second / produced, 2) if produced else None
    load = _min_max(series, "load_average_1m")
    return {
        "gpus": gpus,
        "executors": executors,
        "schedulers": schedulers,
        "executor_tick_s": TICK_S,
        "telemetry_period_s": PERIOD_S,
        "seconds": seconds,
        "sample_s": sample_s,
        "measured_s": round(dt, 1),
        "telemetry_offered_events_per_s_modelled": round(gpus / PERIOD_S),
        "telemetry_produced_events_per_s": produced,
        "telemetry_consumed_events_per_s": consumed,
        "commands_per_s": round(lat["n"] / dt, 1) if dt > 0 else None,
        "commands": lat["n"],
        "consumed_over_produced_ratio": ratio,
        "telemetry_consumed_events_per_s_interval_min_max": _min_max(series, "telemetry_consumed_events_per_s"),
        "commands_per_s_interval_min_max": _min_max(series, "commands_per_s"),
        "decision_latency_ms": lat,
        "decision_latency_until_command_produced_ms": produced_ms,
        "decision_p99_ms_interval_min_max": _min_max(series, "decision_p99_ms"),
        "decision_p99_ms_scheduler_histogram": hist_p99,
        "decision_p99_ms_scheduler_histogram_above_top_bucket": hist_above,
        "decision_p99_vs_goal_ratio": round(p99 / GOAL_P99_MS, 2) if p99 is not None else None,
        "lag_messages_first_half_mean": round(mean(first, "lag_messages"), 1),
        "lag_messages_second_half_mean": round(lag_second, 1),
        "lag_messages_max": max((r["lag_messages"] for r in series), default=None),
        "lag_bounded": bounded,
        "lag_seconds_second_half_mean": lag_s,
        "cpu_cores_mean": cpu,
        # what the executors' work costs per GPU they manage (a node's executor has a few GPUs)
        "executor_cpu_ms_per_s_per_gpu": round(1000 * executors_cpu / gpus, 3) if cpu else None,
        "load_average_1m_interval_min_max": load,
        "machine_allows": _machine_allows(gpus, schedulers, dt, produced, consumed, ratio, bounded, lag_s, cpu, load),
        "rss_growth_second_vs_first_half": growth,
        "rss_mb_end": {n: series[-1].get(f"rss_mb.{n}") for n in names} if series else {},
        "processes_alive_at_end": alive,
        "series": series,
    }


def _plot(results: list[dict], out: Path) -> str | None:
    from rose.obs.figures import pyplot, save

    try:
        plt = pyplot()
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for r in results:
        rows = r["series"]
        t = [row["t_s"] for row in rows]
        axes[0].plot(
            t,
            [row["lag_messages"] for row in rows],
            label=f"{r['gpus']} GPUs @ {1 / PERIOD_S:g} Hz, {r['schedulers']} scheduler(s)",
        )
        rated = [row for row in rows if row.get("telemetry_consumed_events_per_s") is not None]
        axes[1].plot(
            [row["t_s"] for row in rated],
            [row["telemetry_consumed_events_per_s"] for row in rated],
            label=f"telemetry consumed ({r['gpus']} GPUs)",
        )
        axes[1].plot(
            [row["t_s"] for row in rated],
            [row["commands_per_s"] for row in rated],
            label=f"commands ({r['gpus']} GPUs)",
        )
        for k in rows[0] if rows else {}:
            if k.startswith("rss_mb.") and (k[7:].startswith("scheduler") or k[7:] in ("agent", "executor-0")):
                axes[2].plot(t, [row[k] for row in rows], label=f"{k[7:]} ({r['gpus']} GPUs)")
    axes[0].set(title="Scheduler consumer lag", xlabel="time (s)", ylabel="messages behind")
    axes[1].set(title="Measured rates", xlabel="time (s)", ylabel="per second")
    axes[2].set(title="Process memory (RSS)", xlabel="time (s)", ylabel="MiB")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return str(save(fig, out))


def run(
    cfg: Config,
    quick: bool = False,
    fleets: list[tuple[int, float, int, int]] | None = None,
    sample_s: float = 5.0,
    plot: Path | None = PLOT,
) -> dict:
    """`fleets`: (GPUs, seconds, executors, scheduler instances) of each run (default 1,000 GPUs ×
    240 s on 2 executors and 1 scheduler, then 5,000 × 180 s on 4 executors and 2 schedulers in one
    group, which split the telemetry partitions; quick: 1,000 × 40 s); `plot`: where the PNG goes
    (None: no plot)."""
    import dataclasses

    results = []
    for gpus, seconds, executors, schedulers in fleets or (QUICK_FLEETS if quick else FLEETS):
        # every instance needs a partition of its own, and no fewer than a deployment has
        with private_stack(cfg, f"soak{gpus}", partitions=max(schedulers, cfg.kafka.partitions)) as c:
            c = dataclasses.replace(c, stack=cfg.stack)
            results.append(_soak(c, gpus, seconds, sample_s=sample_s, executors=executors, schedulers=schedulers))
    return {
        "fleets": results,
        "plot": _plot(results, plot) if plot is not None else None,
        "goal_decision_p99_ms": GOAL_P99_MS,
        "cpu_count": os.cpu_count(),
        "notes": NOTES,
    }
