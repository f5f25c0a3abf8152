"""Telemetry agent: events/s one process publishes for a simulated fleet, CPU µs per event of the real path."""

from __future__ import annotations

import time
import uuid

GOAL_EVENTS_PER_S = 50_000  # a 5,000-GPU fleet at 10 Hz from one process


def _vllm_page(step: int) -> str:
    """A vLLM-sized /metrics page (about 250 samples, two label sets per histogram)."""
    lines = []
    le = [
        "0.001",
        "0.005",
        "0.01",
        "0.02",
        "0.04",
        "0.06",
        "0.08",
        "0.1",
        "0.25",
        "0.5",
        "0.75",
        "1.0",
        "2.5",
        "5.0",
        "7.5",
        "10.0",
        "20.0",
        "40.0",
        "80.0",
        "+Inf",
    ]
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
    ):
        lines += [f"# HELP {name} Histogram of {name}.", f"# TYPE {name} histogram"]
        for model in ("m", "m-lora"):
            cum = 0.0
            for i, b in enumerate(le):
                cum += (step * (i + 1)) % 17 + step
                lines.append(f'{name}_bucket{{le="{b}",model_name="{model}"}} {cum}')
            lines += [f'{name}_sum{{model_name="{model}"}} {cum * 0.05}', f'{name}_count{{model_name="{model}"}} {cum}']
    for g, v in (
        ("vllm:num_requests_running", 7),
        ("vllm:num_requests_waiting", 2),
        ("vllm:gpu_cache_usage_perc", 0.4),
        ("vllm:num_preemptions_total", 1),
    ):
        lines += [f"# TYPE {g} gauge", f'{g}{{model_name="m"}} {v}']
    for reason in ("stop", "length", "abort"):
        lines.append(f'vllm:request_success_total{{finished_reason="{reason}",model_name="m"}} {step * 3}')
    return "\n".join(lines) + "\n"


def _real_path_us_per_event(n: int) -> float:
    from rose.node import prometheus
    from rose.node.telemetry import telemetry_records

    names = prometheus.metric_names("vllm")
    keep = prometheus.all_names(names)
    pages = [_vllm_page(s) for s in range(1, 9)]
    prev = prometheus.parse(pages[0])
    c0 = time.process_time()
    for i in range(n):
        sc = prometheus.parse(pages[(i + 1) % 8], keep)
        w = prometheus.window(sc, prev, 0.5, names)
        prev = sc
        telemetry_records(
            ts=1.7e9 + i,
            node="n",
            gpus=["n/0"],
            pool="serving",
            slo=(1000.0, 100.0),
            run_id="b",
            seq=i,
            util=[0.5],
            mem_total=80 << 30,
            mem_used=[40 << 30],
            rollout_mem=[0],
            ttft_ms=[w.ttft_p99_ms or 0.0],
            tpot_ms=[w.tpot_p99_ms or 0.0],
            rps=[w.rps or 0.0],
            queue=[w.queue_depth or 0],
        )
    return (time.process_time() - c0) / n * 1e6


def run(cfg, quick: bool) -> dict:
    import dataclasses
    from pathlib import Path

    from rose.kafka.admin import wait_for_broker
    from rose.kafka.telemetry_publisher import TelemetryPublisher
    from rose.kafka.topics import create_topics, delete_topics
    from rose.node.simulated_agent import SimOptions, run_simulated
    from rose.sim.traces import TraceError

    gpus = 5000
    windows = 10 if quick else 40
    period = cfg.telemetry.period_s
    trace = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "azure_llm2023_conv.csv"
    out: dict = {"gpus": gpus, "windows": windows, "goal_events_per_s": GOAL_EVENTS_PER_S}
    opt = SimOptions(trace=str(trace), gpus=gpus, duration_s=windows * period, speed=100.0, pace=False)
    try:
        wait_for_broker(cfg.kafka, timeout_s=10)
        kafka = True
    except TimeoutError:
        kafka = False
    try:
        if kafka:
            kcfg = dataclasses.replace(cfg.kafka, topic_prefix=f"bench{uuid.uuid4().hex[:8]}.")
            create_topics(kcfg)
            # the agent's own buffer (`telemetry.buffer_max`), smaller than the run: events the
            # producer cannot keep up with are dropped and counted, as on a node
            pub = TelemetryPublisher.for_config(dataclasses.replace(cfg, kafka=kcfg))
            t0 = time.perf_counter()
            summary = run_simulated(dataclasses.replace(cfg, kafka=kcfg), opt, publisher=pub, follow_leases=False)
            left = pub.flush(60.0)
            dt = time.perf_counter() - t0
            delete_topics(kcfg, [kcfg.telemetry_topic, kcfg.commands_topic, kcfg.lease_state_topic, kcfg.dlq_topic])
            # only what the broker acknowledged counts as published; what the buffer evicted,
            # what failed delivery and what was still held after the flush are reported apart
            events = pub.sent
            out.update(
                events=events,
                events_offered=summary["windows"] * gpus,
                events_per_s=round(events / dt, 1),
                dropped=pub.dropped + pub.failed,
                undelivered_after_flush=left,
                buffer_max=cfg.telemetry.buffer_max,
                ratio_to_goal=round(events / dt / GOAL_EVENTS_PER_S, 3),
                kafka=True,
            )
        else:
            out.update(kafka=False, note="Kafka not reachable; events_per_s not measured")
    except TraceError as e:
        out.update(error=str(e))
    out["real_path_cpu_us_per_event"] = round(_real_path_us_per_event(500 if quick else 3000), 1)
    return out
