"""`rose record` on the real broker: telemetry through the real scheduler, lease states from
an executor's point of view, exported to NDJSON; `rose replay --diff` on that record agrees."""

from __future__ import annotations

import time

import orjson
import pytest
from typer.testing import CliRunner

from rose.cli import app
from rose.kafka.consumer import read_all
from rose.kafka.producer import make_producer, produce_event
from rose.scheduler.service import Scheduler
from rose.sim.telemetry_workload import workload
from tests.examples import lease_state_example

pytestmark = pytest.mark.stack
runner = CliRunner()


def _env(cfg) -> dict[str, str]:
    return {"ROSE_KAFKA_BOOTSTRAP": cfg.kafka.bootstrap, "ROSE_KAFKA__TOPIC_PREFIX": cfg.kafka.topic_prefix}


def test_record_exports_every_topic_and_replay_diff_agrees(cfg, tmp_path):
    k = cfg.kafka
    events = workload(4, 80, prefix="rec")
    p = make_producer(k)
    for ev in events:
        produce_event(p, k.telemetry_topic, ev)
    assert p.flush(30) == 0
    s = Scheduler(cfg, instance="rec")
    try:
        s.start()
        deadline = time.monotonic() + 60
        while s.stats.events < len(events) and time.monotonic() < deadline:
            s.step(0.2)
    finally:
        s.close()
    assert s.stats.events == len(events)
    grants = [orjson.loads(m.value()) for m in read_all(k, [k.commands_topic])]
    grants = [c for c in grants if c["kind"] == "grant"]
    for c in grants:  # what an executor answers
        produce_event(
            p,
            k.lease_state_topic,
            lease_state_example(
                gpu=c["gpu"], lease_id=c["lease_id"], epoch=c["epoch"], ts=c["ts"] + 0.01, command_id=c["command_id"]
            ),
        )
    assert p.flush(30) == 0

    log = tmp_path / "rec.ndjson"
    r = runner.invoke(app, ["record", "--out", str(log), "--timeout", "30"], env=_env(cfg))
    assert r.exit_code == 0, r.output
    recs = [orjson.loads(x) for x in log.read_bytes().splitlines()]
    by_topic: dict[str, list[dict]] = {}
    for rec in recs:
        assert set(rec) == {"topic", "partition", "offset", "timestamp_ms", "key", "headers", "value"}
        assert rec["key"] == rec["value"]["gpu"] and rec["timestamp_ms"] > 0
        by_topic.setdefault(rec["topic"], []).append(rec)
    assert set(by_topic) == {k.telemetry_topic, k.commands_topic, k.lease_state_topic}
    assert len(by_topic[k.telemetry_topic]) == len(events)
    assert len(by_topic[k.lease_state_topic]) == len(grants) > 0
    commands = by_topic[k.commands_topic]
    assert len(commands) > 5 and all(isinstance(c["headers"], dict) for c in commands)
    assert {c["value"]["schema"] for c in commands} == {"rose.command.v1"}
    for topic, rs in by_topic.items():  # per partition, offsets increase
        for part in {r_["partition"] for r_ in rs}:
            offs = [r_["offset"] for r_ in rs if r_["partition"] == part]
            assert offs == sorted(offs), topic
    assert f"{k.commands_topic}: {len(commands)} messages" in r.stderr

    r = runner.invoke(app, ["replay", str(log), "--diff"], env=_env(cfg))
    assert r.exit_code == 0, r.output
    assert f"no divergence: {len(commands)} commands" in r.stdout


def test_record_names_a_missing_topic_in_one_line(cfg, tmp_path):
    r = runner.invoke(
        app, ["record", "--out", str(tmp_path / "x.ndjson"), "--topics", "nosuch", "--timeout", "5"], env=_env(cfg)
    )
    assert r.exit_code == 2
    assert f"cannot read topic {cfg.kafka.topic('nosuch')}" in r.stderr and "Traceback" not in r.stderr
