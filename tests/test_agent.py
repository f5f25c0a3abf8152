"""`rose agent`: simulated serving nodes on the real local Kafka, lease following, NVML absence."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rose.config import GiB
from rose.contract.events import LEASE_KINDS, LEASE_STATES, SERVING_STATES, Telemetry
from rose.kafka.consumer import header, read_all
from rose.kafka.producer import make_producer, produce_event
from rose.node.lease_view import REPLICA_ONLY_STATES, LeaseView, serving_state_of
from rose.node.simulated_agent import SimOptions, run_simulated
from rose.node.telemetry import telemetry_records
from tests.examples import command_example, lease_state_example

REPO = Path(__file__).resolve().parent.parent


def agent_env(cfg) -> dict:
    return {
        **os.environ,
        "ROSE_KAFKA_BOOTSTRAP": cfg.kafka.bootstrap,
        "ROSE_KAFKA__TOPIC_PREFIX": cfg.kafka.topic_prefix,
    }


def telemetry_by_gpu(cfg):
    import jsonschema

    schema = json.loads((REPO / "schemas" / "rose.telemetry.v1.json").read_text())
    by_gpu = defaultdict(list)
    for m in read_all(cfg.kafka, [cfg.kafka.telemetry_topic]):
        d = json.loads(m.value())
        jsonschema.validate(d, schema)
        ev = Telemetry.from_dict(d)
        assert m.key().decode() == ev.gpu
        assert header(m, "traceparent") is not None
        assert m.timestamp()[1] == int(ev.ts * 1000)  # record time is the event time
        by_gpu[ev.gpu].append(ev)
    return by_gpu


@pytest.mark.stack
def test_simulated_agent_fills_the_topic(cfg, traces_dir):
    t0 = time.time()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rose",
            "agent",
            "--simulate",
            str(traces_dir / "azure_llm2023_conv.csv"),
            "--gpus",
            "8",
            "--duration",
            "10",
        ],
        env=agent_env(cfg),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert time.time() - t0 < 30
    by_gpu = telemetry_by_gpu(cfg)
    assert sorted(by_gpu) == [f"sim/{i}" for i in range(8)]
    per_gpu = 10 / cfg.telemetry.period_s
    for gpu, evs in by_gpu.items():
        assert abs(len(evs) - per_gpu) <= 1, (gpu, len(evs))
        ts = [e.ts for e in evs]
        assert ts == sorted(ts) and len(set(ts)) == len(ts)  # in order per GPU
        assert all(e.node == "sim" and e.slo_ms.ttft_p99 == cfg.telemetry.slo_ttft_ms for e in evs)
    assert sum(e.rps for evs in by_gpu.values() for e in evs) > 0  # the trace's requests arrived
    summary = json.loads(r.stderr.strip().splitlines()[-1])["agent"]
    assert summary["dropped"] == 0 and summary["undelivered"] == 0 and summary["sent"] == 8 * per_gpu


def test_an_unreadable_interference_profile_is_one_line_and_exit_2(tmp_path, traces_dir):
    bad = tmp_path / "profile.json"
    bad.write_text(json.dumps({**FIVEFOLD, "points": [{"share": 0.5}]}))
    env = {**os.environ, "ROSE_TELEMETRY__INTERFERENCE_PROFILE": str(bad), "ROSE_KAFKA_BOOTSTRAP": "127.0.0.1:9"}
    r = subprocess.run(
        [sys.executable, "-m", "rose", "agent", "--simulate", str(traces_dir / "azure_llm2023_conv.csv")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 2, r.stderr[-600:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "telemetry.interference_profile" in lines[0] and "serving_p99_ratio" in lines[0]


def test_nvml_absent_is_one_line_and_nonzero():
    try:
        import pynvml

        pynvml.nvmlInit()
        pytest.skip("NVML works on this machine")
    except Exception:  # noqa: BLE001 - any NVML failure is the case under test
        pass
    r = subprocess.run(
        [sys.executable, "-m", "rose", "agent", "--nvml", "--metrics-url", "http://127.0.0.1:9/metrics"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "NVML" in lines[0] and "Traceback" not in r.stderr


class Collect:
    """A publisher that keeps events in memory (to compare runs window by window)."""

    def __init__(self):
        self.events: list[dict] = []
        self.producer = None

    def publish(self, recs, headers=None, ts_ms=0):
        self.events += [json.loads(v) for v, _k in recs]

    def tick(self):
        pass

    def counters(self):
        return {"sent": len(self.events), "dropped": 0, "buffered": 0}


def test_lease_view_state_and_share():
    v = LeaseView(default_share=0.5)
    v.on_lease_state(lease_state_example(gpu="sim/0", lease_id="L1", epoch=1, state="active", rollout_mem_bytes=GiB))
    assert v.rollout("sim/0") == (0.5, True, GiB)  # grant not seen: the policy's max share
    v.on_command(command_example(gpu="sim/0", lease_id="L1", compute_share=0.2))
    assert v.rollout("sim/0") == (0.2, True, GiB)
    # v1.1: a throttle to 0 pauses (memory held, nothing runs); a throttle up resumes at its share
    v.on_command(command_example(gpu="sim/0", lease_id="L1", kind="throttle", compute_share=0.0))
    v.on_lease_state(
        lease_state_example(gpu="sim/0", lease_id="L1", epoch=1, state="paused", ts=1.7e9 + 1, rollout_mem_bytes=GiB)
    )
    assert v.rollout("sim/0") == (0.0, False, GiB)
    v.on_command(command_example(gpu="sim/0", lease_id="L1", kind="throttle", compute_share=0.35))
    v.on_lease_state(
        lease_state_example(gpu="sim/0", lease_id="L1", epoch=1, state="active", ts=1.7e9 + 2, rollout_mem_bytes=GiB)
    )
    assert v.rollout("sim/0") == (0.35, True, GiB)
    v.on_lease_state(lease_state_example(gpu="sim/0", lease_id="L1", epoch=1, state="revoked", ts=2e9))
    assert v.rollout("sim/0") == (0.0, False, 0)
    v.on_lease_state(lease_state_example(gpu="sim/0", lease_id="L0", epoch=0, state="active", ts=3e9))
    assert v.rollout("sim/0") == (0.0, False, 0)  # an older epoch does not override


@given(st.sampled_from(LEASE_KINDS), st.sampled_from((None, *LEASE_STATES)))
def test_every_lease_state_is_one_serving_state(kind, state):
    got = serving_state_of(kind, state)
    assert got in SERVING_STATES
    if kind == "coresident" or state in (None, "revoked", "expired", "rejected"):
        assert got == "serving"  # a co-resident lease keeps serving; a replica lease's end serves again
    else:
        assert got == {"draining": "draining", "reclaiming": "reclaiming"}.get(state, "lent")


@given(st.lists(st.tuples(st.sampled_from([s for s in LEASE_STATES if s not in REPLICA_ONLY_STATES]), st.booleans())))
def test_a_coresident_lease_never_changes_serving_state(steps):
    """Co-resident leases granted, throttled and moved through every state they can have: the GPU's
    replica serves throughout."""
    v = LeaseView()
    for n, (state, grant) in enumerate(steps):
        if grant:
            v.on_command(command_example(gpu="g", lease_id=f"L{n}", kind="grant"))
        v.on_lease_state(lease_state_example(gpu="g", lease_id=f"L{n // 2}", epoch=n // 2, state=state, ts=n))
        assert v.serving_state("g") == "serving"


def test_lease_view_knows_a_replica_lease_by_its_grant_or_its_states():
    v = LeaseView()
    v.on_lease_state(lease_state_example(gpu="g", lease_id="R1", state="active", ts=1.0))
    assert v.serving_state("g") == "serving"  # kind not known yet: nothing says it is lent
    v.on_command(command_example(gpu="g", lease_id="R1", lease_kind="replica"))
    assert v.serving_state("g") == "lent"
    v.on_lease_state(lease_state_example(gpu="g", lease_id="R2", epoch=2, state="reclaiming", ts=2.0))
    assert v.serving_state("g") == "reclaiming"  # only a replica lease reclaims: no grant needed
    v.on_lease_state(lease_state_example(gpu="g", lease_id="R2", epoch=2, state="revoked", ts=3.0))
    assert v.serving_state("g") == "serving" and v.serving_state("other") == "serving"


def test_records_name_a_replica_and_its_state_only_where_not_the_default():
    recs = telemetry_records(
        ts=1.7e9, node="n", gpus=["n/0", "n/1", "n/2"], pool="serving", slo=(1000.0, 100.0), run_id="r", seq=0,
        util=[0.5] * 3, mem_total=80 * GiB, mem_used=[GiB] * 3, rollout_mem=[0] * 3, ttft_ms=[1.0] * 3,
        tpot_ms=[1.0] * 3, rps=[0.0] * 3, queue=[0] * 3,
        replica={"n/0": "a", "n/1": "a", "n/2": "n/2"}, serving_state=["lent", "serving", "serving"],
    )  # fmt: skip
    ds = [json.loads(v) for v, _ in recs]
    assert [(d.get("replica"), d.get("serving_state")) for d in ds] == [("a", "lent"), ("a", None), (None, None)]
    evs = [Telemetry.from_dict(d) for d in ds]
    assert [(e.replica_id, e.serving_state) for e in evs] == [("a", "lent"), ("a", "serving"), ("n/2", "serving")]


def test_simulated_tensor_parallel_gpus_name_their_replica():
    from rose.node.simulated_agent import tensor_parallel_replicas

    gpus = [f"sim/{i}" for i in range(4)]
    assert tensor_parallel_replicas(gpus, 2) == {"sim/0": "sim/0", "sim/1": "sim/0", "sim/2": "sim/2", "sim/3": "sim/2"}
    assert tensor_parallel_replicas(gpus, 1) == {g: g for g in gpus}  # each its own: the field stays off


@pytest.mark.parametrize(
    "args, names",
    [
        (["--nvml", "--metrics-url", "http://127.0.0.1:9/metrics", "--replica", "n/0"], "'n/0'"),
        (["--nvml", "--metrics-url", "http://127.0.0.1:9/metrics", "--replica", "=a"], "'=a'"),
        (["--simulate", "trace.csv", "--replica", "sim/0=a"], "--nvml"),
    ],
)
def test_a_malformed_replica_is_one_line_and_exit_2(args, names):
    r = subprocess.run([sys.executable, "-m", "rose", "agent", *args], capture_output=True, text=True, timeout=60)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-600:]
    assert lines[0].startswith("rose: --replica") and names in lines[0]


def test_records_validate():
    recs = telemetry_records(
        ts=1.7e9,
        node="n",
        gpus=["n/0", "n/1"],
        pool="serving",
        slo=(1000.0, 100.0),
        run_id="r",
        seq=3,
        util=[0.5, 2.0],
        mem_total=80 * GiB,
        mem_used=[GiB, 2 * GiB],
        rollout_mem=[0, 5 * GiB],
        ttft_ms=[1.0, 2.0],
        tpot_ms=[3.0, 4.0],
        rps=[0.0, 1.5],
        queue=[0, 2],
    )
    evs = [Telemetry.from_dict(json.loads(v)) for v, _ in recs]
    assert [k for _, k in recs] == [b"n/0", b"n/1"]
    assert evs[1].gpu_util == 1.0 and evs[1].rollout_mem_bytes == 2 * GiB and evs[0].event_id != evs[1].event_id


FIVEFOLD = {  # a profile whose serving ratios are 5 at every share
    "schema": "rose.interference_profile.v1",
    "mechanism": "separate_process",
    "source": "a test's",
    "points": [{"share": 0.5, "serving_p99_ratio": 5.0, "serving_mean_ratio": 5.0, "rollout_fraction": 0.1}],
}


@pytest.mark.stack
@pytest.mark.parametrize("profile", [None, FIVEFOLD], ids=["linear", "profile"])
def test_active_lease_adds_interference_and_revoke_restores(cfg, traces_dir, tmp_path, profile):
    """Under a lease a simulated GPU slows by the linear model of telemetry.interference_alpha
    (1: × 1.5 at share 0.5), or by telemetry.interference_profile's ratios when one is set."""
    slower = 1.2
    if profile is not None:
        (tmp_path / "profile.json").write_text(json.dumps(profile))
        cfg = dataclasses.replace(
            cfg, telemetry=dataclasses.replace(cfg.telemetry, interference_profile=str(tmp_path / "profile.json"))
        )
        slower = 3.0  # above what the linear model (× 1.5) could give
    trace = str(traces_dir / "azure_llm2023_conv.csv")
    opt = SimOptions(trace=trace, gpus=2, duration_s=6.0)
    base = Collect()
    run_simulated(cfg, opt, publisher=base, follow_leases=False)

    p = make_producer(cfg.kafka)
    produce_event(p, cfg.kafka.commands_topic, command_example(gpu="sim/0", lease_id="L1", compute_share=0.5))
    produce_event(
        p,
        cfg.kafka.lease_state_topic,
        lease_state_example(
            gpu="sim/0", lease_id="L1", epoch=1, state="active", rollout_mem_bytes=8 * GiB, ts=time.time()
        ),
    )
    p.flush(10)

    def revoke_later():
        time.sleep(3.0)
        produce_event(
            p,
            cfg.kafka.lease_state_topic,
            lease_state_example(
                gpu="sim/0", lease_id="L1", epoch=1, state="revoked", rollout_mem_bytes=0, ts=time.time()
            ),
        )
        p.flush(10)

    th = threading.Thread(target=revoke_later)
    th.start()
    lent = Collect()
    run_simulated(cfg, opt, publisher=lent)
    th.join()
    b0 = [e for e in base.events if e["gpu"] == "sim/0"]
    l0 = [e for e in lent.events if e["gpu"] == "sim/0"]
    held = [i for i, e in enumerate(l0) if e["rollout_mem_bytes"] == 8 * GiB]
    assert held and held[0] <= 2, "the lease was not followed within a window or two"
    after = [i for i in range(held[-1] + 1, len(l0))]
    assert len(after) >= 3, "the revoke was not followed"
    for i in held:
        assert l0[i]["latency_ms"]["tpot_p99"] > slower * b0[i]["latency_ms"]["tpot_p99"]
        assert l0[i]["mem_used_bytes"] >= b0[i]["mem_used_bytes"] + 8 * GiB - GiB
        assert l0[i]["gpu_util"] >= b0[i]["gpu_util"]
    for i in after[2:]:  # revoke restores latency (the trace is light: no backlog to drain)
        assert l0[i]["latency_ms"]["tpot_p99"] == pytest.approx(b0[i]["latency_ms"]["tpot_p99"], rel=0.05)
        assert l0[i]["rollout_mem_bytes"] == 0
    b1 = [e["latency_ms"] for e in base.events if e["gpu"] == "sim/1"]
    assert b1 == [e["latency_ms"] for e in lent.events if e["gpu"] == "sim/1"]  # other GPU untouched


def test_simulated_agent_feeds_the_local_guard(tmp_path, traces_dir):
    """`--feed-guard`: each window's p99 lands where the executor's guard reads it."""
    from rose.executor.guard import FileLatencySource
    from rose.node.telemetry import feed_guard

    feed_guard(str(tmp_path), ["sim/0", "sim/1"], 1000.0, [120.0, 900.0], [10.0, 95.0], (1000.0, 100.0))
    src = FileLatencySource(tmp_path)
    a, b = src("sim/0"), src("sim/1")
    assert a.latency_ms.ttft_p99 == 120.0 and a.headroom > 0.8
    assert b.headroom < 0.1  # the guard would trip on sim/1
