"""The weight stream through the real Redis: exactly once, atomic versions, restarts, tampering."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from rose.weights.checkpoint import from_state_dict
from rose.weights.clients import weight_keys
from rose.weights.follower import REJECTED, FileStateStore, Receiver, WeightFollower
from rose.weights.layout import flatten, make_layout
from rose.weights.stream import ReplicationTimeout, VersionConflict, WeightPublisher

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


def _flat(state) -> np.ndarray:
    specs, arrays = from_state_dict(state)
    return flatten(make_layout(specs, SHARD), arrays)


def test_publishers_taking_turns_continue_one_stream(redis_client, cfg):
    """Two publishers of one model (a trainer's client and the gateway, say) taking turns: each
    publish after the other's is a keyframe on the stream's lineage, the versions run 1..n with
    none reused, and a follower applies every version once, in order, bit-exact."""
    rng = np.random.default_rng(8)
    pubs = [_publisher(redis_client, cfg, keyframe_every=100, keep_keyframes=100) for _ in range(2)]
    f = WeightFollower(redis_client, cfg.redis, "m")
    w = rng.standard_normal(12_000, dtype=np.float32)
    h = rng.standard_normal(30_000, dtype=np.float32)
    turns = [0, 0, 1, 0, 1, 1, 1, 0, 0, 1]  # which publisher publishes each version
    for i, who in enumerate(turns):
        w = w + (rng.random(w.size) < 0.05) * rng.standard_normal(w.size, dtype=np.float32) * np.float32(1e-3)
        h = h + rng.standard_normal(h.size, dtype=np.float32) * np.float32(1e-3)
        state = {"w": torch.from_numpy(w.copy()), "h": torch.from_numpy(h).to(torch.bfloat16)}
        s = pubs[who].publish(state)
        assert s.version == i + 1
        assert s.keyframe == (i == 0 or who != turns[i - 1]), f"version {s.version}"
        assert f.poll(0) == i + 1 and np.array_equal(f.receiver.visible().flat, _flat(state))
    n = len(turns)
    assert f.stats.applied_versions == list(range(1, n + 1))
    assert (f.stats.duplicates, f.stats.gaps, f.stats.resyncs) == (0, 0, 0)  # one lineage, seq without holes
    entries = redis_client.xrange(pubs[0].stream)
    assert [int(e[b"version"]) for _, e in entries if e[b"kind"] == b"commit"] == list(range(1, n + 1))


def test_a_version_at_or_below_the_other_publishers_is_refused(redis_client, cfg):
    vs = _versions(3, seed=12)
    a, b = _publisher(redis_client, cfg), _publisher(redis_client, cfg)
    assert a.publish(vs[0][0]).version == 1
    assert b.publish(vs[1][0], version=5).version == 5
    for version in (2, 5):  # above a's own last version, not above the stream's
        with pytest.raises(VersionConflict, match=f"version {version} is not above the last published version 5"):
            a.publish(vs[2][0], version=version)
    s = a.publish(vs[2][0], version=6)
    assert (s.version, s.keyframe) == (6, True)
    f = WeightFollower(redis_client, cfg.redis, "m")
    assert f.poll(0) == 6 and np.array_equal(f.receiver.visible().flat, vs[2][1])


def test_importing_the_follower_imports_no_redis():
    """A CUDA check imports the follower on machines without redis installed."""
    code = "import sys, rose.weights.follower; assert 'redis' not in sys.modules, 'redis imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def _waits(r) -> int:
    return int(r.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


def test_a_version_of_many_flushes_waits_once_per_node(redis_client, cfg, monkeypatch):
    """With redis.wait_replicas the shard entries' WAIT goes once to each node that holds some,
    in the last of the version's pipeline flushes, however many there are. Three shard streams
    on the single Redis, each reached through a client of its own as a cluster node's would be;
    with no replica to count, the WAITs are short and the publish raises before the commit. One
    stream: one WAIT, after the commit."""
    import redis

    from rose.weights import stream

    if redis_client.info("replication").get("connected_slaves"):
        pytest.skip("the stack's Redis has a replica: WAIT would be met")
    monkeypatch.setattr(stream, "_PIPELINE_BYTES", 1)  # a flush after every entry
    rcfg = dataclasses.replace(cfg.redis, shard_streams=3, wait_replicas=1, wait_timeout_ms=20)
    keys = weight_keys(rcfg, "m")
    names = [f"{cfg.redis.key_prefix.rstrip(':')}-node{i}" for i in range(3)]
    nodes = [
        SimpleNamespace(name=name, redis_connection=redis.Redis.from_url(cfg.redis.url, client_name=name))
        for name in names
    ]
    node_of = {keys.shard_stream(i): nodes[i] for i in range(3)}

    class ThreeNodes:
        """The single Redis as a cluster client holding shard stream i on node i."""

        def __getattr__(self, name):
            return getattr(redis_client, name)

        def get_node_from_key(self, key):
            return node_of.get(key, nodes[0])

    vs = _versions(1, seed=13)
    pub = WeightPublisher(ThreeNodes(), rcfg, "m", shard_bytes=SHARD, chunk_bytes=4096)
    before = _waits(redis_client)
    with pytest.raises(ReplicationTimeout, match=r"version 1: 0 of 1 replicas .*no commit entry written") as e:
        pub.publish(vs[0][0])
    assert not e.value.committed and _waits(redis_client) - before == 3
    assert all(redis_client.xlen(keys.shard_stream(i)) > 3 for i in range(3))  # several flushes to each
    last = {c["name"]: c["cmd"] for c in redis_client.client_list() if c["name"] in names}
    assert last == dict.fromkeys(names, "wait")  # each node's WAIT came after its entries
    assert redis_client.hget(keys.meta, "version") is None
    for node in nodes:
        node.redis_connection.close()

    one = _publisher(
        redis_client,
        dataclasses.replace(cfg, redis=dataclasses.replace(cfg.redis, wait_replicas=1, wait_timeout_ms=20)),
    )
    before = _waits(redis_client)
    with pytest.raises(ReplicationTimeout, match=r"version 1: 0 of 1 replicas .*its commit entry") as e:
        one.publish(vs[0][0])
    assert e.value.committed and _waits(redis_client) - before == 1
