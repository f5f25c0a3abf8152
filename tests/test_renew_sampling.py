"""Renews are traced and logged one in `tracing.renew_sample_every` (by command id); every
grant, throttle and revoke always. A sampled-out renew still carries a `traceparent`: the
telemetry's trace id, a fresh span id, flags 00 (docs/contract.md §3.3)."""

from __future__ import annotations

import dataclasses

import orjson

from rose.obs.tracing import unsampled_headers


def _traceparent(headers) -> str:
    return next(v.decode() for k, v in headers if k == "traceparent")


def test_unsampled_headers_keep_the_carried_trace_and_mark_it_not_sampled():
    carried = [("traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")]
    a, b = _traceparent(unsampled_headers(carried)), _traceparent(unsampled_headers(carried))
    for tp in (a, b):
        version, trace_id, span_id, flags = tp.split("-")
        assert (version, trace_id, flags) == ("00", "0af7651916cd43dd8448eb211c80319c", "00")
        assert len(span_id) == 16 and span_id != "b7ad6b7169203331" and int(span_id, 16) != 0
    assert a.split("-")[2] != b.split("-")[2], "each message gets its own span id"
    for carried in (None, [], [("traceparent", b"garbage")], [("other", b"x")]):
        version, trace_id, span_id, flags = _traceparent(unsampled_headers(carried)).split("-")
        assert version == "00" and flags == "00" and len(trace_id) == 32 and int(trace_id, 16) != 0


def test_renews_are_sampled_by_command_id_and_every_other_command_is_traced(cfg):
    from opentelemetry import trace

    from rose.contract.wire import encode
    from rose.kafka.consumer import header, read_all
    from rose.kafka.producer import make_producer, produce
    from rose.obs.tracing import inject_headers, memory_exporter, setup_tracing
    from rose.sim.telemetry_workload import workload
    from tests.kafka_checks import run_scheduler_until

    every = 3
    cfg = dataclasses.replace(cfg, tracing=dataclasses.replace(cfg.tracing, renew_sample_every=every))
    setup_tracing(dataclasses.replace(cfg.tracing, exporter="memory"))
    exp = memory_exporter()
    assert exp is not None
    exp.clear()
    events = workload(4, 120, prefix="rs")
    p = make_producer(cfg.kafka)
    with trace.get_tracer("test.agent").start_as_current_span("telemetry.publish") as span:
        trace_id = format(span.get_span_context().trace_id, "032x")
        for ev in events:
            produce(p, cfg.kafka.telemetry_topic, encode(ev), ev.gpu, inject_headers())
    p.flush(10)
    run_scheduler_until(cfg, "rs", len(events))
    msgs = read_all(cfg.kafka, [cfg.kafka.commands_topic])

    cmds = [(orjson.loads(m.value()), header(m, "traceparent").decode()) for m in msgs]
    traced_ids = {s.attributes["rose.command_id"] for s in exp.get_finished_spans() if s.name == "lease.decide"}
    renews = [c for c, _ in cmds if c["kind"] == "renew"]
    assert len(renews) >= 2 * every, "the workload must renew often enough to sample"
    want_traced = {
        c["command_id"] for c, _ in cmds if c["kind"] != "renew" or int(c["command_id"][:8], 16) % every == 0
    }
    assert traced_ids == want_traced
    assert 0 < sum(c["command_id"] in traced_ids for c in renews) < len(renews)
    for c, tp in cmds:
        _, tid, _, flags = tp.split("-")
        assert tid == trace_id, "every command stays in the telemetry's trace"
        assert int(flags, 16) & 1 == (c["command_id"] in traced_ids), (c["kind"], tp)  # the sampled bit
