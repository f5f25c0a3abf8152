"""The executor on the real local stack: real Kafka topics, real Redis task queue, real
rollout worker processes (rose.rollout.worker). The executor runs as `rose executor` in a
subprocess (so kill -9 is real) unless a test needs to look inside it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import orjson
import psutil
import pytest
import redis

from rose.config import GiB, TracingConfig
from rose.contract.events import LeaseState
from rose.contract.wire import decode, encode
from rose.kafka.consumer import make_consumer
from rose.kafka.producer import make_producer, partition_for, produce
from rose.obs.tracing import inject_headers, setup_tracing, tracer
from rose.rollout.episode import Task, ToolLatency
from rose.rollout.tasks import TaskQueue
from tests.examples import command_example

pytestmark = pytest.mark.stack

GPU = "sim/0"
JOB = "exec-test"


def env_for(cfg, tmp_path, **extra) -> dict:
    env = dict(os.environ)
    env.update(
        {
            "ROSE_KAFKA_BOOTSTRAP": cfg.kafka.bootstrap,
            "ROSE_REDIS_URL": cfg.redis.url,
            "ROSE_KAFKA__TOPIC_PREFIX": cfg.kafka.topic_prefix,
            "ROSE_REDIS__KEY_PREFIX": cfg.redis.key_prefix,
            "ROSE_EXECUTOR__LATENCY_DIR": str(tmp_path / "latency"),
            "ROSE_EXECUTOR__JOB": JOB,
            "ROSE_EXECUTOR__REVOKE_DEADLINE_S": "3",
            "ROSE_EXECUTOR__WORKER_NICE": "5",
        }
    )
    env.update(extra)
    return env


def parse_log_line(raw: bytes) -> list[dict]:
    """A line of the executor's stderr as log records. Its workers share that stderr, and what
    one writes without a newline (a progress bar) comes before the executor's next JSON line on
    the same line: that text is one record, the JSON after it another."""
    try:
        return [orjson.loads(raw)]
    except orjson.JSONDecodeError:
        pass
    at = raw.find(b'{"')
    while at > 0:
        try:
            return [{"event": raw[:at].decode(errors="replace").strip()}, orjson.loads(raw[at:])]
        except orjson.JSONDecodeError:
            at = raw.find(b'{"', at + 1)
    return [{"event": raw.decode(errors="replace").strip()}]


class ExecutorProc:
    """`rose executor --simulate N` (GPUs sim/0 … sim/N-1), and `args` after it, with its JSON log
    lines collected."""

    def __init__(self, env: dict, gpus: int = 1, args: tuple[str, ...] = ()):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rose", "executor", "--simulate", str(gpus), *args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self.lines: list[dict] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.wait_log("executor.ready", 60)

    def _read(self):
        """Collects lines until end of file; a reader that stops says why in the lines."""
        try:
            for raw in self.proc.stderr:
                self.lines.extend(parse_log_line(raw))
        except Exception as e:  # noqa: BLE001 - recorded for `stuck`, which reports the reader's state
            self.lines.append({"event": f"log reader failed: {e!r}"})
            raise
        self.lines.append({"event": "log reader: end of file"})

    def wait_log(self, event: str, timeout: float = 30, **match) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ln in list(self.lines):
                if ln.get("event") == event and all(ln.get(k) == v for k, v in match.items()):
                    return ln
            if self.proc.poll() is not None and event != "executor.stopped":
                raise AssertionError(f"executor exited {self.proc.returncode}: {self.lines[-5:]}")
            time.sleep(0.05)
        raise AssertionError(
            f"no {event} {match} within {timeout}s; last lines: {self.lines[-5:]}{self._about(event, match)}{self.stuck()}"
        )

    def _about(self, event: str, match: dict) -> str:
        """What the executor said that a timed-out wait needs beside its last lines: every `event`
        line, the last lines with `match`'s fields whatever their event, and any line that names
        `event` but did not parse (a worker's output on the shared stderr inside it)."""
        lines = list(self.lines)
        same = [ln for ln in lines if ln.get("event") == event]
        near = [ln for ln in lines if match and all(ln.get(k) == v for k, v in match.items())]
        torn = [str(ln["event"])[:400] for ln in lines if event in str(ln.get("event", "")) and ln["event"] != event]
        return f"\nevery {event}: {same[-8:]}\nlast lines with {match}: {near[-10:]}\nunparsed lines naming it: {torn[-3:]}"

    def stuck(self) -> str:
        """What a wait that timed out needs to be read: whether the log reader is alive, the
        executor's process state, and every thread's stack (`kill -USR1`, rose.shutdown)."""
        n = len(self.lines)
        try:
            p = psutil.Process(self.proc.pid)
            state = f"status={p.status()} cpu={p.cpu_times()}"
            p.send_signal(signal.SIGUSR1)
        except psutil.Error as e:
            return f"; executor: {e}"
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and len(self.lines) == n:
            time.sleep(0.05)
        time.sleep(0.5)  # the rest of the dump
        stacks = "\n".join(str(ln.get("event", ln)) for ln in self.lines[n : n + 80])
        return f"\nlog reader alive={self.reader.is_alive()}, executor {state}; its threads:\n{stacks}"

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(20)


class LeaseStates:
    """Tails the lease-state topic."""

    def __init__(self, cfg):
        self.c = make_consumer(cfg.kafka, f"t-{uuid.uuid4().hex[:8]}")
        self.c.subscribe([cfg.kafka.lease_state_topic])
        self.seen: list[tuple[LeaseState, list]] = []

    def wait(self, state: str, epoch: int, timeout: float = 30, gpu: str | None = None) -> tuple[LeaseState, list]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ls, hs in self.seen:
                if ls.state == state and ls.epoch == epoch and gpu in (None, ls.gpu):
                    return ls, hs
            for m in self.c.consume(100, timeout=0.2):
                if not m.error():
                    self.seen.append((decode(m.value(), expect=LeaseState), m.headers() or []))
        raise AssertionError(f"no {state}@{epoch} within {timeout}s; saw {[(s.state, s.epoch) for s, _ in self.seen]}")

    def states(self) -> list[tuple[str, int]]:
        for m in self.c.consume(100, timeout=0.5):
            if not m.error():
                self.seen.append((decode(m.value(), expect=LeaseState), m.headers() or []))
        return [(s.state, s.epoch) for s, _ in self.seen]

    def close(self):
        self.c.close()


def send(cfg, producer, kind, epoch, cid, ttl=30.0, headers=None, mem=GiB, value=None):
    now = time.time()
    cmd = command_example(
        kind=kind,
        gpu=GPU,
        epoch=epoch,
        command_id=cid,
        lease_id=f"{GPU}#{epoch}",
        mem_bytes=mem,
        compute_share=0.5,
        ts=now,
        expires_at=now + ttl,
    )
    produce(
        producer,
        cfg.kafka.commands_topic,
        value if value is not None else encode(cmd),
        GPU,
        headers if headers is not None else inject_headers(),
    )
    producer.flush(10)
    return cmd


def submit(cfg, n: int, turns: int = 2) -> TaskQueue:
    q = TaskQueue(redis.Redis.from_url(cfg.redis.url), cfg.redis, JOB)
    q.ensure_group()
    for i in range(n):
        q.submit(
            Task(
                task_id=f"task-{i}",
                prompt=[1 + i % 200, 2, 3, 4],
                max_turns=turns,
                tokens_per_turn=8,
                obs_tokens=4,
                tool=ToolLatency(mu=-4.0, sigma=0.0),
                seed=i,
            )
        )
    return q


def wait_until(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout}s")


def test_a_json_line_after_a_workers_partial_line_is_still_read():
    bar = b"Loading weights:   0%|          | 0/26 [00:00<?, ?it/s]\rLoading weights: 100%|#####| 26/26"
    rec = {"event": "worker.started", "gpu": "sim/0", "note": 'a {"brace'}
    got = parse_log_line(bar + orjson.dumps(rec) + b"\n")
    assert got[1] == rec and got[0]["event"].startswith("Loading weights")
    assert parse_log_line(orjson.dumps(rec) + b"\n") == [rec]
    assert parse_log_line(b'a warning, then {"half json\n') == [{"event": 'a warning, then {"half json'}]


def test_murmur2_partition_matches_the_producer(cfg):
    p = make_producer(cfg.kafka)
    got = {}
    keys = [f"sim/{i}" for i in range(32)] + ["node-3/0", "ab", "abc"]
    for k in keys:
        p.produce(
            cfg.kafka.commands_topic,
            b"{}",
            key=k,
            on_delivery=lambda err, m: got.__setitem__(m.key().decode(), m.partition()),
        )
    p.flush(10)
    assert {k: partition_for(k, cfg.kafka.partitions) for k in keys} == got


def test_grant_runs_episodes_revoke_frees_memory_duplicates_and_stale_are_harmless(cfg, tmp_path, redis_client):
    setup_tracing(TracingConfig(exporter="none"))
    q = submit(cfg, 40)
    states = LeaseStates(cfg)
    ex = ExecutorProc(env_for(cfg, tmp_path))
    p = make_producer(cfg.kafka)
    try:
        with tracer("test").start_as_current_span("cause") as span:
            trace_id = format(span.get_span_context().trace_id, "032x")
            grant = send(cfg, p, "grant", 5, "g5")
        active, hs = states.wait("active", 5)
        assert active.lease_id == grant.lease_id and active.command_id == "g5"
        assert dict(hs)["traceparent"].decode().split("-")[1] == trace_id  # child of the command's trace
        pid = ex.wait_log("worker.started", 30, epoch=5)["pid"]
        wait_until(lambda: len(q.all_results()) >= 2, 90, "the worker completed no episodes")
        send(cfg, p, "grant", 5, "g5")  # a duplicate delivery: nothing new
        send(cfg, p, "grant", 4, "g4-stale")  # a stale epoch: rejected, the truth republished
        rejected, _ = states.wait("rejected", 4)
        assert rejected.command_id == "g4-stale"
        send(cfg, p, "revoke", 5, "r5")
        states.wait("revoking", 5)
        revoked, _ = states.wait("revoked", 5, timeout=10)
        # the memory the reaped worker still holds, re-read by its pid as the state went out: none, it is gone
        logged = ex.wait_log("lease.state", 10, state="revoked", epoch=5, measured_pid=pid)
        assert revoked.rollout_mem_bytes == logged["rollout_mem_bytes"] == 0 and not psutil.pid_exists(pid)
        assert [ln for ln in ex.lines if ln.get("event") == "worker.started"].__len__() == 1
        # the lease is over: its renew is fenced, and duplicates of the revoke change nothing
        send(cfg, p, "revoke", 5, "r5")
        send(cfg, p, "renew", 5, "n5")
        states.wait("rejected", 5)  # handled after all the rest: every earlier state is out
        seen = states.states()
        assert seen.count(("active", 5)) == 2  # the grant, and the truth after the stale command
        assert ("active", 5) not in seen[seen.index(("revoked", 5)) :]
        assert sum(1 for ln in ex.lines if ln.get("event") == "worker.started") == 1
    finally:
        ex.stop()
        states.close()
    assert ex.proc.returncode == 0
    ids = [r["task_id"] for r in q.all_results()]
    assert len(ids) == len(set(ids))  # no episode completed twice


def test_expiry_without_a_scheduler_revokes_itself(cfg, tmp_path, redis_client):
    submit(cfg, 10)
    states = LeaseStates(cfg)
    ex = ExecutorProc(env_for(cfg, tmp_path))
    p = make_producer(cfg.kafka)
    try:
        send(cfg, p, "grant", 1, "g1", ttl=4.0)
        states.wait("active", 1)
        pid = ex.wait_log("worker.started", 30)["pid"]
        t0 = time.monotonic()
        expired, _ = states.wait("expired", 1, timeout=15)
        assert time.monotonic() - t0 < 4.0 + 3.0 + 2.0  # TTL + kill deadline + slack
        logged = ex.wait_log("lease.state", 10, state="expired", epoch=1, measured_pid=pid)  # re-read once reaped
        assert expired.rollout_mem_bytes == logged["rollout_mem_bytes"] == 0 and not psutil.pid_exists(pid)
        assert ("revoking", 1) in states.states()
    finally:
        ex.stop()
        states.close()


def test_kill_9_of_the_executor_loses_no_task(cfg, tmp_path, redis_client):
    n = 12
    q = submit(cfg, n, turns=3)
    states = LeaseStates(cfg)
    env = env_for(cfg, tmp_path)
    ex = ExecutorProc(env)
    p = make_producer(cfg.kafka)
    try:
        send(cfg, p, "grant", 1, "g1")
        pid = ex.wait_log("worker.started", 30)["pid"]
        wait_until(lambda: len(q.all_results()) >= 1, 90, "no episode completed")
        ex.proc.kill()  # kill -9: the worker gets SIGTERM (pdeathsig) and drains
        ex.proc.wait(10)
        wait_until(lambda: not psutil.pid_exists(pid), 15, "the orphaned worker did not exit")
        ex2 = ExecutorProc(env)  # restart: rebuilds from lease-state, declares epoch 1 expired
        states.wait("expired", 1, timeout=15)
        send(cfg, p, "grant", 2, "g2")
        states.wait("active", 2)
        wait_until(lambda: len(q.all_results()) >= n, 120, "not every task completed")
        ex2.stop()
        assert ex2.proc.returncode == 0
    finally:
        ex.stop()
        states.close()
    ids = sorted(r["task_id"] for r in q.all_results())
    assert ids == sorted(f"task-{i}" for i in range(n))  # none lost, none duplicated


def test_guard_pauses_at_once_and_commands_are_checked(cfg, tmp_path, redis_client):
    """In process, to look at the pause flag: a latency spike pauses the worker before any
    revoke; unsigned, badly signed and malformed commands go to the dead-letter topic."""
    import dataclasses

    from rose.contract.events import Latency
    from rose.contract.signing import sign_headers
    from rose.executor.guard import LatencySample, write_latency
    from rose.executor.service import DLQ, Executor
    from rose.kafka.consumer import read_all
    from rose.rollout.pause_flag import PAUSE, RUN

    key = "k-" + uuid.uuid4().hex
    lat_dir = tmp_path / "lat"
    c = dataclasses.replace(
        cfg,
        security=dataclasses.replace(cfg.security, command_hmac_key=key),
        executor=dataclasses.replace(cfg.executor, latency_dir=str(lat_dir), job=JOB),
    )
    submit(cfg, 20)
    ex = Executor(c, [GPU]).start()
    stop = threading.Event()
    t = threading.Thread(target=ex.run, args=(stop,), daemon=True)
    t.start()
    p = make_producer(cfg.kafka)
    dlq0 = DLQ.value()
    try:
        now = time.time()
        good = command_example(
            kind="grant",
            gpu=GPU,
            epoch=1,
            command_id="g1",
            lease_id=f"{GPU}#1",
            mem_bytes=GiB,
            ts=now,
            expires_at=now + 30,
        )
        v = encode(good)
        send(cfg, p, "grant", 1, "g1", value=v, headers=inject_headers())  # unsigned
        send(cfg, p, "grant", 1, "g1", value=v, headers=sign_headers("wrong", v))
        send(cfg, p, "grant", 1, "g1", value=b"{not json", headers=sign_headers(key, b"{not json"))
        send(cfg, p, "grant", 1, "g1", value=v, headers=sign_headers(key, v))
        wait_until(lambda: GPU in ex.workers, 20, "the signed grant started no worker")
        assert DLQ.value() - dlq0 == 3
        reasons = sorted(
            dict(m.headers())["rose.dlq.reason"].decode()[:30] for m in read_all(cfg.kafka, [cfg.kafka.dlq_topic])
        )
        assert (
            len(reasons) == 3 and any("missing" in r for r in reasons) and any("does not match" in r for r in reasons)
        )
        flag = ex.workers[GPU].flag
        assert flag.get() == RUN
        slo = Latency(ttft_p99=1000.0, tpot_p99=100.0)
        t0 = time.monotonic_ns()
        write_latency(lat_dir, GPU, LatencySample(time.time(), Latency(200.0, 97.0), slo))  # headroom 0.03
        wait_until(lambda: flag.get() == PAUSE, 2, "the guard did not pause")
        assert flag.set_ns >= t0
        assert ex.states[GPU].lease is not None  # paused, not revoked: the lease is the scheduler's call
        wait_until(lambda: ex.states[GPU].guard_paused, 2, "the machine did not learn of the pause")
        write_latency(lat_dir, GPU, LatencySample(time.time(), Latency(200.0, 20.0), slo))
        wait_until(lambda: flag.get() == RUN, 2, "the guard did not clear")
    finally:
        stop.set()
        t.join(20)
    assert not ex.workers
