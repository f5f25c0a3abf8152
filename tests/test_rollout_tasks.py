"""The agentic task queue and the worker process on the real Redis: episodes complete,
and neither a SIGKILL nor a STOP loses or duplicates a trajectory."""

import collections
import math
import signal
import subprocess
import sys
import time
import uuid

import orjson
import pytest

from rose.config import RedisConfig
from rose.rollout.episode import Task, ToolLatency
from rose.rollout.launcher import EXIT_BAD_CONFIG, EXIT_BUDGET, WorkerConfig, launch
from rose.rollout.pause_flag import PAUSE, RUN, STOP, PauseFlag
from rose.rollout.tasks import TaskQueue

SMALL = {"d_model": 64, "n_heads": 4, "d_ff": 128, "n_layers": 2, "max_seq": 512}
JOB = "job"


def spec(cfg, wid, **kw) -> WorkerConfig:
    base = dict(
        gpu=f"sim/{wid}",
        worker_id=wid,
        redis=cfg.redis,
        job=JOB,
        model="policy",
        model_spec=SMALL,
        max_batch=8,
        min_idle_ms=1500,
        reclaim_every_ms=200,
    )
    base.update(kw)
    return WorkerConfig(**base)


def tasks(n, turns=3, tpt=12, tool_s=0.02, prefix="t"):
    return [
        Task(
            task_id=f"{prefix}{i}",
            prompt=list(b"question %d?" % i),
            max_turns=turns,
            tokens_per_turn=tpt,
            obs_tokens=10,
            tool=ToolLatency(mu=math.log(tool_s), sigma=0.0),
            seed=i,
        )
        for i in range(n)
    ]


def start(s: WorkerConfig) -> subprocess.Popen:
    return launch(s, stderr=subprocess.PIPE, text=True)


def run(s: WorkerConfig, timeout: float) -> subprocess.CompletedProcess:
    p = launch(s, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        p.kill()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def wait_for(cond, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def hb(r, cfg, wid) -> dict:
    return {k.decode(): v.decode() for k, v in r.hgetall(cfg.redis.key("workers", wid)).items()}


def heartbeat_after(r, cfg, wid, t: float) -> dict | None:
    """The worker's heartbeat if it was published at or after `t` (wall clock), else None: a
    check that nothing happened in a while waits on it to know the worker lived through it."""
    h = hb(r, cfg, wid)
    return h if float(h.get("ts", 0)) >= t else None


def ids(q) -> collections.Counter:
    return collections.Counter(t["task_id"] for t in q.all_results())


@pytest.fixture
def queue(cfg, redis_client):
    return TaskQueue(redis_client, cfg.redis, JOB)


@pytest.fixture
def flag():
    f = PauseFlag(f"rose-t-{uuid.uuid4().hex[:8]}", create=True)
    yield f
    f.close()
    f.unlink()


def _nothing_pending(q) -> bool:
    streams = [q.stream] + [q.directed(w.decode()) for w in q.r.smembers(q.workers_key)]
    return all(q.r.xpending(s, q.group)["pending"] == 0 for s in streams)


@pytest.mark.stack
def test_worker_completes_episodes(cfg, redis_client, queue):
    for t in tasks(5):
        queue.submit(t)
    p = run(spec(cfg, "w0", max_episodes=5), timeout=120)
    assert p.returncode == 0, p.stderr
    res = queue.all_results()
    assert sorted(t["task_id"] for t in res) == [f"t{i}" for i in range(5)]
    for t in res:
        assert len(t["turns"]) == 3 and t["versions"] == [0, 0, 0]
        assert all(len(x["action"]) == 12 for x in t["turns"])
        assert [x["observation"] is not None for x in t["turns"]] == [True, True, False]  # no tool after the last turn
        assert len(t["tokens"]) == len(t["prompt"]) + 3 * 12 + 2 * 10
        assert t["worker"] == "w0" and t["gpu"] == "sim/w0" and t["dedicated"] is False
    h = hb(redis_client, cfg, "w0")
    assert h["state"] == "stopped" and h["episodes_done"] == "5" and h["turns"] == "15"
    assert queue.progress(0) == (5, 5)
    assert redis_client.xlen(queue.stream) == 0 and _nothing_pending(queue)


@pytest.mark.stack
def test_sigkill_mid_episode_is_reclaimed_exactly_once(cfg, redis_client, queue):
    for t in tasks(6, turns=4, tool_s=0.15):
        queue.submit(t)
    a = start(spec(cfg, "a"))
    wait_for(lambda: int(hb(redis_client, cfg, "a").get("turns", 0)) >= 2, what="worker a mid-episode")
    a.send_signal(signal.SIGKILL)
    a.wait(10)
    assert len(ids(queue)) < 6  # it died with episodes unfinished
    b = start(spec(cfg, "b"))
    try:
        wait_for(lambda: len(ids(queue)) == 6, timeout=90, what="all six results")
    finally:
        b.send_signal(signal.SIGTERM)  # SIGTERM drains: exit 0
        assert b.wait(30) == 0, b.stderr.read()
    assert set(ids(queue).values()) == {1}  # each task_id exactly once
    assert _nothing_pending(queue) and redis_client.xlen(queue.stream) == 0


@pytest.mark.stack
def test_stop_mid_episode_requeues_continuations(cfg, redis_client, queue, flag):
    for t in tasks(4, turns=4, tool_s=0.2):
        queue.submit(t)
    a = start(spec(cfg, "a", pause_flag=flag.name))
    wait_for(lambda: int(hb(redis_client, cfg, "a").get("turns", 0)) >= 4, what="worker a mid-episode")
    flag.set(STOP)
    assert a.wait(30) == 0, a.stderr.read()
    assert flag.paused_seen_ns >= flag.set_ns
    assert hb(redis_client, cfg, "a")["state"] == "stopped"
    done = ids(queue)
    pushed = [Task.from_dict(orjson.loads(f[b"task"])) for _i, f in redis_client.xrange(queue.stream)]
    assert len(pushed) + len(done) == 4 and pushed
    assert all(t.turns and t.moves == 1 for t in pushed)  # continuations carry the turns so far
    assert all(x.worker == "a" for t in pushed for x in t.turns)
    b = start(spec(cfg, "b", max_episodes=len(pushed)))
    assert b.wait(90) == 0, b.stderr.read()
    assert ids(queue) == collections.Counter({f"t{i}": 1 for i in range(4)})
    resumed = [t for t in queue.all_results() if t["worker"] == "b"]
    for t in resumed:
        assert len(t["turns"]) == 4 and t["turns"][0]["worker"] == "a" and t["turns"][-1]["worker"] == "b"
    assert _nothing_pending(queue)


@pytest.mark.stack
def test_pause_stops_work_and_run_resumes(cfg, redis_client, queue, flag):
    # enough work (tool calls of 0.2 s between turns) that the worker is still busy when the
    # test raises the flag: a worker that finishes first reports `stopped`, never `paused`
    for t in tasks(3, turns=4, tpt=100, tool_s=0.2):
        queue.submit(t)
    a = start(spec(cfg, "a", pause_flag=flag.name, max_episodes=3))
    try:
        wait_for(lambda: int(hb(redis_client, cfg, "a").get("tokens", 0)) > 0, what="decoding")
        flag.set(PAUSE)
        wait_for(lambda: hb(redis_client, cfg, "a")["state"] == "paused", what="paused state")
        assert flag.paused_seen_ns >= flag.set_ns
        paused = hb(redis_client, cfg, "a")
        beats = flag.heartbeat
        # heartbeats of the paused worker 0.5 s on: its loop ran all that while
        later = wait_for(lambda: heartbeat_after(redis_client, cfg, "a", float(paused["ts"]) + 0.5), what="heartbeats")
        assert later["state"] == "paused" and later["tokens"] == paused["tokens"]  # nothing decoded while paused
        assert flag.heartbeat > beats  # ... but the loop is alive
        flag.set(RUN)
        assert a.wait(60) == 0, a.stderr.read()
    finally:
        a.kill()
    assert len(ids(queue)) == 3


@pytest.mark.stack
def test_duplicate_completion_is_harmless(queue, redis_client):
    queue.submit(tasks(1)[0])
    [c1] = queue.read("c1", count=1)
    [c2] = queue.reclaim("c2", min_idle_ms=0)  # c1 looks stalled; c2 takes over
    assert c2.task.task_id == c1.task.task_id
    assert queue.requeue(c1, "c1", c1.task) is None  # c1 no longer owns it: no fork
    traj = {"task_id": "t0", "turns": []}
    assert queue.complete(c2, traj) is True
    assert queue.complete(c1, traj) is False  # the first worker finishes too: no duplicate
    assert queue.complete(c2, traj) is False
    assert [t["task_id"] for t in queue.all_results()] == ["t0"]
    assert queue.progress(0) == (1, 1)
    assert _nothing_pending(queue) and redis_client.xlen(queue.stream) == 0


@pytest.mark.stack
def test_touch_reports_entries_taken_by_others(queue):
    for t in tasks(2):
        queue.submit(t)
    held = queue.read("c1", count=2)
    queue.r.xclaim(queue.stream, queue.group, "c2", 0, [held[0].entry_id])
    lost = queue.touch("c1", held)
    assert [c.entry_id for c in lost] == [held[0].entry_id]


@pytest.mark.stack
def test_a_directed_submit_reaches_its_worker_and_cancel_withdraws_a_task(queue, redis_client):
    t0, t1, t2 = tasks(3)
    queue.submit(t0, to="w1")  # a worker's directed stream, listed so others may steal from it
    assert b"w1" in redis_client.smembers(queue.workers_key)
    [c] = queue.read("w1", count=1, directed=queue.directed("w1"))
    assert c.task.task_id == "t0" and c.stream == queue.directed("w1")
    waiting = queue.submit(t1)
    assert queue.cancel(queue.stream, waiting) and not queue.cancel(queue.stream, waiting)
    assert queue.read("w0", count=1) == []  # withdrawn before any worker read it
    queue.submit(t2)
    [held] = queue.read("w0", count=1)
    assert queue.cancel(held.stream, held.entry_id)
    assert queue.touch("w0", [held]) == [held]  # withdrawn while held: the holder drops it
    assert queue.progress(0) == (3, 0)


@pytest.mark.stack
def test_requeue_to_a_worker_and_steal_after_grace(queue):
    queue.register_worker("w1")
    queue.submit(tasks(1)[0])
    [c] = queue.read("w0", count=1)
    assert queue.requeue(c, "w0", c.task, to="w1")
    d = queue.directed("w1")
    assert queue.steal("w2", d, grace_ms=60_000) == []  # within the grace period it waits for w1
    time.sleep(0.05)
    [s] = queue.steal("w2", d, grace_ms=10)
    assert s.task.task_id == "t0" and s.stream == d


@pytest.mark.stack
def test_retired_worker_stream_comes_back_when_targeted(queue, redis_client):
    queue.register_worker("w1")
    assert queue.retire_worker("w1") and b"w1" not in redis_client.smembers(queue.workers_key)
    queue.submit(tasks(1)[0])
    [c] = queue.read("w0", count=1)
    assert queue.requeue(c, "w0", c.task, to="w1")  # a stale view still routes to w1
    assert b"w1" in redis_client.smembers(queue.workers_key)
    assert not queue.retire_worker("w1")  # not empty: stays listed
    [s] = queue.reclaim("w2", min_idle_ms=0) or queue.steal("w2", queue.directed("w1"), grace_ms=0)
    assert s.task.task_id == "t0"


@pytest.mark.stack
def test_undecodable_task_goes_to_dead_stream(queue, redis_client):
    queue.ensure_group()
    redis_client.xadd(queue.stream, {"task_id": "x", "task": b"{not json"})
    redis_client.xadd(queue.stream, {"task_id": "y", "task": orjson.dumps({"task_id": "y", "prompt": [-1]})})
    assert queue.read("c", count=10) == []
    dead = redis_client.xrange(queue.dead_stream)
    reasons = sorted(f[b"reason"].decode() for _i, f in dead)
    assert reasons == ["prompt: expected a list of token ids (ints 0..2147483647)", "task: not valid JSON"]
    assert _nothing_pending(queue)


def in_process_worker(cfg, redis_client, queue, wid: str, max_episodes: int):
    """A Worker in this process on the reference engine (SMALL, seed 0 weights, one thread):
    the worker, its engine and its weight source."""
    import torch

    from rose.rollout.engine import MemoryBudget, TorchEngine
    from rose.rollout.policy_model import ModelSpec, init_state_dict
    from rose.rollout.weight_source import StaticWeights
    from rose.rollout.worker import Worker

    s = spec(cfg, wid, max_episodes=max_episodes)
    ms = ModelSpec(**SMALL)
    eng = TorchEngine(ms, MemoryBudget(s.mem_bytes, ms), max_batch=8)
    weights = StaticWeights(init_state_dict(ms, seed=0))
    eng.load_weights(*weights.current())
    torch.set_num_threads(1)
    return Worker(s, redis_client, queue, eng, weights, None), eng, weights


@pytest.mark.stack
def test_policy_version_switches_between_steps(cfg, redis_client, queue):
    """A new version becomes visible mid-run; each turn records the version that made it."""
    from rose.rollout.policy_model import ModelSpec, init_state_dict
    from rose.rollout.weight_source import StaticWeights

    for t in tasks(4, turns=4, tpt=16, tool_s=0.05):
        queue.submit(t)
    w, eng, weights = in_process_worker(cfg, redis_client, queue, "w", max_episodes=4)
    v1 = init_state_dict(ModelSpec(**SMALL), seed=1)

    class Trainer(StaticWeights):  # commits version 1 after 40 decode steps
        def poll(self):
            if eng.steps >= 40 and self.current()[0] == 0:
                self.publish(1, v1)
            return super().poll()

    weights.__class__ = Trainer
    assert w.run() == 0
    versions = [x["version"] for t in queue.all_results() for x in t["turns"]]
    assert set(versions) == {0, 1} and eng.version == 1
    for t in queue.all_results():
        assert t["versions"] == sorted(t["versions"])  # never back to an older policy


@pytest.mark.stack
def test_a_completion_lost_to_an_outage_is_retried(cfg, redis_client, queue):
    """Fault: the connection drops inside `complete` (Redis stopping as an episode ends). The
    finished episode stays with its worker, which completes it once Redis answers again: it
    neither waits forever in memory (its entry touched, so never reclaimed) nor lands twice."""
    import threading

    import redis

    for t in tasks(4, turns=2, tpt=8, tool_s=0.01, prefix="lc"):
        queue.submit(t)
    failed: list[str] = []

    class DroppingQueue(TaskQueue):
        def complete(self, c, trajectory):
            if not failed:
                failed.append(c.task.task_id)
                raise redis.ConnectionError("Connection closed by server.")
            return super().complete(c, trajectory)

    w, _eng, _weights = in_process_worker(cfg, redis_client, DroppingQueue(redis_client, cfg.redis, JOB), "w-lc", 4)
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(w.run()), daemon=True)
    t.start()
    t.join(60)
    w.stop_requested = True
    assert failed, "no completion was made to fail"
    assert rc == [0], f"the worker did not finish its 4 episodes: {w.stats}"
    assert ids(queue) == collections.Counter({f"lc{i}": 1 for i in range(4)})


def test_worker_refuses_a_budget_below_the_model():
    s = WorkerConfig(
        gpu="g",
        worker_id="w",
        redis=RedisConfig("redis://127.0.0.1:1/0", "x:"),
        job="j",
        model="m",
        mem_bytes=100_000,
        model_spec=SMALL,
    )
    p = run(s, timeout=60)
    assert p.returncode == EXIT_BUDGET
    assert p.stderr.count("\n") == 1 and "mem_bytes 100000" in p.stderr


@pytest.mark.parametrize(
    "change, message",
    [
        (('"mem_bytes":1073741824', '"mem_bytes":"lots"'), "mem_bytes: expected int, got 'lots'"),
        (('"key_prefix":"x:"', '"key_prefix":7'), "redis.key_prefix: expected str, got 7"),
        (('"job":"j",', ""), "job: missing required field"),
        (('"seed":0', '"sede":0'), "sede: unknown WorkerConfig field"),
        (("{", "["), "worker config: not valid JSON (Expecting ',' delimiter)"),
        (
            ('"model_spec":{}', '"model_spec":{"d_modl":64}'),
            "model_spec: ModelSpec.__init__() got an unexpected keyword argument 'd_modl'",
        ),
    ],
)
def test_worker_rejects_a_bad_config_in_one_line(change, message):
    """Read from stdin, the default descriptor (`python -m rose.rollout.worker < worker.json`)."""
    text = WorkerConfig(gpu="g", worker_id="w", redis=RedisConfig("r", "x:"), job="j", model="m").to_json()
    assert change[0] in text
    p = subprocess.run(
        [sys.executable, "-m", "rose.rollout.worker"],  # the older entry point still runs the process
        input=text.replace(change[0], change[1], 1),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == EXIT_BAD_CONFIG
    assert p.stderr.strip() == f"rose-worker: {message}"


def test_a_vllm_step_budget_cpu_cannot_run_is_refused_in_one_line():
    """vLLM on CPU cannot chunk a seeded prefill: a step budget below max_model_len is a bad
    config, said before vLLM is even imported."""
    wc = WorkerConfig(
        gpu="g", worker_id="w", redis=RedisConfig("r", "x:"), job="j", model="m", engine="vllm", checkpoint="/nowhere"
    )
    p = subprocess.run(
        [sys.executable, "-m", "rose.rollout.worker_process"],
        input=wc.to_json().replace('"step_tokens":0', '"step_tokens":256'),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == EXIT_BAD_CONFIG, p.stderr
    assert p.stderr.startswith("rose-worker: rollout.step_tokens: 256 < max_model_len 2048 chunks prefills")
    assert p.stderr.count("\n") == 1


def test_config_round_trips_through_a_descriptor():
    import os

    from rose.rollout.launcher import _config_file, read_config

    s = WorkerConfig(
        gpu="n/0",
        worker_id="w",
        redis=RedisConfig("redis://u:pw@h:1/0", "p:"),
        job="j",
        model="m",
        weights_hmac_key="wk",
        device="cuda:0",
        mem_bytes=5 << 30,
        compute_share=0.4,
        pause_flag="f",
        dedicated=True,
        nice=5,
        cpus=(0, 3),
        seed=9,
        model_spec={"d_model": 64},
    )
    assert WorkerConfig.from_json(s.to_json()) == s
    fd = _config_file(s.to_json().encode())
    assert read_config(fd) == s
    with pytest.raises(OSError):
        os.fstat(fd)  # the worker's side closed it
    assert "wk" not in repr(s)


@pytest.mark.stack
def test_worker_survives_a_redis_restart(cfg, redis_client, queue, stack):
    """Fault: Redis stops and restarts while a worker is mid-episode. Expectation: the worker
    waits and goes on (no exit), and every task still finishes exactly once."""
    for t in tasks(8, turns=4, tool_s=0.1, prefix="rr"):
        queue.submit(t)
    p = start(spec(cfg, "w-rr", max_episodes=8))
    try:
        wait_for(lambda: int(hb(redis_client, cfg, "w-rr").get("turns", 0)) > 0, what="first turn")
        try:
            stack.redis_down()
            time.sleep(2)
        finally:
            stack.redis_up()
        assert p.poll() is None, f"worker died on the outage: {p.stderr.read() if p.poll() is not None else ''}"
        rc = p.wait(120)
        err = p.stderr.read()
        assert rc == 0, err
        assert "redis unavailable" in err, "the outage never reached the worker"
    finally:
        if p.poll() is None:
            p.kill()
    got = ids(queue)
    print(f"\n[redis-restart] results={sum(got.values())} unique={len(got)}")
    assert got == collections.Counter({f"rr{i}": 1 for i in range(8)})


def test_a_follower_runs_the_checkpoint_as_version_0_until_the_first_version_commits():
    """Before the trainer's first version a following worker's policy is version 0, as a static
    one is, so a task's default `min_version` 0 starts (at -1 no such task ever started)."""
    from rose.rollout.weight_source import FollowedWeights

    class Follower:
        v: int | None = None

        def current(self):
            return self.v, {"w": self.v}

        def poll(self):
            return self.v

        def newest(self):
            return self.v

    f = Follower()
    weights = FollowedWeights(f, {})
    assert weights.current() == (0, {}) and Task(task_id="t", prompt=[1]).min_version <= weights.current()[0]
    f.v = 1
    assert weights.current() == (1, {"w": 1})
