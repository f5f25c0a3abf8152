"""The weight stream through the real Redis: exactly once, atomic versions, restarts, tampering."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from rose.weights.checkpoint import from_state_dict
from rose.weights.follower import REJECTED, FileStateStore, Receiver, WeightFollower
from rose.weights.layout import flatten, make_layout
from rose.weights.stream import WeightPublisher

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.stack

SHARD = 16 << 10


def _versions(n: int, seed: int = 0):
    """n successive bf16/fp32/int64 states with sparse changes, and each one's flat bytes."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(60_000, generator=g)
    state = {"w": w.to(torch.bfloat16), "b": torch.randn(500, generator=g), "step": torch.tensor(0)}
    out = []
    for v in range(n):
        w = w + torch.randn(60_000, generator=g) * 2e-3
        state = {"w": w.to(torch.bfloat16), "b": state["b"] + (v % 3 == 0) * 1e-3, "step": torch.tensor(v)}
        specs, arrays = from_state_dict(state)
        out.append((state, flatten(make_layout(specs, SHARD), arrays)))
    return out


def _publisher(redis_client, cfg, **kw):
    kw.setdefault("shard_bytes", SHARD)
    kw.setdefault("chunk_bytes", 4096)  # several parts per shard
    return WeightPublisher(redis_client, cfg.redis, "m", **kw)


def test_follower_and_late_joiner_converge_exactly_once(redis_client, cfg):
    vs = _versions(14)
    pub = _publisher(redis_client, cfg, keyframe_every=5)
    f = WeightFollower(redis_client, cfg.redis, "m")
    for i, (state, _) in enumerate(vs):
        stats = pub.publish(state)
        assert stats.keyframe == (i % 6 == 0)
        if i % 2:
            assert f.poll(0) == i + 1
            assert np.array_equal(f.receiver.visible().flat, vs[i][1])
    f.poll(0)
    assert f.stats.applied_versions == list(range(1, 15))
    assert np.array_equal(f.receiver.visible().flat, vs[-1][1])
    version, tensors = f.current()
    assert version == 14 and torch.equal(tensors["w"].view(torch.int16), vs[-1][0]["w"].view(torch.int16))
    late = WeightFollower(redis_client, cfg.redis, "m")
    assert late.poll(0) == 14 and np.array_equal(late.receiver.visible().flat, vs[-1][1])
    assert late.stats.applied_versions[0] == 13  # started from the newest keyframe


def test_duplicates_and_reordering_never_show_a_wrong_version(redis_client, cfg):
    vs = _versions(10, seed=1)
    pub = _publisher(redis_client, cfg, keyframe_every=4)
    for state, _ in vs:
        pub.publish(state)
    entries = [fields for _, fields in redis_client.xrange(pub.stream)]
    rng = random.Random(0)
    # every entry twice, some three times
    r = Receiver()
    for fields in entries:
        for _ in range(rng.choice([2, 2, 3])):
            if (v := r.offer(fields)) is not None:
                assert np.array_equal(r.visible().flat, vs[v - 1][1])
    assert r.stats.duplicates >= len(entries) and np.array_equal(r.visible().flat, vs[-1][1])
    # reordered windows: gaps force resyncs, yet whatever becomes visible is a true version
    f = WeightFollower(redis_client, cfg.redis, "m")
    shuffled = list(entries)
    for i in range(0, len(shuffled), 7):
        window = shuffled[i : i + 7]
        rng.shuffle(window)
        shuffled[i : i + 7] = window
    for fields in shuffled:
        if (v := f.receiver.offer(fields)) is not None:
            assert np.array_equal(f.receiver.visible().flat, vs[v - 1][1])
    assert f.stats.gaps > 0
    f.poll(0)  # back to the newest keyframe, then forward
    assert f.receiver.visible().version == 10 and np.array_equal(f.receiver.visible().flat, vs[-1][1])


def test_tampered_and_unsigned_entries_are_refused(redis_client, cfg):
    vs = _versions(6, seed=2)
    pub = _publisher(redis_client, cfg, keyframe_every=3, hmac_key="s3cret")
    for state, _ in vs:
        pub.publish(state)
    entries = [fields for _, fields in redis_client.xrange(pub.stream)]
    refused_before = REJECTED.value(reason="refused")
    r = Receiver(hmac_key="s3cret")
    for fields in entries:
        if fields[b"kind"] == b"delta":
            fields = dict(fields)
            p = bytearray(fields[b"payload"])
            p[-1] ^= 1
            fields[b"payload"] = bytes(p)
        v = r.offer(fields)
        if v is not None:
            assert np.array_equal(r.visible().flat, vs[v - 1][1])
    assert r.stats.refused > 0 and r.stats.applied_versions == [1, 5]  # only the keyframes (1, 5) got through
    unsigned = Receiver(hmac_key="s3cret")
    for fields in entries:
        fields = {k: v for k, v in fields.items() if k != b"sig"}
        assert unsigned.offer(fields) is None
    assert unsigned.stats.refused == len(entries) and unsigned.visible() is None
    wrong_key = Receiver(hmac_key="other")
    assert all(wrong_key.offer(fields) is None for fields in entries) and wrong_key.stats.refused == len(entries)
    # exported too: what /metrics shows is what the receivers counted
    assert REJECTED.value(reason="refused") - refused_before == r.stats.refused + 2 * len(entries)


def test_redis_losing_the_stream_leads_to_a_keyframe(redis_client, cfg):
    vs = _versions(6, seed=3)
    pub = _publisher(redis_client, cfg, keyframe_every=100)
    f = WeightFollower(redis_client, cfg.redis, "m")
    for state, _ in vs[:3]:
        pub.publish(state)
    assert f.poll(0) == 3
    redis_client.delete(pub.stream, pub.meta)  # what a Redis restart without persistence looks like
    assert pub.publish(vs[3][0]).keyframe
    for state, _ in vs[4:]:
        pub.publish(state)
    f.poll(0)
    assert f.receiver.visible().version == 6 and np.array_equal(f.receiver.visible().flat, vs[-1][1])


def test_restarted_publisher_continues_the_stream(redis_client, cfg):
    vs = _versions(4, seed=4)
    pub = _publisher(redis_client, cfg, keyframe_every=100)
    f = WeightFollower(redis_client, cfg.redis, "m")
    pub.publish(vs[0][0])
    pub.publish(vs[1][0])
    assert f.poll(0) == 2
    pub2 = _publisher(redis_client, cfg, keyframe_every=100)  # trainer restart
    s = pub2.publish(vs[2][0])
    assert s.keyframe and s.version == 3
    pub2.publish(vs[3][0])
    f.poll(0)
    assert f.stats.applied_versions == [1, 2, 3, 4] and np.array_equal(f.receiver.visible().flat, vs[-1][1])


def test_follower_killed_at_random_points_ends_bit_identical(redis_client, cfg, tmp_path):
    n = 30
    vs = _versions(n, seed=5)
    pub = _publisher(redis_client, cfg, keyframe_every=10, keep_keyframes=100)
    env = {**os.environ, "ROSE_REDIS_URL": cfg.redis.url, "ROSE_REDIS__KEY_PREFIX": cfg.redis.key_prefix}
    env.pop("ROSE_CONFIG", None)
    cmd = [
        sys.executable,
        "-m",
        "rose.cli",
        "weights",
        "follow",
        "--model",
        "m",
        "--out",
        str(tmp_path),
        "--until-version",
        str(n),
    ]

    def produce():
        for state, _ in vs[1:]:
            pub.publish(state)
            time.sleep(0.25)

    pub.publish(vs[0][0])
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (tmp_path / "weights.safetensors").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    t = threading.Thread(target=produce)
    t.start()
    rng = random.Random(7)
    kills = 0
    try:
        for i in range(4):
            if i:
                p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(rng.uniform(0.3, 2.5))
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                kills += 1
            p.wait()
    finally:
        t.join()
    done = subprocess.run(cmd, env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    snap, applied = FileStateStore(tmp_path).load()
    assert kills >= 2
    assert snap.version == n and np.array_equal(snap.flat, vs[-1][1])
    assert applied == list(range(1, n + 1))  # every version applied once, none twice


def test_follow_waits_while_redis_loads_its_data(redis_client, cfg):
    """After a restart Redis answers LOADING (BusyLoadingError) while it replays its
    append-only file; `follow` waits it out as it does a refused connection."""
    import redis

    vs = _versions(2, seed=6)
    pub = _publisher(redis_client, cfg)
    for state, _ in vs:
        pub.publish(state)

    class Loading:
        def __init__(self, r):
            self.r, self.calls = r, 0

        def __getattr__(self, name):
            return getattr(self.r, name)

        def xread(self, *a, **kw):
            self.calls += 1
            if self.calls <= 2:
                raise redis.BusyLoadingError("Redis is loading the dataset in memory")
            return self.r.xread(*a, **kw)

    f = WeightFollower(Loading(redis_client), cfg.redis, "m")
    f.follow(until_version=2, block_ms=100)
    assert f.receiver.visible().version == 2 and np.array_equal(f.receiver.visible().flat, vs[-1][1])
