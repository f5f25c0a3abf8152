"""Warm workers: the executor's pool of started, paused rollout workers that a grant hands its
lease to instead of starting a process. Pure parts first (the lease record, the flag's fields,
weight-version gating, a warm engine's memory, the pool's bookkeeping with stand-in
processes), then a real warm worker process, then the real stack."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import threading
import time
import uuid

import psutil
import pytest

from rose.config import GiB, load_config
from rose.executor import lease_machine as lm
from rose.rollout.launcher import LeaseRecord, WorkerConfig
from rose.rollout.pause_flag import PAUSE, RUN, STOP, PauseFlag
from rose.rollout.worker import fresh_enough
from rose.rollout.worker_process import wait_for_lease


@pytest.fixture
def flag():
    f = PauseFlag(f"rose-test-{uuid.uuid4().hex[:8]}", create=True)
    yield f
    f.close()
    f.unlink()


def _record(n: int = 1, **over) -> LeaseRecord:
    base = dict(
        assignment=n,
        gpu="sim/0",
        worker_id="host:sim/0:3",
        lease_id="sim/0#3",
        epoch=3,
        mem_bytes=GiB,
        compute_share=0.5,
    )
    base.update(over)
    return LeaseRecord(**base)


def _warm_config(**over) -> WorkerConfig:
    cfg = load_config(env={})
    base = dict(gpu="", worker_id="", pause_flag="f", lease_file="/tmp/x.lease", warm=True, mem_bytes=0)
    base.update(over)
    return WorkerConfig.from_config(cfg, **base)


# ---- the lease record and the warm config ------------------------------------------------------
def test_lease_record_round_trips_privately_and_turns_a_warm_config_into_the_lease(tmp_path):
    path = str(tmp_path / "w.lease")
    rec = _record(7)
    rec.write(path)
    assert (tmp_path / "w.lease").stat().st_mode & 0o777 == 0o600
    assert LeaseRecord.read(path) == rec
    assert list(tmp_path.iterdir()) == [tmp_path / "w.lease"]  # written by rename: no temporary left
    wc = rec.apply(_warm_config(seed=11, max_batch=4))
    assert (wc.gpu, wc.worker_id, wc.mem_bytes, wc.compute_share, wc.warm) == ("sim/0", "host:sim/0:3", GiB, 0.5, False)
    assert wc.seed == 11 and wc.max_batch == 4  # the rest is the warm worker's own
    assert WorkerConfig.from_json(wc.to_json()) == wc


@pytest.mark.parametrize(
    "text, field",
    [
        (b"{not json", "not valid JSON"),
        (b"[]", "expected a JSON object"),
        (b'{"assignment": 1}', "missing required field"),
    ],
)
def test_lease_record_refuses_what_is_not_a_record(tmp_path, text, field):
    p = tmp_path / "bad.lease"
    p.write_bytes(text)
    with pytest.raises(ValueError, match=field):
        LeaseRecord.read(str(p))


def test_lease_record_checks_its_values(tmp_path):
    for bad, why in ((dict(mem_bytes=0), "mem_bytes"), (dict(compute_share=1.5), "compute_share")):
        p = str(tmp_path / "r.lease")
        _record(**bad).write(p)
        with pytest.raises(ValueError, match=why):
            LeaseRecord.read(p)
    _record(compute_share=0.0).write(str(tmp_path / "z.lease"))  # a lease paused at share 0 is a lease
    assert LeaseRecord.read(str(tmp_path / "z.lease")).compute_share == 0.0


def test_a_warm_config_needs_its_flag_and_lease_file_and_no_memory():
    wc = _warm_config()
    assert WorkerConfig.from_json(wc.to_json()) == wc  # mem_bytes 0 is fine while warm
    with pytest.raises(ValueError, match="warm"):
        WorkerConfig.from_json(dataclasses.replace(wc, lease_file="").to_json())
    with pytest.raises(ValueError, match="mem_bytes"):
        WorkerConfig.from_json(dataclasses.replace(wc, warm=False).to_json())
    with pytest.raises(ValueError, match="max_staleness"):
        WorkerConfig.from_json(dataclasses.replace(wc, max_staleness=-1).to_json())


def test_a_warm_worker_takes_only_leases_of_workers_like_itself():
    wc = _warm_config(seed=5, pause_flag="warm-flag")
    lease = dataclasses.replace(
        wc, gpu="sim/1", worker_id="h:sim/1:9", mem_bytes=2 * GiB, compute_share=0.3, pause_flag="other", seed=9
    )
    lease = dataclasses.replace(lease, warm=False, lease_file="")
    assert wc.can_run_as(lease)
    for differs in (dict(device="cuda:0"), dict(job="other"), dict(max_batch=3), dict(cpus=(1,)), dict(nice=0)):
        assert not wc.can_run_as(dataclasses.replace(lease, **differs)), differs


# ---- the flag's new fields and weight-version gating ------------------------------------------
def test_flag_carries_assignment_version_readiness_and_first_token(flag):
    assert (flag.assignment, flag.version, flag.ready_ns, flag.first_token_ns) == (0, 0, 0, 0)
    assert flag.assign() == 1 and flag.assign() == 2 and flag.assignment == 2
    flag.set_version(-1)
    assert flag.version == -1
    t0 = time.monotonic_ns()
    flag.mark_ready()
    flag.mark_first_token()
    assert flag.ready_ns >= t0 and flag.first_token_ns >= flag.ready_ns
    flag.set(PAUSE)
    assert flag.get() == PAUSE and flag.assignment == 2  # one field's store leaves the others alone


def test_weight_version_gating():
    assert fresh_enough(0, None, 1)  # nothing committed yet: the seeded policy is the newest
    assert fresh_enough(5, 5, 0) and fresh_enough(4, 5, 1) and not fresh_enough(3, 5, 1)
    assert not fresh_enough(-1, 0, 0) and fresh_enough(-1, 0, 1)
    assert fresh_enough(7, 2, 1)  # a restarted publisher counts again from below


# ---- a warm engine holds no lease memory -----------------------------------------------------
def test_a_warm_engine_has_no_kv_cache_until_assigned_a_lease():
    from rose.rollout.engine import BudgetError, GenRequest, MemoryBudget, TorchEngine
    from rose.rollout.policy_model import ModelSpec

    spec = ModelSpec()
    e = TorchEngine(spec, MemoryBudget(0, spec), max_batch=4)
    assert e.n_slots == 0 and e.free_slots() == 0 and sum(t.numel() for t in e.cache) == 0
    with pytest.raises(BudgetError):
        e.assign(MemoryBudget(spec.param_count() * 4, spec))  # the model alone: no sequence fits
    assert e.n_slots == 0
    fixed, per_seq = _slot_bytes(spec)
    e.assign(MemoryBudget(fixed + 2 * per_seq + per_seq // 2, spec))  # room for two and a half sequences
    assert e.n_slots == 2 and e.free_slots() == 2 and e.cache[0].shape[0] == 2
    e.assign(MemoryBudget(GiB, spec))
    assert e.n_slots == min(4, (GiB - fixed) // per_seq) and e.free_slots() == e.n_slots
    out = e.generate([GenRequest("a", [1, 2, 3], seed=1)], 2)
    assert len(out[0]) == 2
    with pytest.raises(RuntimeError, match="already runs"):
        e.assign(MemoryBudget(GiB, spec))


def _slot_bytes(spec) -> tuple[int, int]:
    """(bytes held whatever the batch, bytes of one sequence) in float32: the model's parameters
    and one token's forward at full context; one sequence's keys and values in every layer."""
    f32 = 4
    model = spec.param_count() * f32
    acts = 6 * spec.d_model + 2 * spec.d_ff + spec.vocab  # residual/MLP activations and logits
    scores = spec.n_heads * spec.max_seq * 2
    gathered_kv = 2 * spec.max_seq * spec.d_model
    kv = 2 * spec.n_layers * spec.max_seq * spec.d_model
    return model + (acts + scores + gathered_kv) * f32, kv * f32


@pytest.mark.cuda
def test_a_warm_engine_leaves_the_gpu_alone_until_assigned():
    import torch

    from rose.rollout.engine import GenRequest, MemoryBudget, TorchEngine
    from rose.rollout.policy_model import ModelSpec

    spec = ModelSpec()
    before = torch.cuda.memory_allocated(0)
    e = TorchEngine(spec, MemoryBudget(0, spec), max_batch=4, device="cpu")
    assert torch.cuda.memory_allocated(0) == before
    e.assign(MemoryBudget(GiB, spec), device="cuda:0")
    assert next(e.model.parameters()).device.type == "cuda" and e.cache[0].device.type == "cuda"
    assert torch.cuda.memory_allocated(0) > before
    assert len(e.generate([GenRequest("a", [1, 2, 3], seed=1)], 2)[0]) == 2


# ---- the warm worker's wait ------------------------------------------------------------------
class _Weights:
    def __init__(self):
        self.v, self.new = 0, None

    def poll(self):
        v, self.new = self.new, None
        return v

    def current(self):
        return self.v, {"v": self.v}

    def publish(self, v):
        self.v = self.new = v


class _Engine:
    version = 0

    def load_weights(self, v, sd):
        assert sd == {"v": v}
        self.version = v


def _applied(weights: _Weights, engine: _Engine, *versions: int) -> None:
    """Publish each version and wait until the waiting loop has applied it: once it applied the
    second of two, it went round its loop (reading the lease record first) after the first."""
    for v in versions:
        weights.publish(v)
        deadline = time.monotonic() + 5
        while engine.version != v and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.version == v, f"version {v} not applied while waiting"


def test_wait_for_lease_keeps_weights_current_and_returns_the_announced_record(flag, tmp_path):
    wc = _warm_config(pause_flag=flag.name, lease_file=str(tmp_path / "w.lease"))
    weights, engine, stop = _Weights(), _Engine(), threading.Event()
    got: list = []
    t = threading.Thread(target=lambda: got.append(wait_for_lease(wc, flag, engine, weights, stop)))
    t.start()
    _applied(weights, engine, 3)
    assert engine.version == 3 and flag.version == 3  # applied while waiting, and said so
    _record(1).write(wc.lease_file)  # an old record: no assignment announced yet, so not taken
    _applied(weights, engine, 4, 5)  # the loop went round since: it has seen the record
    assert t.is_alive()
    _record(2, epoch=4).write(wc.lease_file)
    flag.assign()  # announces 1, but the record says 2: still waiting for a matching one
    _applied(weights, engine, 6, 7)
    assert t.is_alive()
    flag.assign()
    t.join(5)
    assert got == [_record(2, epoch=4)]


def test_wait_for_lease_ends_on_stop(flag, tmp_path):
    wc = _warm_config(pause_flag=flag.name, lease_file=str(tmp_path / "w.lease"))
    stop = threading.Event()
    got: list = []
    t = threading.Thread(target=lambda: got.append(wait_for_lease(wc, flag, _Engine(), _Weights(), stop)))
    t.start()
    flag.set(STOP)
    t.join(5)
    assert got == [None]
    flag.set(RUN)
    stop.set()
    assert wait_for_lease(wc, flag, _Engine(), _Weights(), stop) is None


def test_a_bad_record_is_refused(flag, tmp_path):
    wc = _warm_config(pause_flag=flag.name, lease_file=str(tmp_path / "w.lease"))
    (tmp_path / "w.lease").write_bytes(b'{"assignment": 1, "gpu": 3}')
    flag.assign()
    with pytest.raises(ValueError, match="gpu"):
        wait_for_lease(wc, flag, _Engine(), _Weights(), threading.Event())


# ---- the executor's pool, with stand-in processes -------------------------------------------
@pytest.fixture
def executor(monkeypatch):
    """An executor that is never started (no Kafka): its workers are `sleep` processes."""
    from rose.executor import service, workers

    launched: list[WorkerConfig] = []

    def fake_launch(config, **popen):
        launched.append(config)
        return subprocess.Popen(["sleep", "60"], **popen)

    monkeypatch.setattr(workers, "launch", fake_launch)
    cfg = load_config(env={})
    ex = service.Executor(cfg, ["sim/0", "sim/1"], guard=False)
    ex.launched = launched
    yield ex
    ex.shutdown(timeout_s=2)


def _start(gpu: str, epoch: int, share: float = 0.5, paused: bool = False) -> lm.Start:
    return lm.Start(gpu=gpu, lease_id=f"{gpu}#{epoch}", epoch=epoch, mem_bytes=GiB, compute_share=share, paused=paused)


def test_a_start_goes_to_a_ready_warm_worker_and_the_pool_refills(executor):
    ex = executor
    assert ex.pool.size == 1 and not ex.pool.workers
    ex.pool.on = True
    ex.pool.tend()
    assert len(ex.pool.workers) == 1 and ex.launched[-1].warm and ex.launched[-1].mem_bytes == 0
    w = ex.pool.workers[0]
    ex._start_worker(_start("sim/0", 1))  # the warm worker is not ready yet: a cold start
    assert not ex.workers["sim/0"].warm and not ex.launched[-1].warm and ex.launched[-1].mem_bytes == GiB
    assert ex.pool.workers == [w]
    w.flag.mark_ready()
    ex.pool.tend()
    assert w.ready_said
    ex._start_worker(_start("sim/1", 2, share=0.25, paused=True))
    h = ex.workers["sim/1"]
    assert h.warm and h.proc is w.proc and h.flag is w.flag and not ex.pool.workers
    rec = LeaseRecord.read(w.config.lease_file)
    assert (rec.assignment, rec.gpu, rec.epoch, rec.lease_id, rec.mem_bytes, rec.compute_share) == (
        1,
        "sim/1",
        2,
        "sim/1#2",
        GiB,
        0.25,
    )
    assert rec.worker_id.endswith(":sim/1:2")
    assert h.flag.assignment == 1 and h.flag.get() == PAUSE and h.flag.share == 0.25  # the lease's state and share
    ex.pool.tend()  # the refill waits for the lease's first token: no start-up competes with it
    assert not ex.pool.workers
    h.flag.mark_first_token()
    ex.pool.tend()  # then refills, in the background
    assert len(ex.pool.workers) == 1 and ex.pool.workers[0].proc.pid != w.proc.pid
    lease_file = w.config.lease_file
    h.proc.kill()
    ex._reap("sim/1")
    assert not psutil.pid_exists(h.proc.pid)
    assert not os.path.exists(lease_file)  # removed with the flag


def test_a_warm_worker_that_dies_before_it_is_ready_is_replaced_after_a_backoff(executor):
    ex = executor
    ex.pool.on = True
    ex.pool.tend()
    first = ex.pool.workers[0]
    first.proc.kill()
    first.proc.wait()
    ex.pool.tend()
    assert not ex.pool.workers and ex.pool.failures == 1 and ex.pool.retry_at > time.monotonic()
    ex.pool.retry_at = 0.0
    ex.pool.tend()
    assert len(ex.pool.workers) == 1


def test_shutdown_stops_the_pool(executor):
    ex = executor
    ex.pool.on = True
    ex.pool.tend()
    w = ex.pool.workers[0]
    name = w.flag.name
    ex.shutdown(timeout_s=5)
    assert not ex.pool.workers and w.proc.returncode is not None
    with pytest.raises(FileNotFoundError):
        PauseFlag(name)


def test_no_pool_for_placeholders_or_when_turned_off():
    from rose.executor.service import Executor

    cfg = load_config(env={})
    off = dataclasses.replace(cfg, executor=dataclasses.replace(cfg.executor, warm_workers=0))
    assert Executor(off, ["sim/0"], guard=False).pool.size == 0
    ph = dataclasses.replace(cfg, executor=dataclasses.replace(cfg.executor, worker="placeholder"))
    assert Executor(ph, ["sim/0"], guard=False).pool.size == 0
    bad = dataclasses.replace(cfg, executor=dataclasses.replace(cfg.executor, warm_workers=-1))
    with pytest.raises(ValueError, match="warm_workers"):
        Executor(bad, ["sim/0"], guard=False)


# ---- a real warm worker process ----------------------------------------------------------------
def test_a_real_warm_worker_gets_ready_without_a_lease_and_stops_at_once(flag, tmp_path):
    """Imports, model and weights, and no Redis, task queue or KV cache before a lease."""
    from rose.rollout.launcher import launch

    wc = _warm_config(pause_flag=flag.name, lease_file=str(tmp_path / "w.lease"), nice=0, seed=3)
    flag.set(PAUSE)
    flag.set_share(0.0)
    proc = launch(wc, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while flag.ready_ns == 0 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.05)
        assert flag.ready_ns > 0 and flag.version == 0  # the seeded policy, applied
        beat, main = flag.heartbeat, psutil.Process(proc.pid)
        # its main thread goes round the wait loop (a 1 ms sleep a round: a voluntary context
        # switch each); 100 rounds on, it still has not counted a loop of its own
        rounds = main.num_ctx_switches().voluntary + 100
        deadline = time.monotonic() + 30
        while main.num_ctx_switches().voluntary < rounds:
            assert time.monotonic() < deadline, "the warm worker's wait loop did not go round"
            time.sleep(0.01)
        assert flag.heartbeat == beat and flag.steps == 0  # waiting, not running a loop of its own
        flag.set(STOP)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- the real stack -----------------------------------------------------------------------------
def _first_token_s(r, cfg, epoch: int, t0: float, timeout: float = 120) -> float:
    """Seconds from `t0` until the lease's worker reports a decoded token in its heartbeat
    (written every 0.2 s: a coarse clock, enough to tell warm from cold)."""
    import socket

    key = cfg.redis.key("workers", f"{socket.gethostname()}:sim/0:{epoch}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if int(r.hget(key, "tokens") or 0) > 0:
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"the worker of epoch {epoch} decoded no token within {timeout}s")


def _more_tasks(cfg, tag: str, n: int) -> None:
    import redis

    from rose.rollout.episode import Task, ToolLatency
    from rose.rollout.tasks import TaskQueue
    from tests.test_executor import JOB

    q = TaskQueue(redis.Redis.from_url(cfg.redis.url), cfg.redis, JOB)
    for i in range(n):
        q.submit(Task(f"{tag}-{i}", [1 + i % 200, 2, 3], max_turns=2, tokens_per_turn=8, tool=ToolLatency(-4.0, 0.0)))


@pytest.mark.stack
def test_a_grant_runs_on_a_warm_worker_started_before_it_and_decodes_sooner_than_a_cold_start(
    cfg, tmp_path, redis_client
):
    from rose.kafka.producer import make_producer
    from tests.test_executor import ExecutorProc, LeaseStates, env_for, send, submit

    submit(cfg, 60)
    states = LeaseStates(cfg)
    p = make_producer(cfg.kafka)
    ex = ExecutorProc(env_for(cfg, tmp_path))  # executor.warm_workers defaults to 1
    pids: list[int] = []
    try:
        warming = ex.wait_log("worker.warming", 30)
        ready = ex.wait_log("worker.warm_ready", 180, pid=warming["pid"])
        assert ready["weights_version"] == 0
        granted_at = time.time()
        t0 = time.monotonic()
        send(cfg, p, "grant", 1, "g1")
        started = ex.wait_log("worker.started", 30, epoch=1)
        assert started["warm"] is True and started["pid"] == warming["pid"]
        assert psutil.Process(started["pid"]).create_time() < granted_at  # started before the grant
        warm_s = _first_token_s(redis_client, cfg, 1, t0)
        states.wait("active", 1)
        deadline = time.monotonic() + 30  # the pool refills in the background: another process
        while not [ln for ln in ex.lines if ln.get("event") == "worker.warming" and ln["pid"] != warming["pid"]]:
            assert time.monotonic() < deadline, "the pool was not refilled"
            time.sleep(0.05)
        pids = [ln["pid"] for ln in ex.lines if ln.get("event") == "worker.warming"]
        send(cfg, p, "revoke", 1, "r1")
        revoked, _ = states.wait("revoked", 1, timeout=15)
        logged = ex.wait_log("lease.state", 10, state="revoked", epoch=1, measured_pid=started["pid"])  # once reaped
        assert revoked.rollout_mem_bytes == logged["rollout_mem_bytes"] == 0 and not psutil.pid_exists(started["pid"])
    finally:
        ex.stop()
    assert ex.proc.returncode == 0
    assert pids and not any(psutil.pid_exists(x) for x in pids)  # the pool stopped with its executor

    _more_tasks(cfg, "cold", 60)  # the warm lease may have finished every task
    cold = ExecutorProc(env_for(cfg, tmp_path, ROSE_EXECUTOR__WARM_WORKERS="0"))
    try:
        t0 = time.monotonic()
        send(cfg, p, "grant", 2, "g2")
        started = cold.wait_log("worker.started", 30, epoch=2)
        assert started["warm"] is False
        cold_s = _first_token_s(redis_client, cfg, 2, t0)
        assert not [ln for ln in cold.lines if ln.get("event") == "worker.warming"]
    finally:
        cold.stop()
        states.close()
    assert warm_s < cold_s, f"first token {warm_s:.2f} s from the warm pool, {cold_s:.2f} s cold"
