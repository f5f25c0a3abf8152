"""rose.client on the real Redis: episodes submitted through the client come back as typed
trajectories (from a real rollout worker and from the queue's worker side), each once; published
weights reach the weight follower bit-exactly; wait_applied reads the workers' heartbeats; every
bad argument is a ValueError naming it. Token ids stay below 256 here: the reference policy's
vocabulary is bytes."""

from __future__ import annotations

import subprocess
import threading
import time

import orjson
import pytest
import torch

from rose.client import RoseClient, Trajectory
from rose.rollout.episode import DONE, GENERATE, Episode, Task
from rose.rollout.launcher import WorkerConfig, launch
from rose.rollout.policy_model import ModelSpec, init_state_dict
from rose.rollout.tasks import Claimed
from rose.weights.follower import WeightFollower

pytestmark = pytest.mark.stack

JOB = "job"
MODEL = "policy"
SMALL = {"d_model": 64, "n_heads": 4, "d_ff": 128, "n_layers": 2, "max_seq": 512}


@pytest.fixture
def client(cfg, redis_client):
    with RoseClient(cfg, job=JOB, model=MODEL) as c:
        yield c


def play(task: Task, worker: str = "sim", version: int = 0) -> dict:
    """The trajectory a worker would append for `task` (the real Episode, tools answered at once)."""
    ep = Episode(task, worker, f"gpu/{worker}", False, 0.0)
    i = 0
    while ep.state != DONE:
        if ep.state == GENERATE:
            ep.on_token(ord("a") + i % 26, version, 0.0)
            i += 1
        else:
            ep.finish_tool()
    return ep.trajectory(now=1.0)


def serve(client: RoseClient, n: int, worker: str = "sim") -> list[str]:
    """Run up to `n` queued episodes through the queue's worker side (read, complete)."""
    q = client.queue
    done = []
    for c in q.read(worker, count=n):
        assert q.complete(c, play(c.task, worker))
        done.append(c.task.task_id)
    return done


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def followed(redis_client, cfg, version: int) -> dict:
    f = WeightFollower(redis_client, cfg.redis, MODEL)
    f.follow(until_version=version, idle_s=10, block_ms=200)
    v, sd = f.current()
    assert v == version
    return sd


def assert_same_bits(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        assert got[k].dtype == w.dtype, k
        assert tuple(got[k].shape) == tuple(w.shape), k
        assert bits(got[k]) == bits(w), k


def heartbeat(r, cfg, client: RoseClient, wid: str, version: int, state: str = "running", age_s: float = 0.0):
    """A worker's heartbeat hash as Worker.publish writes it, and its membership of the job."""
    r.sadd(client.queue.workers_key, wid)
    r.hset(
        cfg.redis.key("workers", wid),
        mapping={"worker_id": wid, "gpu": f"gpu/{wid}", "job": JOB, "dedicated": 0, "state": state}
        | {"ts": time.time() - age_s, "version": version},
    )


# -- episodes -------------------------------------------------------------------------------


def test_round_trip_through_a_real_worker_that_follows_published_weights(cfg, redis_client, client):
    v = client.publish_weights(init_state_dict(ModelSpec(**SMALL), seed=3))
    assert v == 1 and client.last_publish is not None and client.last_publish.keyframe
    worker = WorkerConfig(
        gpu="sim/w0",
        worker_id="w0",
        redis=cfg.redis,
        job=JOB,
        model=MODEL,
        model_spec=SMALL,
        max_batch=8,
        weights="follow",
        max_episodes=4,
    )
    p = launch(worker, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert client.wait_applied(1, timeout_s=120) == ["w0"]
        prompts = [list(b"question %d?" % i) for i in range(3)]
        ids = client.submit_many(prompts, max_turns=3, tokens_per_turn=12, obs_tokens=10, seeds=[0, 1, 2], step=1)
        ids.append(
            client.submit(list(b"one more"), max_turns=2, tokens_per_turn=8, obs_tokens=4, seed=7, step=1, task_id="x")
        )
        assert ids[-1] == "x" and len(set(ids)) == 4
        got = list(client.results(step=1, count=4, timeout_s=120))
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    finally:
        p.kill()
    assert sorted(t.task_id for t in got) == sorted(ids)
    for t in got:
        assert isinstance(t, Trajectory) and t.step == 1 and t.worker == "w0" and t.gpu == "sim/w0"
        turns, tpt = (2, 8) if t.task_id == "x" else (3, 12)
        assert t.prompt == (list(b"one more") if t.task_id == "x" else prompts[ids.index(t.task_id)])
        assert len(t.turns) == turns and all(len(x.action) == tpt for x in t.turns)
        assert t.turns[-1].observation == [] and all(x.observation for x in t.turns[:-1])
        assert all(x.token_versions == [1] * tpt for x in t.turns)  # every token from the published version
        assert len(t.tokens) == len(t.action_mask) == len(t.token_versions)
        assert [v for v, m in zip(t.token_versions, t.action_mask) if m] == [1] * (turns * tpt)
        assert [tok for tok, m in zip(t.tokens, t.action_mask) if m] == [x for turn in t.turns for x in turn.action]
        assert t.min_version == 1 and t.moves == 0 and t.finish_reason is None
    assert client.progress(1) == (4, 4)
    assert list(client.results()) == []  # the cursor is past them


def test_the_cursor_never_yields_a_trajectory_twice(client):
    step0 = client.submit_many(
        [list(b"p%d" % i) for i in range(4)], max_turns=2, tokens_per_turn=4, obs_tokens=2, seeds=range(4), step=0
    )
    step1 = client.submit_many(
        [list(b"q%d" % i) for i in range(3)], max_turns=1, tokens_per_turn=3, obs_tokens=0, seeds=range(3), step=1
    )
    assert sorted(serve(client, 10)) == sorted(step0 + step1)
    assert client.progress(0) == (4, 4) and client.progress(1) == (3, 3)

    it = client.results(step=1)
    first = next(it)  # then leave the loop: nothing read is lost
    it.close()
    rest = list(client.results(step=1))
    assert first.step == 1 and [t.step for t in rest] == [1, 1]
    # completing a task a second time appends nothing
    dup = Task(task_id=step0[0], prompt=list(b"p0"), max_turns=2, tokens_per_turn=4, obs_tokens=2)
    assert not client.queue.complete(Claimed(client.queue.stream, "1-1", dup), play(dup))
    all0 = list(client.results())  # step 0's were read on the way and kept
    assert [t.step for t in all0] == [0] * 4
    seen = [t.task_id for t in [first, *rest, *all0]]
    assert sorted(seen) == sorted(step0 + step1) and len(set(seen)) == len(seen)
    assert [t.entry_id for t in all0] == sorted(t.entry_id for t in all0)  # in completion order
    assert list(client.results()) == [] and list(client.results(step=0)) == []

    t0 = time.monotonic()
    assert list(client.results(step=0, timeout_s=0.3)) == []
    assert time.monotonic() - t0 >= 0.3
    late = client.submit(list(b"late"), max_turns=1, tokens_per_turn=2, obs_tokens=0, seed=9, step=0)
    threading.Timer(0.3, serve, (client, 1)).start()
    got = list(client.results(count=5, timeout_s=2))  # stops at the timeout with what came
    assert [t.task_id for t in got] == [late]

    with RoseClient(client.config, job=JOB, model=MODEL) as other:  # a cursor per client
        assert len(list(other.results())) == 8


def test_an_unreadable_result_is_skipped(client, redis_client):
    q = client.queue
    redis_client.xadd(q.results_stream, {"task_id": "bad", "trajectory": b"{not json"})
    redis_client.xadd(q.results_stream, {"task_id": "odd", "trajectory": orjson.dumps({"task_id": "odd"})})
    tid = client.submit(list(b"ok"), max_turns=1, tokens_per_turn=2, obs_tokens=0, seed=0, step=0)
    serve(client, 1)
    assert [t.task_id for t in client.results()] == [tid]


# -- weights --------------------------------------------------------------------------------


def test_published_state_dicts_reach_the_follower_bit_exactly(cfg, redis_client, client):
    g = torch.Generator().manual_seed(0)
    master = {
        "emb.weight": torch.randn(64, 33, generator=g),  # fp32 master weights
        "norm.weight": torch.randn(33, generator=g, dtype=torch.float64),
        "already.bf16": torch.randn(5, 5, generator=g).bfloat16(),
        "steps": torch.arange(7),  # not floating point: published as it is
        "mask": torch.tensor([True, False, True]),
    }

    def published(sd: dict, dtype=torch.bfloat16) -> dict:
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}

    assert client.publish_weights(master) == 1
    assert_same_bits(followed(redis_client, cfg, 1), published(master))

    with torch.no_grad():
        master["emb.weight"][3, :5] += 0.01  # an optimizer step touching a few weights
    assert client.publish_weights(master) == 2
    assert client.last_publish is not None and not client.last_publish.keyframe  # a delta
    assert_same_bits(followed(redis_client, cfg, 2), published(master))

    assert client.publish_weights(master, version=10, dtype=torch.float16) == 10
    assert_same_bits(followed(redis_client, cfg, 10), published(master, torch.float16))
    mixed = {k: v if v.dtype == torch.bfloat16 else v.numpy() for k, v in master.items()}  # numpy has no bf16
    assert client.publish_weights(mixed, dtype=None) == 11  # as they are
    assert_same_bits(followed(redis_client, cfg, 11), master)
    assert client.publish_weights(mixed) == 12  # numpy arrays cast too
    assert_same_bits(followed(redis_client, cfg, 12), published(master))
    with pytest.raises(ValueError, match="^version 12 is not above the last published version 12"):
        client.publish_weights(master, version=12)


def test_published_safetensors_reach_the_follower_bit_exactly(cfg, redis_client, client, tmp_path, tiny_checkpoint):
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(1)
    a = {"a.weight": torch.randn(16, 8, generator=g), "a.ids": torch.arange(4)}
    b = {"b.weight": torch.randn(8, generator=g).bfloat16(), "b.half": torch.randn(3, generator=g).half()}
    one = tmp_path / "one.safetensors"
    save_file({**a, **b}, str(one))
    cast = {k: v.bfloat16() if v.is_floating_point() else v for k, v in {**a, **b}.items()}
    assert client.publish_weights(one) == 1
    assert_same_bits(followed(redis_client, cfg, 1), cast)

    sharded = tmp_path / "sharded"  # a sharded HF directory: two files and their index
    sharded.mkdir()
    save_file(a, str(sharded / "model-00001-of-00002.safetensors"))
    save_file(b, str(sharded / "model-00002-of-00002.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in a} | {k: "model-00002-of-00002.safetensors" for k in b}
    (sharded / "model.safetensors.index.json").write_bytes(orjson.dumps({"metadata": {}, "weight_map": weight_map}))
    assert client.publish_weights(str(sharded), dtype=None) == 2
    assert_same_bits(followed(redis_client, cfg, 2), {**a, **b})

    hf = load_file(str(tiny_checkpoint / "model.safetensors"))  # save_pretrained's directory, float32
    assert client.publish_weights(tiny_checkpoint) == 3
    assert_same_bits(followed(redis_client, cfg, 3), {k: v.bfloat16() for k, v in hf.items()})


def test_wait_applied_returns_once_a_heartbeat_shows_the_version(cfg, redis_client, client):
    heartbeat(redis_client, cfg, client, "w1", 1)
    heartbeat(redis_client, cfg, client, "w2", 3, state="paused")
    assert client.wait_applied(2, timeout_s=1) == ["w2"]
    threading.Timer(0.3, heartbeat, (redis_client, cfg, client, "w1", 2)).start()
    t0 = time.monotonic()
    assert client.wait_applied(2, timeout_s=10, min_workers=2) == ["w1", "w2"]
    assert time.monotonic() - t0 >= 0.25
    assert {w.worker_id: (w.version, w.state, w.live) for w in client.workers()} == {
        "w1": (2, "running", True),
        "w2": (3, "paused", True),
    }


def test_wait_applied_times_out_naming_the_workers_behind(cfg, redis_client, client):
    with pytest.raises(TimeoutError, match="no worker has registered"):
        client.wait_applied(1, timeout_s=0.1)
    heartbeat(redis_client, cfg, client, "w-ok", 4)
    heartbeat(redis_client, cfg, client, "w-behind", 2)
    heartbeat(redis_client, cfg, client, "w-gone", 9, age_s=30)  # a stale heartbeat does not count
    heartbeat(redis_client, cfg, client, "w-stopped", 9, state="stopped")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as e:
        client.wait_applied(4, timeout_s=0.3, min_workers=2)
    assert time.monotonic() - t0 >= 0.3
    msg = str(e.value)
    assert "1 of 2 live workers" in msg and "w-behind at version 2 (running)" in msg
    assert "w-gone (heartbeat 30." in msg and "w-stopped (" in msg and "w-ok at" not in msg


# -- bad arguments --------------------------------------------------------------------------

EP = {"max_turns": 2, "tokens_per_turn": 4, "obs_tokens": 2, "seed": 0, "step": 0}
MANY = {"max_turns": 2, "tokens_per_turn": 4, "obs_tokens": 2, "step": 0}


@pytest.mark.parametrize(
    ("call", "arg"),
    [
        (lambda c: c.submit([1, -1], **EP), "prompt_token_ids"),
        (lambda c: c.submit([], **EP), "prompt_token_ids"),
        (lambda c: c.submit("hello", **EP), "prompt_token_ids"),
        (lambda c: c.submit([1, 2.5], **EP), "prompt_token_ids"),
        (lambda c: c.submit([True], **EP), "prompt_token_ids"),
        (lambda c: c.submit([1], **{**EP, "max_turns": 0}), "max_turns"),
        (lambda c: c.submit([1], **{**EP, "tokens_per_turn": "4"}), "tokens_per_turn"),
        (lambda c: c.submit([1], **{**EP, "seed": -3}), "seed"),
        (lambda c: c.submit([1], **{**EP, "step": None}), "step"),
        (lambda c: c.submit([1], **EP, task_id=""), "task_id"),
        (lambda c: c.submit_many([], seeds=[], **MANY), "prompts"),
        (lambda c: c.submit_many([[1], [2, -2]], seeds=[0, 1], **MANY), r"prompts\[1\]"),
        (lambda c: c.submit_many([[1], [2]], seeds=[0], **MANY), "seeds"),
        (lambda c: c.submit_many([[1], [2]], seeds=[0, -1], **MANY), r"seeds\[1\]"),
        (lambda c: c.submit_many([[1], [2]], seeds=[0, 1], task_ids=["a", "a"], **MANY), "task_ids"),
        (lambda c: c.submit_many([[1]], seeds=[0], task_ids=["a", "b"], **MANY), "task_ids"),
        (lambda c: c.progress(-1), "step"),
        (lambda c: c.results(step=-1), "step"),
        (lambda c: c.results(count=0), "count"),
        (lambda c: c.results(timeout_s=-1), "timeout_s"),
        (lambda c: c.publish_weights("/no/such/checkpoint"), "weights"),
        (lambda c: c.publish_weights({}), "weights"),
        (lambda c: c.publish_weights({"w": [1.0, 2.0]}), "weights"),
        (lambda c: c.publish_weights(42), "weights"),
        (lambda c: c.publish_weights({"w": torch.ones(2)}, dtype="float7"), "dtype"),
        (lambda c: c.publish_weights({"w": torch.ones(2)}, dtype=torch.int8), "dtype"),
        (lambda c: c.publish_weights({"w": torch.ones(2)}, version=0), "version"),
        (lambda c: c.wait_applied(-1, timeout_s=1), "version"),
        (lambda c: c.wait_applied(1, timeout_s=float("nan")), "timeout_s"),
        (lambda c: c.wait_applied(1, timeout_s=1, min_workers=0), "min_workers"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(client, call, arg):
    with pytest.raises(ValueError, match=f"^{arg}: "):
        call(client)
    assert client.progress(0) == (0, 0)  # nothing was queued


def test_bad_checkpoint_paths_name_the_argument(client, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "bad.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00garbage")
    for path, said in [
        (tmp_path / "empty", "no .safetensors file"),
        (tmp_path / "notes.txt", "not a .safetensors file"),
        (tmp_path / "bad.safetensors", "not a valid safetensors file \\(header is not JSON"),
    ]:
        with pytest.raises(ValueError, match=f"^weights: .*{said}"):
            client.publish_weights(path)
