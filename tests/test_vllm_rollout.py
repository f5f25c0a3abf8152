"""Rollout on vLLM on the real stack: the scheduler, an executor with a warm pool of vLLM workers
(`rollout.engine = "vllm"` on a random-init Qwen2 checkpoint), live telemetry and the trainer's
weight stream. A throttle to 0 freezes the lease's engine in place (same lease, same process, no
request aborted, no token after the worker saw it), calm resumes it, a new version is applied in
place and checked bit-exact, and memory pressure revokes it: its partial turns go back to the queue
with their tokens and versions and finish on the spare engine, which took the next lease warm.

vLLM starts twice here (the warm engine and its spare), in one test: each start takes a minute or
more on a 2-core machine."""

from __future__ import annotations

import sys

import psutil
import pytest
import redis

from rose.rollout.episode import Task, ToolLatency
from rose.rollout.tasks import TaskQueue
from tests.kafka_checks import commands
from tests.processes import terminate_all
from tests.test_coelastic import Feeder
from tests.test_executor import JOB, ExecutorProc, LeaseStates, env_for, wait_until

pytestmark = pytest.mark.stack

pytest.importorskip("vllm", reason="the vLLM environment is installed by `make test` (docs/engines.md)")

MODEL = "tiny-qwen2"
ENGINE_START_S = 420  # a vLLM engine's import and start-up on a busy 2-core machine
EPISODES, TURNS, TOKENS_PER_TURN = 12, 3, 32


def _published(checkpoint, seed: int) -> dict:
    """A version as the trainer publishes it: the checkpoint's tensors nudged, in bf16."""
    import torch
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    sd = load_file(str(checkpoint / "model.safetensors"))
    return {k: (v + 0.01 * torch.randn(v.shape, generator=g)).to(torch.bfloat16) for k, v in sd.items()}


def _heartbeats(r, cfg) -> dict[str, dict[str, str]]:
    out = {}
    for key in r.scan_iter(match=cfg.redis.key("workers", "*")):
        if r.type(key) == b"hash":
            h = {k.decode(): v.decode() for k, v in r.hgetall(key).items()}
            out[h.get("worker_id", key.decode())] = h
    return out


def _of(r, cfg, gpu: str) -> dict[str, str]:
    return next((h for h in _heartbeats(r, cfg).values() if h.get("gpu") == gpu), {})


def _submit(cfg) -> TaskQueue:
    q = TaskQueue(redis.Redis.from_url(cfg.redis.url), cfg.redis, JOB)
    q.ensure_group()
    for i in range(EPISODES):
        q.submit(
            Task(
                task_id=f"ep-{i}",
                prompt=[(37 * i + 5 * k) % 1024 for k in range(12)],  # ids of the whole vocabulary, not bytes
                max_turns=TURNS,
                tokens_per_turn=TOKENS_PER_TURN,
                obs_tokens=8,
                tool=ToolLatency(mu=-4.0, sigma=0.0),
                seed=i,
            )
        )
    return q


@pytest.mark.timeout(1500)
def test_vllm_lease_pauses_in_place_applies_weights_bit_exact_and_revoke_moves_partial_turns(
    cfg, tmp_path, tiny_checkpoint
):
    from rose.weights.stream import WeightPublisher
    from tests.processes import start_scheduler

    r = redis.Redis.from_url(cfg.redis.url)
    pub = WeightPublisher(r, cfg.redis, MODEL, hmac_key=cfg.security.weights_hmac_key)
    pub.publish(_published(tiny_checkpoint, 1))  # version 1: the warm engine applies it before any lease
    env = env_for(
        cfg,
        tmp_path,
        ROSE_ROLLOUT__ENGINE="vllm",
        ROSE_ROLLOUT__MODEL=str(tiny_checkpoint),
        ROSE_ROLLOUT__MAX_MODEL_LEN="512",
        ROSE_ROLLOUT__VERIFY_WEIGHTS="1",
        ROSE_ROLLOUT__PYTHON=sys.executable,
        ROSE_EXECUTOR__MODEL=MODEL,
        ROSE_EXECUTOR__WORKER_WEIGHTS="follow",
        ROSE_EXECUTOR__WARM_WORKERS="1",
        ROSE_EXECUTOR__REVOKE_DEADLINE_S="10",
        ROSE_POLICY__MAX_PAUSE_S="900",  # the lease stays paused while the spare engine starts
        # the spare's GPU showed memory pressure just before its grant: no serving memory peak is
        # held against it (policy.kv_peak_hold_s, docs/policy.md "Lease size"), so calm grants at once
        ROSE_POLICY__KV_PEAK_HOLD_S="0",
    )
    q = _submit(cfg)
    states = LeaseStates(cfg)
    sched = start_scheduler(env, "vllm", tmp_path / "scheduler.log")
    ex = ExecutorProc(env, gpus=2)
    feed = None
    try:
        ex.wait_log("worker.warm_ready", ENGINE_START_S)
        feed = Feeder(cfg, gpus=("sim/0", "sim/1"), modes={"sim/1": "memory"})  # no lease there yet: the spare's
        active, _ = states.wait("active", 1, timeout=60, gpu="sim/0")
        started = ex.wait_log("worker.started", 60, gpu="sim/0")
        assert started["warm"] is True, "the lease did not go to the warm vLLM engine"
        pid = started["pid"]
        wait_until(lambda: int(_of(r, cfg, "sim/0").get("tokens", 0)) > 64, 120, "the leased vLLM worker decoded")
        hb = _of(r, cfg, "sim/0")
        assert hb["engine"] == "vllm" and hb["version"] == "1" and hb["versions_verified"] == "1"
        assert hb["versions_mismatched"] == "0", "version 1 is not bit-exact in the engine"

        # throttle to 0: frozen in place, nothing aborted, no token after the worker saw it
        in_flight = int(hb["active"])
        feed.modes["sim/0"] = "spike"
        paused, _ = states.wait("paused", 1, timeout=30, gpu="sim/0")
        assert paused.lease_id == active.lease_id and paused.epoch == active.epoch
        wait_until(lambda: _of(r, cfg, "sim/0").get("state") == "paused", 10, "the worker did not report paused")
        at_pause = _of(r, cfg, "sim/0")
        # its heartbeat 2 s on: the paused worker's loop ran all that while
        wait_until(
            lambda: float(_of(r, cfg, "sim/0").get("ts", 0)) >= float(at_pause["ts"]) + 2.0, 10, "no later heartbeat"
        )
        later = _of(r, cfg, "sim/0")
        assert later["tokens"] == at_pause["tokens"], "the paused vLLM worker kept decoding"
        assert later["pid"] == str(pid) and psutil.pid_exists(pid)
        assert later["requeued"] == later["moved"] == "0", "the pause handed episodes away"
        assert int(later["active"]) >= min(in_flight, 1), "the pause dropped its in-flight episodes"

        # the spare engine warms while the lease is paused (it holds every episode in flight)
        wait_until(lambda: sum(ln.get("event") == "worker.warm_ready" for ln in ex.lines) >= 2, ENGINE_START_S, "spare")
        assert _of(r, cfg, "sim/0")["tokens"] == at_pause["tokens"]

        # a new version, then calm: applied in place, bit-exact, by the same process
        pub.publish(_published(tiny_checkpoint, 2))
        feed.modes["sim/0"] = "calm"
        wait_until(
            lambda: int(_of(r, cfg, "sim/0").get("tokens", 0)) > int(at_pause["tokens"]),
            60,
            "calm did not resume the vLLM worker",
        )
        wait_until(lambda: _of(r, cfg, "sim/0").get("version") == "2", 30, "version 2 was not applied")
        hb = _of(r, cfg, "sim/0")
        assert hb["pid"] == str(pid) and hb["versions_verified"] == "2" and hb["versions_mismatched"] == "0"
        wait_until(  # every episode has a turn done on this engine before it goes
            lambda: int(_of(r, cfg, "sim/0").get("turns", 0)) >= EPISODES, 120, "a turn of every episode"
        )
        resumed = next(s for s, _ in reversed(states.seen) if s.state == "active")
        assert (resumed.lease_id, resumed.epoch) == (active.lease_id, active.epoch)

        # memory pressure revokes sim/0, calm on sim/1 grants the spare
        feed.modes["sim/0"] = "memory"
        states.wait("revoked", 1, timeout=60, gpu="sim/0")
        assert any(c["kind"] == "revoke" and c["gpu"] == "sim/0" for c in commands(cfg))
        feed.modes["sim/1"] = "calm"
        spare = ex.wait_log("worker.started", 60, gpu="sim/1")
        assert spare["warm"] is True and spare["pid"] != pid
        wait_until(lambda: q.progress(0)[1] >= EPISODES, 600, "every episode completed")

        first = next(h for h in _heartbeats(r, cfg).values() if h.get("pid") == str(pid))
        assert int(first["requeued"]) >= 1, "the revoke handed no partial turn on"
        assert first["lost"] == first["duplicates"] == "0"
        results = q.all_results()
        assert sorted(t["task_id"] for t in results) == sorted(f"ep-{i}" for i in range(EPISODES))
        moved = [t for t in results if t["moves"] > 0]
        assert moved, "no episode continued on the spare engine"
        for t in results:
            assert len(t["turns"]) == TURNS
            flat = [v for vs in t["token_versions"] for v in vs]
            assert all(len(vs) == len(x["action"]) == TOKENS_PER_TURN for vs, x in zip(t["token_versions"], t["turns"]))
            assert set(flat) <= {1, 2} and flat == sorted(flat), f"{t['task_id']}: versions {flat}"
        assert any(len({x["worker"] for x in t["turns"]}) > 1 for t in moved), "no episode has turns from both engines"
    finally:
        if feed is not None:
            feed.stop()
        ex.stop()
        terminate_all({"scheduler": sched})
        states.close()
        r.close()


@pytest.mark.timeout(900)
def test_an_architecture_rose_never_names_rolls_out_through_the_vllm_engine(cfg, tmp_path):
    """A GPT-NeoX model (parallel residual, partial rotary, LayerNorm: nothing of Qwen2's or
    Llama's), built with transformers' `from_config` and saved as a checkpoint, runs episodes in a
    dedicated vLLM worker process started as the executor starts one."""
    import torch
    import transformers

    from rose.rollout.launcher import WorkerConfig, launch

    config = transformers.GPTNeoXConfig(
        vocab_size=640,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,  # head size 32: vLLM's CPU attention kernels take 32, 64, 80, 96, 112, 128, 256
        max_position_embeddings=512,
        rotary_pct=0.5,
    )
    torch.manual_seed(3)
    ckpt = tmp_path / "neox"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(ckpt)
    q = TaskQueue(redis.Redis.from_url(cfg.redis.url), cfg.redis, "neox")
    q.ensure_group()
    for i in range(4):
        q.submit(
            Task(
                task_id=f"n-{i}",
                prompt=[600 + i, 3, 500, 7],
                max_turns=2,
                tokens_per_turn=16,
                obs_tokens=4,
                tool=ToolLatency(mu=-5, sigma=0),
                seed=i,
            )
        )
    wc = WorkerConfig.from_config(
        cfg,
        gpu="dedicated/0",
        worker_id="neox-worker",
        job="neox",
        engine="vllm",
        checkpoint=str(ckpt),
        max_model_len=256,
        dedicated=True,
        max_episodes=4,
        nice=0,
    )
    proc = launch(wc)
    try:
        assert proc.wait(ENGINE_START_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    results = q.all_results()
    assert sorted(t["task_id"] for t in results) == [f"n-{i}" for i in range(4)]
    for t in results:
        assert [len(x["action"]) for x in t["turns"]] == [16, 16]
        assert all(0 <= tok < 640 for x in t["turns"] for tok in x["action"])
        assert t["worker"] == "neox-worker"
    hb = redis.Redis.from_url(cfg.redis.url).hgetall(cfg.redis.key("workers", "neox-worker"))
    assert hb[b"engine"] == b"vllm"
