"""The real local stack: Kafka answers, topics are idempotent, compaction is set,
a produced event is consumed back, Redis answers; Jaeger (`up --jaeger`) takes OTLP spans;
a stack says whose it is, and `up --own` / `make test` refuse another checkout's stack."""

import dataclasses
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from rose.contract.events import Telemetry
from rose.contract.wire import decode
from rose.kafka.admin import ConfigResource, make_admin
from rose.kafka.producer import make_producer, produce_event
from rose.kafka.topics import create_topics
from rose.stack.processes import exited
from tests.examples import telemetry_example
from tests.kafka_checks import consume_one

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.stack
def test_topics_create_is_idempotent_and_lease_state_is_compacted(cfg):
    again = create_topics(cfg.kafka)
    assert set(again.values()) == {"exists"}
    admin = make_admin(cfg.kafka)
    res = ConfigResource(ConfigResource.Type.TOPIC, cfg.kafka.lease_state_topic)
    conf = list(admin.describe_configs([res]).values())[0].result(timeout=10)
    assert conf["cleanup.policy"].value == "compact"
    md = admin.list_topics(timeout=10)
    assert len(md.topics[cfg.kafka.telemetry_topic].partitions) == cfg.kafka.partitions


@pytest.mark.stack
def test_event_round_trip_through_real_kafka(cfg):
    ev = telemetry_example(gpu="node-1/3")
    p = make_producer(cfg.kafka)
    produce_event(p, cfg.kafka.telemetry_topic, ev)
    assert p.flush(10) == 0
    got = consume_one(cfg.kafka, cfg.kafka.telemetry_topic, "rt-test")
    assert got is not None, "event not consumed within 20 s"
    assert got.key() == b"node-1/3"
    assert decode(got.value(), Telemetry) == ev


@pytest.mark.stack
def test_redis_answers(redis_client, cfg):
    key = cfg.redis.key("probe")
    redis_client.set(key, b"1")
    assert redis_client.get(key) == b"1"


@pytest.mark.stack
def test_stack_status_reports_both_up(stack):
    assert stack.status() == {"kafka": True, "redis": True}


@pytest.mark.stack
def test_consume_batch_returns_what_is_there_without_waiting_out_its_timeout(cfg):
    """librdkafka's consume(n, timeout) holds a short batch until the timeout; consume_batch
    (used by the scheduler and the executor) hands over what is there at once — else a lone
    revoke would wait out the consumer's whole poll timeout."""
    import time

    from rose.kafka.consumer import OFFSET_BEGINNING, TopicPartition, consume_batch, make_consumer
    from rose.kafka.producer import produce

    p = make_producer(cfg.kafka)
    for i in range(10):
        produce(p, cfg.kafka.commands_topic, b"v%d" % i, b"g", partition=0)
    assert p.flush(10) == 0
    c = make_consumer(cfg.kafka, f"{cfg.kafka.topic_prefix}batch-test")
    c.assign([TopicPartition(cfg.kafka.commands_topic, 0, OFFSET_BEGINNING)])
    try:
        got, t0 = [], time.monotonic()
        while len(got) < 10 and time.monotonic() - t0 < 20:
            got += [m for m in consume_batch(c, 5000, timeout=30.0) if m.error() is None]
        assert [m.value() for m in got] == [b"v%d" % i for i in range(10)]
        assert time.monotonic() - t0 < 20, "consume_batch waited out its 30 s timeout for a full batch"
        t0 = time.monotonic()
        assert consume_batch(c, 5000, timeout=0.5) == []  # nothing more: the timeout, then empty
        assert time.monotonic() - t0 >= 0.4
    finally:
        c.close()


# ---- whose stack ---------------------------------------------------------------------------
def _stack_at(root: Path, **ports):
    """A LocalStack with its state dir at `root` and its ports (unset ones: free ports)."""
    from rose.config import StackConfig
    from rose.stack import LocalStack, free_port

    names = (
        "kafka_port",
        "controller_port",
        "sasl_port",
        "tls_port",
        "redis_port",
        "jaeger_query_port",
        "jaeger_otlp_grpc_port",
        "jaeger_otlp_http_port",
    )
    scfg = dataclasses.replace(StackConfig(), data_dir=str(root), **{n: ports.get(n) or free_port() for n in names})
    return LocalStack(scfg, f"127.0.0.1:{scfg.kafka_port}", f"redis://127.0.0.1:{scfg.redis_port}/0")


def _env_for(st) -> dict[str, str]:
    """The environment that makes `rose` and `make` use this LocalStack's state dir and ports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROSE_STACK__", "ROSE_KAFKA", "ROSE_REDIS"))}
    env.update({f"ROSE_STACK__{f.name.upper()}": str(getattr(st.scfg, f.name)) for f in dataclasses.fields(st.scfg)})
    return env


@pytest.fixture
def other_stack(tmp_path, monkeypatch):
    """Another checkout's stack (a real redis-server from `rose stack up` code, started in
    that checkout), holding the Redis port that `mine` is configured with."""
    other_checkout = tmp_path / "other-checkout"
    other_checkout.mkdir()
    other = _stack_at(other_checkout / ".rose-stack")
    monkeypatch.chdir(other_checkout)  # where its `up` ran: its stack.json records it
    other.redis_up()
    monkeypatch.chdir(REPO)
    mine = _stack_at(tmp_path / "mine" / ".rose-stack", redis_port=other.scfg.redis_port)
    yield other, mine, other_checkout
    other.redis_down()
    mine.down()


@pytest.mark.stack  # starts a Redis (and Kafka) of its own
def test_up_says_whose_stack_holds_its_ports_and_uses_it(other_stack, capsys):
    other, mine, other_checkout = other_stack
    pid = int((other.root / "redis.pid").read_text())
    [h] = mine.foreign(["redis", "kafka"])
    assert (h.service, h.pid, h.root, h.checkout) == ("redis", pid, other.root, str(other_checkout))
    capsys.readouterr()
    assert mine.claim(["redis", "kafka"]) == [h]  # it answers: used, with a word about whose it is
    err = capsys.readouterr().err
    assert f"the stack of {other_checkout}" in err and str(other.root) in err and f"pid {pid}" in err
    assert "will not stop it" in err
    assert mine.redis_down() is False and other.redis_alive()  # `down` here leaves their Redis alone


@pytest.mark.stack  # starts a Redis (and Kafka) of its own
def test_up_own_refuses_another_stack_in_one_line_starting_nothing(other_stack):
    from rose.stack import NotOwnedError

    other, mine, other_checkout = other_stack
    pid = int((other.root / "redis.pid").read_text())
    with pytest.raises(NotOwnedError) as e:
        mine.up(own=True)
    assert f"pid {pid}" in str(e.value) and f"`rose stack down` in {other_checkout}" in str(e.value)
    r = subprocess.run(["rose", "stack", "up", "--own"], env=_env_for(mine), capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert str(other.root) in lines[0] and f"pid {pid}" in lines[0]
    assert f"rose stack down` in {other_checkout}" in lines[0] and "ROSE_STACK__REDIS_PORT" in lines[0]
    assert not any(mine.root.glob("*.pid")), "refused, yet started something"
    assert not mine.kafka_alive()
    st = subprocess.run(["rose", "stack", "status"], env=_env_for(mine), capture_output=True, text=True, timeout=60)
    assert (
        st.returncode == 1
        and f"redis: up (redis port 127.0.0.1:{other.scfg.redis_port} is held by the stack of {other_checkout}"
        in st.stdout
    ), st.stdout


@pytest.mark.stack  # starts a Redis (and Kafka) of its own
def test_make_test_refuses_a_stack_it_does_not_own(other_stack, tmp_path):
    other, mine, other_checkout = other_stack
    stamp = tmp_path / "installed"
    stamp.touch()  # the install step is done: `make` goes straight to the stack
    r = subprocess.run(
        ["make", "-s", "-o", "lint", "test", f"STAMP={stamp}", "PYTEST_ARGS=--collect-only -q tests/test_config.py"],
        cwd=REPO,
        env=_env_for(mine),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert f"rose: redis port 127.0.0.1:{other.scfg.redis_port} is held by the stack of {other_checkout}" in r.stderr
    assert "collected" not in r.stdout + r.stderr, "the suite ran against another checkout's stack"
    assert not any(mine.root.glob("*.pid")) and other.redis_alive()


@pytest.mark.stack  # starts a Redis (and Kafka) of its own
@pytest.mark.slow
def test_make_test_runs_on_its_own_stack_and_rose_keep_stack_keeps_it(tmp_path):
    """`make test` on a stack of its own (a private state dir and ports): it starts it, runs the
    suite, and stops it after — unless ROSE_KEEP_STACK=1, when the stack stays up."""
    mine = _stack_at(tmp_path / ".rose-stack")
    stamp = tmp_path / "installed"
    stamp.touch()
    make = ["make", "-s", "-o", "lint", "test", f"STAMP={stamp}", "PYTEST_ARGS=tests/test_stack.py::test_redis_answers"]
    try:
        r = subprocess.run(
            make, cwd=REPO, env={**_env_for(mine), "ROSE_KEEP_STACK": "1"}, capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout + r.stderr
        assert mine.status() == {"kafka": True, "redis": True}  # kept
        assert mine.foreign(["kafka", "redis"]) == []
        r = subprocess.run(make, cwd=REPO, env=_env_for(mine), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout + r.stderr
        assert "stopped: kafka, redis" in r.stdout
        assert mine.status() == {"kafka": False, "redis": False}
    finally:
        mine.down()


def test_a_program_on_the_kafka_port_is_named_not_taken_for_a_broker(tmp_path):
    from rose.stack import StackError

    mine = _stack_at(tmp_path / ".rose-stack")
    with socket.socket() as sock:  # a plain listener, not a rose stack and not a broker
        sock.bind(("127.0.0.1", mine.scfg.kafka_port))
        sock.listen()
        [h] = mine.foreign(["kafka", "redis"])
        assert h.pid == os.getpid() and h.root is None and h.ports == [mine.scfg.kafka_port]
        with pytest.raises(StackError) as e:
            mine.claim(["kafka"])
        msg = str(e.value)
        assert f"kafka port 127.0.0.1:{mine.scfg.kafka_port} is held by pid {os.getpid()}" in msg
        assert "not a rose stack" in msg and "ROSE_STACK__KAFKA_PORT" in msg


# ---- Jaeger --------------------------------------------------------------------------------
def _built_jaeger() -> Path:
    """The Jaeger binary `rose stack up --jaeger` built in this checkout (building it takes
    minutes: the tests use the one there, and skip without it)."""
    from rose.config import load_config
    from rose.stack import LocalStack

    b = LocalStack.from_config(load_config()).jaeger_bin
    if not b.exists():
        pytest.skip(f"no Jaeger built at {b}: run `rose stack up --jaeger` once")
    return b


def test_jaeger_takes_an_otlp_span_on_loopback_and_shows_it(tmp_path):
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    built = _built_jaeger()
    st = _stack_at(tmp_path / ".rose-stack")
    (st.root / "bin").mkdir(parents=True)
    (st.root / "bin" / "jaeger").symlink_to(built)
    (st.root / "bin" / "jaeger.version").write_text(built.with_name("jaeger.version").read_text())
    t0 = time.monotonic()
    assert st.build_jaeger() == st.jaeger_bin and time.monotonic() - t0 < 1  # cached: no build
    assert not st.jaeger_alive()
    try:
        st.jaeger_up()
        assert st.jaeger_alive() and st.status(jaeger=True)["jaeger"]
        pid = int((st.root / "jaeger.pid").read_text())
        listens = {c.laddr for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        assert {a.ip for a in listens} == {"127.0.0.1"}, listens
        assert {st.scfg.jaeger_query_port, st.scfg.jaeger_otlp_grpc_port, st.scfg.jaeger_otlp_http_port} <= {
            a.port for a in listens
        }
        assert st.jaeger_otlp_endpoint == f"http://127.0.0.1:{st.scfg.jaeger_otlp_http_port}"
        [h] = st.holders(["jaeger"])
        assert h.root == st.root and h.pid == pid and st.foreign(["jaeger"]) == []

        provider = TracerProvider(resource=Resource.create({"service.name": "rose-stack-test"}))
        provider.add_span_processor(
            SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{st.jaeger_otlp_endpoint}/v1/traces", timeout=10))
        )
        with provider.get_tracer("test").start_as_current_span("lease.decide") as span:
            trace_id = f"{span.get_span_context().trace_id:032x}"
        provider.shutdown()
        deadline, got = time.monotonic() + 20, None
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{st.jaeger_query_url}/api/traces/{trace_id}", timeout=5) as r:
                    got = json.loads(r.read())
                if got.get("data"):
                    break
            except urllib.error.HTTPError as e:  # 404 until the batch processor hands it to storage
                assert e.code == 404, e
            time.sleep(0.2)
        assert [s["operationName"] for s in got["data"][0]["spans"]] == ["lease.decide"], got
        with urllib.request.urlopen(f"{st.jaeger_query_url}/api/services", timeout=5) as r:
            assert "rose-stack-test" in json.loads(r.read())["data"]
        assert (st.root / "jaeger.log").stat().st_size > 0
    finally:
        assert st.down() == ["jaeger"]
    # gone, or a zombie its parent (init, for a detached process) has not reaped yet
    assert not st.jaeger_alive() and exited(pid)


def test_kafka_cluster_ids_never_start_with_a_dash():
    """The storage tool reads a leading `-` as a flag: Kafka's own ids avoid it, and so must ours."""
    from rose.stack import kafka_cluster_id

    ids = [kafka_cluster_id() for _ in range(5000)]
    assert not any(i.startswith("-") for i in ids)
    assert all(len(i) == 22 for i in ids) and len(set(ids)) == len(ids)
