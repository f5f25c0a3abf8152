"""Redis security on the real Redis. AUTH/ACL users through the configured URL: an ACL user
limited to ROSE's key prefix works, a wrong password is refused, and the password never appears
in the redacted config. Signed weights (`security.weights_hmac_key`): a keyed rollout worker
refuses unsigned and wrongly signed deltas and keeps its last good version bit for bit; the
executor hands the key (and the Redis password) to the worker it launches, never on its command
line or in its environment; the demo trainer signs with the configured key."""

from __future__ import annotations

import dataclasses
import time
import uuid

import pytest
import redis

from rose.config import load_config

pytestmark = pytest.mark.stack

SMALL = {"d_model": 32, "n_heads": 2, "d_ff": 64, "n_layers": 1, "max_seq": 64}


def test_acl_user_via_url_and_redaction(cfg, redis_client, tmp_path):
    user, password = f"rose-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    prefix = cfg.redis.key_prefix
    redis_client.execute_command("ACL", "SETUSER", user, "on", f">{password}", f"~{prefix}*", "+@all")
    try:
        secret = tmp_path / "redis-url"
        secret.write_text(f"redis://{user}:{password}@127.0.0.1:{cfg.stack.redis_port}/0\n")
        loaded = load_config(env={"ROSE_REDIS__URL_FILE": str(secret)})
        assert password not in str(loaded.redacted())
        assert f"{user}:***@" in loaded.redacted()["redis"]["url"]
        r = redis.Redis.from_url(loaded.redis.url)
        r.set(cfg.redis.key("acl-probe"), b"ok")
        assert r.get(cfg.redis.key("acl-probe")) == b"ok"
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.set("outside-the-prefix", b"x")
        bad = redis.Redis.from_url(f"redis://{user}:wrong@127.0.0.1:{cfg.stack.redis_port}/0")
        with pytest.raises(redis.exceptions.AuthenticationError):
            bad.ping()
    finally:
        redis_client.execute_command("ACL", "DELUSER", user)


def _acl_user(redis_client, cfg) -> tuple[str, str]:
    user, password = f"rose-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    redis_client.execute_command("ACL", "SETUSER", user, "on", f">{password}", f"~{cfg.redis.key_prefix}*", "+@all")
    return user, password


def _bf16(sd: dict) -> dict:
    import torch

    return {k: v.to(torch.bfloat16) for k, v in sd.items()}


def _bits(sd: dict) -> dict:
    """Each tensor's raw bits, so that equality is bit-exact (no float comparison)."""
    import torch

    return {k: v.contiguous().view(torch.int16).clone() for k, v in sd.items()}


def _same_bits(a: dict, b: dict) -> bool:
    import torch

    a, b = _bits(a), _bits(b)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _nudged(sd: dict, seed: int, frac: float = 0.02) -> dict:
    """An RL-like update: a few elements of each tensor change (a sparse delta)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in sd.items():
        m = torch.rand(v.shape, generator=g) < frac
        out[k] = torch.where(m, v + torch.randn(v.shape, generator=g).to(v.dtype) * 0.01, v).to(v.dtype)
    return out


def test_keyed_worker_refuses_unsigned_and_wrongly_signed_deltas(cfg, redis_client):
    """Through the worker's own path: its WorkerConfig, read back from the descriptor the
    launcher hands over, builds the weight source (rose.rollout.worker_process.weight_source)."""
    from rose.rollout.launcher import WorkerConfig, _config_file, read_config
    from rose.rollout.policy_model import ModelSpec, init_state_dict
    from rose.rollout.worker_process import weight_source
    from rose.weights.stream import WeightPublisher

    key = "wk-" + uuid.uuid4().hex
    wcfg = dataclasses.replace(cfg, security=dataclasses.replace(cfg.security, weights_hmac_key=key))
    sent = WorkerConfig.from_config(
        wcfg, gpu="sim/0", worker_id="w", model="signed", weights="follow", model_spec=SMALL
    )
    config = read_config(_config_file(sent.to_json().encode()))
    assert config == sent and config.weights_hmac_key == key and config.redis == cfg.redis
    mspec = ModelSpec(**SMALL)
    weights = weight_source(config, redis_client)
    pub = WeightPublisher(redis_client, cfg.redis, "signed", hmac_key=key, shard_bytes=4096)
    v1 = _bf16(init_state_dict(mspec, 1))
    v2, v3, v4, v5 = _nudged(v1, 2), _nudged(v1, 3), _nudged(v1, 4), _nudged(v1, 5)

    assert pub.publish(v1).keyframe and weights.poll() == 1
    st = pub.publish(v2)
    assert not st.keyframe and st.bytes_sent < st.bytes_full / 2  # a real (sparse) delta
    assert weights.poll() == 2  # a correctly signed delta applies
    version, sd = weights.current()
    assert version == 2 and _same_bits(sd, v2)
    stats = weights.follower.stats

    pub.key = b""  # an unsigned delta
    assert not pub.publish(v3).keyframe
    assert weights.poll() is None and stats.refused > 0
    refused = stats.refused
    version, sd = weights.current()
    assert version == 2 and _same_bits(sd, v2)

    pub.key = b"not-the-key"  # a wrongly signed delta
    assert not pub.publish(v4).keyframe
    assert weights.poll() is None and stats.refused > refused
    version, sd = weights.current()
    assert version == 2 and _same_bits(sd, v2)
    assert stats.applied_versions == [1, 2]

    pub.key = key.encode()  # the trainer again: its next keyframe brings the worker back in step
    assert pub.publish(v5, keyframe=True).keyframe
    assert weights.poll() == 5
    version, sd = weights.current()
    assert version == 5 and _same_bits(sd, v5)


def test_executor_hands_the_key_to_its_worker_off_the_command_line(cfg, redis_client):
    """The executor's own launch path (Executor._start_worker): the worker's config carries the
    weights key and the Redis password; /proc shows neither; the running worker connects with
    that password and applies only versions signed with that key."""
    import torch

    from rose.executor import lease_machine as lm
    from rose.executor.service import Executor
    from rose.executor.workers import worker_config
    from rose.rollout.pause_flag import STOP
    from rose.rollout.policy_model import ModelSpec, init_state_dict
    from rose.weights.stream import WeightPublisher

    key = "wk-" + uuid.uuid4().hex
    user, password = _acl_user(redis_client, cfg)
    url = cfg.redis.url.replace("redis://", f"redis://{user}:{password}@", 1)
    c = dataclasses.replace(
        cfg,
        redis=dataclasses.replace(cfg.redis, url=url),
        security=dataclasses.replace(cfg.security, weights_hmac_key=key, command_hmac_key="command-key-4f1b"),
        executor=dataclasses.replace(cfg.executor, worker_weights="follow", model="keyed", job="keyed", worker_nice=0),
    )
    start = lm.Start(gpu="sim/0", lease_id="sim/0#1", epoch=1, mem_bytes=1 << 30, compute_share=0.5, paused=False)
    wc = worker_config(c, start, "flag", "cpu", 1)
    assert wc.weights_hmac_key == key and wc.redis.url == url and wc.weights == "follow"
    assert "command-key-4f1b" not in wc.to_json()  # the command key stays with the executor

    pub = WeightPublisher(redis_client, cfg.redis, "keyed", hmac_key=key)
    sd = _bf16(init_state_dict(ModelSpec(), 1))
    pub.publish(sd)  # version 1, signed
    ex = Executor(c, ["sim/0"], guard=False)
    hb_key = cfg.redis.key("workers", wc.worker_id)

    def version() -> int | None:
        v = redis_client.hget(hb_key, "version")
        return None if v is None else int(v)

    def wait_version(v: int, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while version() != v:
            assert proc.poll() is None, f"worker exited {proc.returncode}"
            assert time.monotonic() < deadline, f"worker at version {version()}, not {v}"
            time.sleep(0.1)

    ex._start_worker(start)
    h = ex.workers["sim/0"]
    proc = h.proc
    try:
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{proc.pid}/environ", "rb") as f:
            environ = f.read()
        assert b"rose.rollout.worker" in cmdline and b"--config-fd" in cmdline
        for secret in (key, password):
            assert secret.encode() not in cmdline and secret.encode() not in environ
        wait_version(1)  # connected with the password from its config, applied the signed version

        pub.key = b""
        pub.publish({k: v + torch.ones_like(v) for k, v in sd.items()}, keyframe=True)  # version 2, unsigned
        pub.key = b"not-the-key"
        pub.publish({k: v - torch.ones_like(v) for k, v in sd.items()})  # version 3, wrongly signed
        # a heartbeat 1.5 s on (30 weight polls): the worker's loop ran, and refused both
        t_sent = time.time()
        deadline = time.monotonic() + 30
        while float(redis_client.hget(hb_key, "ts") or 0) < t_sent + 1.5:
            assert time.monotonic() < deadline, "no heartbeat of the worker"
            time.sleep(0.1)
        assert version() == 1
        pub.key = key.encode()
        pub.publish(sd, keyframe=True)  # version 4, signed
        wait_version(4)
    finally:
        ex.workers.pop("sim/0")
        h.flag.set(STOP)
        try:
            assert proc.wait(30) == 0
        finally:
            proc.kill()
            h.flag.close()
            h.flag.unlink()
            redis_client.execute_command("ACL", "DELUSER", user)


def test_demo_trainer_signs_with_the_configured_key(cfg, redis_client):
    from rose.demo.trainer import Trainer, TrainerSpec
    from rose.weights.entries import InvalidEntry, from_fields

    key = "wk-" + uuid.uuid4().hex
    c = dataclasses.replace(cfg, security=dataclasses.replace(cfg.security, weights_hmac_key=key))
    t = Trainer(TrainerSpec(model="trained"), c, redis_client)
    t.publish({"batch": 0})
    entries = redis_client.xrange(cfg.redis.key("weights", "trained"))
    assert entries
    for _id, fields in entries:
        from_fields(fields, key.encode())  # verifies the signature
        with pytest.raises(InvalidEntry):
            from_fields(fields, b"not-the-key")
