"""One lease decision followed in Jaeger: the agent, the scheduler and the executor run as
processes exporting OTLP to the local Jaeger (`rose stack up --jaeger`), and Jaeger's query API
must return one trace that spans rose-agent -> rose-scheduler -> rose-executor with the
OpenTelemetry messaging span names, kinds and attributes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from tests.conftest import TRACES
from tests.processes import terminate_all

pytestmark = [pytest.mark.stack, pytest.mark.timeout(900)]  # the first run may build Jaeger


def _traces(query_url: str, service: str) -> list[dict]:
    q = urllib.parse.urlencode({"service": service, "limit": 200, "lookback": "1h"})
    with urllib.request.urlopen(f"{query_url}/api/traces?{q}", timeout=10) as r:
        return json.loads(r.read())["data"]


def _tags(span: dict) -> dict:
    return {t["key"]: t["value"] for t in span.get("tags", [])}


def _chain(trace: dict, cfg) -> dict | None:
    """The spans of one telemetry -> command -> lease state chain in `trace`, by role, or None."""
    services = {pid: p["serviceName"] for pid, p in trace["processes"].items()}

    def find(service: str, name: str, parent: dict | None = None):
        for s in trace["spans"]:
            if services[s["processID"]] != service or s["operationName"] != name:
                continue
            # Jaeger shows a consumer span's parent, also its link, as one FOLLOWS_FROM reference
            parents = [r["spanID"] for r in s.get("references", [])]
            if parent is None or parent["spanID"] in parents:
                return s
        return None

    k = cfg.kafka
    send_t = find("rose-agent", f"send {k.telemetry_topic}")
    proc_t = send_t and find("rose-scheduler", f"process {k.telemetry_topic}", send_t)
    decide = proc_t and find("rose-scheduler", "lease.decide", proc_t)
    send_c = decide and find("rose-scheduler", f"send {k.commands_topic}", decide)
    proc_c = send_c and find("rose-executor", f"process {k.commands_topic}", send_c)
    apply_ = proc_c and find("rose-executor", "lease.apply", proc_c)
    if not apply_:
        return None
    return {"send_t": send_t, "proc_t": proc_t, "decide": decide, "send_c": send_c, "proc_c": proc_c, "apply": apply_}


def test_one_trace_spans_agent_scheduler_and_executor_in_jaeger(cfg, stack, tmp_path):
    stack.jaeger_up()
    env = {
        **os.environ,
        "ROSE_KAFKA_BOOTSTRAP": cfg.kafka.bootstrap,
        "ROSE_REDIS_URL": cfg.redis.url,
        "ROSE_KAFKA__TOPIC_PREFIX": cfg.kafka.topic_prefix,
        "ROSE_REDIS__KEY_PREFIX": cfg.redis.key_prefix,
        "ROSE_TRACING__EXPORTER": "otlp",
        "ROSE_TRACING__OTLP_ENDPOINT": f"{stack.jaeger_otlp_endpoint}/v1/traces",
        "ROSE_EXECUTOR__WORKER": "placeholder",
        "ROSE_EXECUTOR__LATENCY_DIR": str(tmp_path / "latency"),
    }
    rose = [sys.executable, "-m", "rose"]
    procs = {
        "scheduler": [*rose, "scheduler", "--instance", "jaeger"],
        "executor": [*rose, "executor", "--simulate", "2"],
        "agent": [*rose, "agent", "--simulate", str(TRACES / "azure_llm2023_code.csv"), "--gpus", "2"],
    }
    running = {
        n: subprocess.Popen(a, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{n}.log", "wb"))
        for n, a in procs.items()
    }
    chain, seen = None, 0
    try:
        deadline = time.monotonic() + 120
        while chain is None and time.monotonic() < deadline:
            time.sleep(2)
            for trace in _traces(stack.jaeger_query_url, "rose-executor"):
                seen += 1
                if (chain := _chain(trace, cfg)) is not None:
                    break
    finally:
        exit_s = terminate_all(running)
    logs = {n: (tmp_path / f"{n}.log").read_text(errors="replace")[-500:] for n in procs}
    assert chain is not None, f"no agent -> scheduler -> executor trace among {seen}; logs: {logs}"
    kinds = {role: _tags(s).get("span.kind") for role, s in chain.items()}
    assert kinds["send_t"] == kinds["send_c"] == "producer", kinds
    assert kinds["proc_t"] == kinds["proc_c"] == "consumer", kinds
    for role, topic in (
        ("send_t", cfg.kafka.telemetry_topic),
        ("proc_t", cfg.kafka.telemetry_topic),
        ("send_c", cfg.kafka.commands_topic),
        ("proc_c", cfg.kafka.commands_topic),
    ):
        t = _tags(chain[role])
        assert t["messaging.system"] == "kafka" and t["messaging.destination.name"] == topic, (role, t)
        if role == "send_t":  # the agent sends a window's records as one batch (semconv: no single key)
            assert t["messaging.batch.message_count"] >= 1, t
        else:
            assert "messaging.destination.partition.id" in t and "messaging.kafka.message.key" in t, (role, t)
    for role in ("proc_t", "proc_c"):
        t = _tags(chain[role])
        assert "messaging.kafka.offset" in t and t.get("messaging.consumer.group.name"), (role, t)
    decide = _tags(chain["decide"])
    assert decide["rose.kind"] in ("grant", "renew", "throttle", "revoke")
    assert decide["rose.gpu"].startswith("sim/") and "rose.reason" in decide
    assert "rose.command_id" in _tags(chain["apply"])
    assert max(exit_s.values()) <= 10, exit_s
