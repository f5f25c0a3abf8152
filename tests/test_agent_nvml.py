"""The real agent's path (`rose agent --nvml`): serving engines' Prometheus pages served over
HTTP, scraped and windowed by `run_nvml`, published as telemetry and fed to the local guard.
NVML cannot run here: a fixed device object stands in at the NVML boundary only."""

from __future__ import annotations

import dataclasses
import http.server
import json
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rose.config import GiB, load_config
from rose.contract.events import Telemetry
from rose.node import prometheus as prom
from rose.node.agent import LatencyCarry, NvmlOptions, next_due, run_nvml
from rose.node.nvml import GpuSample
from tests.examples import command_example, lease_state_example
from tests.test_agent import REPO, Collect
from tests.test_prometheus import vllm_text

SLO = (1000.0, 100.0)


class FixedGpus:
    """The NVML boundary: `len()` GPUs, each sampled at fixed utilisation and memory."""

    def __init__(self, n: int):
        self.n = n
        self.sampled: list[int] = []

    def __len__(self) -> int:
        return self.n

    def sample(self, index: int, rollout_pids: set[int]) -> GpuSample:
        self.sampled.append(index)
        return GpuSample(0.5, 80 * GiB, 40 * GiB, 0)


class Pages(http.server.BaseHTTPRequestHandler):
    """Serves its server's `pages` in order, one per scrape (the last one from then on)."""

    def do_GET(self):  # noqa: N802
        srv = self.server
        body = srv.pages[min(srv.served, len(srv.pages) - 1)].encode()
        srv.served += 1
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture
def engines():
    """Start one metrics server per list of pages; yields a function returning its URL and server."""
    servers = []

    def start(pages: list[str]):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Pages)
        srv.pages, srv.served = pages, 0
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}/metrics", srv

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


Z = [0] * 9
# cumulative histograms (buckets 0.01 .. 2.5 s, +Inf) of one engine, scrape by scrape:
BUSY_THEN_IDLE = [
    vllm_text([0, 0, 10] + Z[3:], [100] + Z[1:], success=10),  # first scrape: no window yet
    vllm_text([0, 0, 10, 100] + Z[4:], [100, 0, 100] + Z[3:], success=110),  # 100 fast requests
    vllm_text([0, 0, 10, 100] + Z[4:], [100, 0, 100] + Z[3:], success=110),  # idle: nothing finished
    vllm_text([0, 0, 10, 100, 0, 0, 100, 0, 0], [100, 0, 100, 100] + Z[4:], success=210),  # 100 slow ones
    vllm_text([0, 0, 10, 100, 0, 0, 100, 0, 0], [100, 0, 100, 100] + Z[4:], success=210),  # idle again
]
IDLE = [vllm_text([0, 5] + Z[2:], [0, 7] + Z[2:], success=5)] * len(BUSY_THEN_IDLE)  # up, never a request


def agent_cfg(base=None):
    cfg = base or load_config()
    return dataclasses.replace(
        cfg,
        telemetry=dataclasses.replace(
            cfg.telemetry, period_s=0.1, slo_ttft_ms=SLO[0], slo_tpot_ms=SLO[1], engine="vllm"
        ),
    )


def run_agent(cfg, urls: list[str], busy, guard_dir, publisher) -> tuple[dict, FixedGpus]:
    """`run_nvml` until the busy engine's last page has been scraped (one scrape per window)."""
    gpus = FixedGpus(len(urls))
    out = run_nvml(
        cfg,
        NvmlOptions(urls, "n", period_s=0.1, guard_dir=str(guard_dir), follow_leases=False),
        gpus,
        stop=lambda: busy.served >= len(busy.pages),
        publisher=publisher,
    )
    return out, gpus


def test_idle_windows_carry_the_last_p99_and_feed_the_guard_only_measurements(engines, tmp_path):
    import jsonschema

    from rose.executor.guard import FileLatencySource, Guard

    url0, busy = engines(BUSY_THEN_IDLE)
    url1, _idle = engines(IDLE)
    pub = Collect()
    out, gpus = run_agent(agent_cfg(), [url0, url1], busy, tmp_path, pub)

    schema = json.loads((REPO / "schemas" / "rose.telemetry.v1.json").read_text())
    for d in pub.events:
        jsonschema.validate(d, schema)
        Telemetry.from_dict(d)
    evs = [d for d in pub.events if d["gpu"] == "n/0"]
    idle = [d for d in pub.events if d["gpu"] == "n/1"]
    # nothing on an engine's first read (no window yet), then every window, the engine that never
    # served included: an idle replica is the one a pool can lend; its p99s at the SLO claim no headroom
    assert [d["gpu"] for d in pub.events] == ["n/0", "n/1"] * 4
    assert all(d["latency_ms"] == {"ttft_p99": SLO[0], "tpot_p99": SLO[1]} and d["rps"] == 0 for d in idle)
    assert out["samples"] == 5 and out["carried"] == 2 and out["no_latency_yet"] == 4
    assert sorted(set(gpus.sampled)) == [0, 1]  # NVML is read for the GPUs that publish
    lat = [(d["latency_ms"]["ttft_p99"], d["latency_ms"]["tpot_p99"]) for d in evs]
    fast = (pytest.approx(50 + 50 * 0.99), pytest.approx(25 + 25 * 0.99))  # 100 in (50, 100] / (25, 50] ms
    slow = (pytest.approx(500 + 500 * 0.99), pytest.approx(50 + 50 * 0.99))  # 100 in (500, 1000] / (50, 100]
    assert lat == [fast, fast, slow, slow]  # idle windows repeat the last measurement, never 0 ms
    assert all(d["slo_ms"] == {"ttft_p99": SLO[0], "tpot_p99": SLO[1]} for d in evs)

    # the guard got the measured windows only: the last file is the slow window's, not the idle one's
    src = FileLatencySource(tmp_path)
    assert src("n/1") is None
    s = src("n/0")
    assert s.ts == evs[2]["ts"] < evs[3]["ts"]
    assert (s.latency_ms.ttft_p99, s.latency_ms.tpot_p99) == slow
    trips: list[str] = []
    Guard(["n/0", "n/1"], src, on_trip=trips.append).poll_once()
    assert trips == ["n/0"]  # headroom 0.005 < 0.10: the executor's guard pauses rollout


def test_no_guard_files_without_feed_guard(engines, tmp_path):
    url0, busy = engines(BUSY_THEN_IDLE)
    gpus = FixedGpus(1)
    pub = Collect()
    run_nvml(
        agent_cfg(),
        NvmlOptions([url0], "n", period_s=0.1, follow_leases=False),
        gpus,
        stop=lambda: busy.served >= len(busy.pages),
        publisher=pub,
    )
    assert len(pub.events) == 4 and not any(tmp_path.iterdir())


def test_a_late_window_skips_the_missed_ones_instead_of_running_them_back_to_back():
    assert next_due(10.0, 0.5, 10.2) == 10.5  # on time: a period later
    assert next_due(10.0, 0.5, 10.5) == 10.5
    # a window that ended 1.3 s late: the next is on the schedule's next boundary, not at once
    assert next_due(10.0, 0.5, 11.8) == 12.0


@given(
    st.floats(0, 1e6, allow_nan=False),
    st.floats(0.05, 10, allow_nan=False),
    st.floats(0, 100, allow_nan=False),
)
def test_windows_stay_on_the_schedule_and_none_is_due_in_the_past(due, period, late):
    """Whatever the lateness, the next window is on the period's grid from `due`, at most a
    period after now, and never due before now once a period has passed (never run at once)."""
    now = due + late
    nxt = next_due(due, period, now)
    steps = (nxt - due) / period
    assert abs(steps - round(steps)) < 1e-6 and round(steps) >= 1
    assert nxt <= max(now, due + period) + period + 1e-6
    if now > due + period:
        assert nxt >= now - 1e-6


def test_latency_carry_per_metric():
    c = LatencyCarry()
    assert c.update(None, None) is None
    assert c.update(120.0, None) is None  # TPOT never measured yet: published through `unmeasured`
    assert c.update(None, 30.0) == (120.0, 30.0, True)
    assert c.update(None, None) == (120.0, 30.0, False)
    assert c.update(200.0, None) == (200.0, 30.0, True)
    assert c.unmeasured(SLO) == (200.0, 30.0, False)  # lent, or a window that measured nothing: carried
    fresh = LatencyCarry()
    assert fresh.update(120.0, None) is None and fresh.unmeasured(SLO) == (120.0, SLO[1], False)  # never: the SLO


def test_window_names_a_missing_latency_histogram():
    page = vllm_text([0, 1] + Z[2:], Z, success=1).replace("vllm:time_per_output_token_seconds", "other_seconds")
    w = prom.window(prom.parse(page), prom.parse(page), 1.0, prom.metric_names("vllm"))
    assert w.missing == ("tpot",) and w.ttft_p99_ms is None and w.tpot_p99_ms is None


@pytest.mark.stack
def test_published_to_kafka_without_zero_latency(cfg, engines, tmp_path):
    """The same path through the real publisher and broker."""
    from rose.kafka.telemetry_publisher import TelemetryPublisher

    url0, busy = engines(BUSY_THEN_IDLE)
    c = agent_cfg(cfg)
    pub = TelemetryPublisher(c.kafka, c.kafka.telemetry_topic)
    try:
        run_agent(c, [url0], busy, tmp_path, pub)
    finally:
        assert pub.flush(10.0) == 0
    from rose.kafka.consumer import read_all

    evs = [Telemetry.from_dict(json.loads(m.value())) for m in read_all(c.kafka, [c.kafka.telemetry_topic])]
    assert [e.gpu for e in evs] == ["n/0"] * 4
    assert all(e.latency_ms.ttft_p99 > 0 and e.latency_ms.tpot_p99 > 0 for e in evs)


class Serving:
    """An engine that serves 10 requests between scrapes, 3 waiting, for as long as it is read:
    page k of its cumulative histograms and counters (`Pages` reads it by index)."""

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, k: int) -> str:
        return vllm_text([0, 0, 10 * k] + Z[3:], [0, 10 * k] + Z[2:], success=10 * k, waiting=3)


def published(c, gpu: str) -> list[Telemetry]:
    from rose.kafka.consumer import read_all

    evs = [Telemetry.from_dict(json.loads(m.value())) for m in read_all(c.kafka, [c.kafka.telemetry_topic])]
    return [e for e in evs if e.gpu == gpu]


def wait_for_telemetry(c, gpu: str, pred, what: str, timeout_s: float = 30.0) -> Telemetry:
    """The first of `gpu`'s published events that `pred` accepts, read until `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := [e for e in published(c, gpu) if pred(e)]:
            return found[0]
    raise AssertionError(f"{gpu}: no telemetry {what} within {timeout_s}s")


@pytest.mark.stack
def test_telemetry_follows_a_replica_lease(cfg, engines):
    """A replica lease's states on the lease-state topic, one after the other: the GPU's telemetry
    goes serving -> draining -> lent -> reclaiming -> serving, naming its replica throughout; lent,
    it reports no requests (rps 0, queue 0) and the last measured p99. A co-resident lease on the
    other GPU leaves it serving."""
    from rose.kafka.producer import make_producer, produce_event
    from rose.kafka.telemetry_publisher import TelemetryPublisher

    (url0, _), (url1, _) = engines(Serving()), engines(Serving())
    c = agent_cfg(cfg)
    pub = TelemetryPublisher(c.kafka, c.kafka.telemetry_topic)
    stop = threading.Event()
    opt = NvmlOptions([url0, url1], "n", period_s=0.1, replicas={"n/0": "replica-a"})
    agent = threading.Thread(target=run_nvml, args=(c, opt, FixedGpus(2), stop.is_set, pub))
    agent.start()
    p = make_producer(c.kafka)
    try:
        first = wait_for_telemetry(c, "n/0", lambda e: True, "at all")
        assert first.serving_state == "serving" and first.rps > 0 and first.queue_depth == 3
        produce_event(p, c.kafka.commands_topic, command_example(gpu="n/0", lease_id="L0", lease_kind="replica"))
        produce_event(p, c.kafka.commands_topic, command_example(gpu="n/1", lease_id="L1"))
        produce_event(p, c.kafka.lease_state_topic, lease_state_example(gpu="n/1", lease_id="L1", ts=time.time()))
        seen = {}
        for state, want in (
            ("draining", "draining"),
            ("active", "lent"),
            ("reclaiming", "reclaiming"),
            ("revoked", "serving"),
        ):
            t0 = time.time()
            produce_event(
                p, c.kafka.lease_state_topic, lease_state_example(gpu="n/0", lease_id="L0", state=state, ts=t0)
            )
            p.flush(10)
            seen[state] = wait_for_telemetry(c, "n/0", lambda e: e.ts > t0 and e.serving_state == want, want)
    finally:
        stop.set()
        agent.join(30)
        assert pub.flush(10.0) == 0
    evs = published(c, "n/0")
    states = [e.serving_state for e in evs]
    assert [s for k, s in enumerate(states) if k == 0 or s != states[k - 1]] == [
        "serving", "draining", "lent", "reclaiming", "serving"
    ]  # fmt: skip
    assert all(e.replica == "replica-a" for e in evs)
    lent = [e for e in evs if e.serving_state == "lent"]
    assert lent and all(e.rps == 0 and e.queue_depth == 0 for e in lent)
    assert all(e.latency_ms == first.latency_ms for e in lent)  # carried: nothing was measured lent
    assert seen["revoked"].rps > 0  # serving again, its engine read again
    other = published(c, "n/1")
    assert other and all(e.serving_state == "serving" and e.replica_id == "n/1" for e in other)
