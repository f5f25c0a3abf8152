"""Weights on a real Redis Cluster of three masters and their three replicas (`rose stack up
--redis-cluster`, Debian's redis-server): a model's shard streams spread over the masters, a
follower on a RedisCluster client applies every version once and bit-exact, a publisher dying
between its shard writes and its commit leaves followers on the previous version until the next
publish, and a wrongly signed commit is refused. Failover while the trainer publishes (CLUSTER
FAILOVER on a replica, SIGKILL of a master) loses no committed version; a version its master
acknowledged but never replicated is lost in a takeover unless the publisher WAITs for a replica
(redis.wait_replicas), and a publish whose WAIT times out commits nothing. The cluster runs on
ports of its own, so the normal stack is untouched."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import orjson
import pytest
import redis

from rose.config import RedisConfig, StackConfig
from rose.stack import LocalStack, free_port
from rose.stack.ports import listening
from rose.stack.redis_cluster import CLUSTER_SIZE, MASTERS, NODE_TIMEOUT_MS
from rose.weights.clients import ClusterUnavailable, redis_client, unavailable_errors, weight_keys
from rose.weights.entries import to_fields
from rose.weights.follower import FileStateStore, WeightFollower
from rose.weights.layout import flatten, make_layout
from rose.weights.stream import ReplicationTimeout, WeightPublisher

SHARD = 16 << 10
SPECS = {"w": ("bfloat16", (40_000,)), "b": ("float32", (3_000,)), "step": ("int64", ())}


def _versions(n: int, seed: int = 0) -> list[tuple[dict, np.ndarray]]:
    """n successive states (raw bytes per tensor) with sparse changes, and each one's flat bytes."""
    rng = np.random.default_rng(seed)
    layout = make_layout(SPECS, SHARD)
    sizes = {t.name: t.nbytes for t in layout.tensors}
    arrays = {k: rng.integers(0, 256, size, dtype=np.uint8) for k, size in sizes.items()}
    out = []
    for _ in range(n):
        arrays = {k: a.copy() for k, a in arrays.items()}
        w = arrays["w"]
        w[rng.integers(0, w.size, 300)] ^= 1
        arrays["step"][:1] += 1  # an array op: the byte wraps at 256 without a warning
        out.append((arrays, flatten(layout, arrays)))
    return out


def _free_base() -> int:
    """A Redis port whose six next ports and their cluster bus ports (+10000) are free."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(12000, 22000)  # all below the ephemeral range (32768-)
        if not any(listening(p) or listening(p + 10000) for p in range(base + 1, base + 1 + CLUSTER_SIZE)):
            return base
    raise RuntimeError("no free ports for a Redis Cluster")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A Redis Cluster (3 masters, 3 replicas) started by the code behind `rose stack up --redis-cluster`."""
    root = tmp_path_factory.mktemp("redis-cluster") / ".rose-stack"
    scfg = dataclasses.replace(StackConfig(), data_dir=str(root), redis_port=_free_base(), kafka_port=free_port())
    st = LocalStack(scfg, f"127.0.0.1:{scfg.kafka_port}", f"redis://127.0.0.1:{scfg.redis_port}/0")
    try:
        st.redis_cluster_up()
        yield st
    finally:
        st.down()


@pytest.fixture
def rcfg(cluster) -> RedisConfig:
    return RedisConfig(
        url="redis://",
        key_prefix=f"t{uuid.uuid4().hex[:10]}:",
        cluster_nodes=cluster.redis_cluster_nodes,
        shard_streams=3,
    )


@pytest.fixture
def rc(rcfg):
    c = redis_client(rcfg)
    yield c
    c.close()


def _publisher(rc, rcfg, cls=WeightPublisher, **kw):
    kw.setdefault("shard_bytes", SHARD)
    kw.setdefault("chunk_bytes", 4096)  # several parts per shard
    return cls(rc, rcfg, "m", **kw)


def _publish(pub, arrays, **kw):
    return pub.publish_raw(SPECS, arrays, **kw)


def _commit_streams(rc, stream: str) -> list[list[int]]:
    (_, fields), *_ = rc.xrevrange(stream, count=1)
    return orjson.loads(fields[b"payload"])["streams"]


@pytest.mark.stack
def test_shard_streams_spread_over_the_nodes(rc, rcfg, cluster):
    [(arrays, _)] = _versions(1)
    pub = _publisher(rc, rcfg)
    stats = _publish(pub, arrays)
    assert stats.keyframe and stats.shards_sent >= 3
    keys = weight_keys(rcfg, "m")
    assert (keys.stream, keys.meta) == (f"{rcfg.key_prefix}weights:{{m}}", f"{rcfg.key_prefix}weights:{{m}}:meta")
    listed = _commit_streams(rc, keys.stream)
    assert [i for i, *_ in listed] == [0, 1, 2]
    ports = {}
    for i in range(3):
        key = keys.shard_stream(i)
        slot = rc.cluster_keyslot(key)  # CLUSTER KEYSLOT, asked of the cluster
        assert i * 16384 // 3 <= slot < (i + 1) * 16384 // 3
        node = rc.get_node_from_key(key)
        ports[key] = node.port
        direct = redis.Redis(host="127.0.0.1", port=node.port)  # the entries are on that node itself
        assert direct.xlen(key) == listed[i][3] > 0
        direct.close()
    assert len(set(ports.values())) == 3, ports  # one shard stream per master
    assert rc.cluster_keyslot(keys.stream) == rc.cluster_keyslot(keys.meta)  # commit + meta: one slot


@pytest.mark.stack
def test_a_cluster_follower_applies_every_version_once_bit_exact(rc, rcfg, tmp_path):
    vs = _versions(9, seed=1)
    pub = _publisher(rc, rcfg, keyframe_every=3)
    f = WeightFollower(rc, rcfg, "m", FileStateStore(tmp_path))
    for i, (arrays, flat) in enumerate(vs):
        stats = _publish(pub, arrays)
        assert stats.keyframe == (i % 4 == 0)
        if i % 2:
            assert f.poll(0) == i + 1 and np.array_equal(f.receiver.visible().flat, flat)
        if i == 5:  # the follower restarts from its state file: nothing applied twice
            f = WeightFollower(rc, rcfg, "m", FileStateStore(tmp_path))
    f.poll(0)
    assert f.stats.applied_versions == list(range(1, 10))
    assert np.array_equal(f.receiver.visible().flat, vs[-1][1]) and f.newest() == 9
    assert f.poll(0) is None and f.stats.duplicates == 0  # read again: nothing new
    late = WeightFollower(rc, rcfg, "m")
    assert late.poll(0) == 9 and np.array_equal(late.receiver.visible().flat, vs[-1][1])
    assert late.stats.applied_versions[0] == 9  # from the newest keyframe (9), nothing else


class _DiesBeforeCommit(WeightPublisher):
    def _commit_fields(self, commit):
        raise RuntimeError("publisher killed between its shard writes and its commit")


@pytest.mark.stack
def test_a_publisher_dying_before_its_commit_leaves_the_previous_version(rc, rcfg):
    vs = _versions(4, seed=2)
    pub = _publisher(rc, rcfg, keyframe_every=100)
    f = WeightFollower(rc, rcfg, "m")
    _publish(pub, vs[0][0])
    _publish(pub, vs[1][0])
    assert f.poll(0) == 2
    dying = _publisher(rc, rcfg, _DiesBeforeCommit, keyframe_every=100)
    with pytest.raises(RuntimeError, match="killed"):
        _publish(dying, vs[2][0])
    keys = weight_keys(rcfg, "m")
    last_commit = int(rc.hget(keys.meta, "last_seq"))
    tails = [int(rc.xinfo_stream(keys.shard_stream(i))["last-generated-id"].split(b"-")[1]) for i in range(3)]
    assert max(tails) > last_commit  # its shard entries are there, no commit lists them
    assert f.poll(0) is None and f.receiver.visible().version == 2
    assert np.array_equal(f.receiver.visible().flat, vs[1][1]) and f.newest() == 2
    restarted = _publisher(rc, rcfg, keyframe_every=100)  # the trainer comes back
    s = _publish(restarted, vs[2][0])
    assert s.keyframe and s.version == 3 and s.seq_first > max(tails)
    _publish(restarted, vs[3][0])
    assert f.poll(0) == 4
    assert f.stats.applied_versions == [1, 2, 3, 4] and np.array_equal(f.receiver.visible().flat, vs[3][1])
    late = WeightFollower(rc, rcfg, "m")
    assert late.poll(0) == 4 and late.stats.applied_versions == [3, 4]


class _ForgesItsCommit(WeightPublisher):
    def _commit_fields(self, commit):
        return to_fields(commit, b"not the key")


@pytest.mark.stack
def test_a_wrongly_signed_commit_is_refused(rc, rcfg):
    vs = _versions(4, seed=3)
    key = "s3cret"
    pub = _publisher(rc, rcfg, keyframe_every=100, hmac_key=key)
    f = WeightFollower(rc, rcfg, "m", hmac_key=key)
    _publish(pub, vs[0][0])
    assert f.poll(0) == 1
    forger = _publisher(rc, rcfg, _ForgesItsCommit, keyframe_every=100, hmac_key=key)
    # a keyframe (a new publisher's first version): its shard entries signed right, its commit not
    assert _publish(forger, vs[1][0]).keyframe
    assert f.poll(0) is None and f.stats.refused == 1
    assert f.receiver.visible().version == 1 and np.array_equal(f.receiver.visible().flat, vs[0][1])
    unkeyed = WeightFollower(rc, rcfg, "m", hmac_key="another")  # starts at that keyframe's commit
    assert unkeyed.poll(0) is None and unkeyed.receiver.visible() is None and unkeyed.stats.refused == 1
    trainer = _publisher(rc, rcfg, keyframe_every=100, hmac_key=key)  # the real trainer, (re)started
    assert _publish(trainer, vs[2][0]).keyframe
    assert f.poll(0) == 3 and np.array_equal(f.receiver.visible().flat, vs[2][1])
    assert f.stats.applied_versions == [1, 3]


@pytest.mark.stack
def test_stack_status_shows_the_cluster(cluster):
    from typer.testing import CliRunner

    from rose.cli import app

    env = {"ROSE_STACK__DATA_DIR": str(cluster.root), "ROSE_STACK__REDIS_PORT": str(cluster.scfg.redis_port)}
    env["ROSE_STACK__KAFKA_PORT"] = str(cluster.scfg.kafka_port)
    r = CliRunner().invoke(app, ["stack", "status"], env=env)
    assert f"redis-cluster: up ({cluster.redis_cluster_nodes}, cluster_state ok)" in r.output, r.output
    assert r.exit_code == 1  # this stack's Kafka and Redis are not running


def test_bad_cluster_settings_say_what_is_wrong():
    port = free_port()
    with pytest.raises(ClusterUnavailable, match=rf"127\.0\.0\.1:{port}.*rose stack up --redis-cluster"):
        redis_client(RedisConfig(cluster_nodes=f"127.0.0.1:{port}"))
    with pytest.raises(ValueError, match="redis.cluster_nodes: 'nonsense' is not host:port"):
        redis_client(RedisConfig(cluster_nodes="nonsense"))
    with pytest.raises(ValueError, match="model name 'a{b}' holds a brace"):
        weight_keys(RedisConfig(shard_streams=3), "a{b}")
    with pytest.raises(ValueError, match="redis.shard_streams: -1"):
        weight_keys(RedisConfig(shard_streams=-1), "m")
    default = weight_keys(RedisConfig(), "m")  # the single-stream layout, as ever
    assert (default.stream, default.meta, default.shard_streams) == ("rose:weights:m", "rose:weights:m:meta", 0)


@pytest.mark.stack
def test_a_plain_redis_or_a_node_down_is_named(cluster, rcfg):
    cluster.redis_up()  # this stack's plain Redis: not a cluster node
    try:
        with pytest.raises(ClusterUnavailable, match=rf"127\.0\.0\.1:{cluster.scfg.redis_port}.*[Cc]luster mode"):
            redis_client(dataclasses.replace(rcfg, cluster_nodes=f"127.0.0.1:{cluster.scfg.redis_port}"))
    finally:
        cluster.redis_down()
    down = cluster.redis_cluster_ports[1]
    assert cluster._stop("redis-cluster-1", 10.0)
    with pytest.raises(ClusterUnavailable, match=rf"127\.0\.0\.1:{down}"):
        redis_client(rcfg)
    assert not cluster.redis_cluster_alive()
    assert f"127.0.0.1:{down} does not answer as a cluster node" in cluster._said()
    cluster.redis_cluster_up()  # restarts the node, which rejoins from its nodes.conf
    rc = redis_client(rcfg)
    [(arrays, flat)] = _versions(1, seed=4)
    _publish(_publisher(rc, rcfg), arrays)
    f = WeightFollower(rc, rcfg, "m")
    assert f.poll(0) == 1 and np.array_equal(f.receiver.visible().flat, flat)
    rc.close()


class _FlakyCluster:
    """The cluster client, raising what redis-py raises while a node is away: on the first XREADs,
    then on one XRANGE in the middle of a version (after some of its shard entries were taken)."""

    def __init__(self, rc, xread_errors, xrange_error, xrange_at):
        self.rc, self.xread_errors, self.xrange_error, self.xrange_at = rc, list(xread_errors), xrange_error, xrange_at
        self.xranges = 0

    def __getattr__(self, name):
        return getattr(self.rc, name)

    def xread(self, *a, **kw):
        if self.xread_errors:
            raise self.xread_errors.pop(0)
        return self.rc.xread(*a, **kw)

    def xrange(self, *a, **kw):
        self.xranges += 1
        if self.xranges == self.xrange_at:
            raise self.xrange_error
        return self.rc.xrange(*a, **kw)


@pytest.mark.stack
def test_follow_waits_out_cluster_errors_and_says_so(rc, rcfg):
    """`follow` retries the cluster's own errors as it does a refused connection, one log line
    per kind, and a read cut short mid-version resumes after what it took: nothing twice."""
    from redis.exceptions import ClusterDownError, MasterDownError, RedisClusterException, SlotNotCoveredError
    from structlog.testing import capture_logs

    vs = _versions(2, seed=6)
    pub = _publisher(rc, rcfg, keyframe_every=100)
    for arrays, _ in vs:
        _publish(pub, arrays)
    errors = [
        ClusterDownError("The cluster is down"),
        ClusterDownError("The cluster is down"),  # the same kind again: not said twice
        MasterDownError("MASTERDOWN Link with MASTER is down"),
        RedisClusterException("Redis Cluster cannot be connected. Please provide at least one reachable node"),
    ]
    flaky = _FlakyCluster(rc, errors, SlotNotCoveredError('Slot "42" is not covered by the cluster.'), 5)
    with capture_logs() as logs:
        f = WeightFollower(flaky, rcfg, "m", batch=2)  # 2 entries an XRANGE: several per stream
        f.follow(until_version=2, block_ms=100)
    said = [x for x in logs if x["event"] == "redis.cluster_unavailable"]
    assert [x["error"].split(":")[0] for x in said] == [
        "ClusterDownError",
        "MasterDownError",
        "RedisClusterException",
        "SlotNotCoveredError",
    ]
    assert said[0]["nodes"] == rcfg.cluster_nodes and "rose stack up --redis-cluster" in said[0]["hint"]
    assert flaky.xranges > 5 and f.stats.applied_versions == [1, 2]
    assert f.stats.duplicates == 0 and f.stats.gaps == 0  # resumed after the entries it had taken
    assert np.array_equal(f.receiver.visible().flat, vs[-1][1])


def _follow_cli(rcfg: RedisConfig, out, until: int, hmac_key: str) -> subprocess.Popen:
    """`rose weights follow` on the cluster, configured by ROSE_* environment variables alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROSE_")}
    env.update(
        ROSE_REDIS_URL=rcfg.url,
        ROSE_REDIS__KEY_PREFIX=rcfg.key_prefix,
        ROSE_REDIS__CLUSTER_NODES=rcfg.cluster_nodes,
        ROSE_REDIS__SHARD_STREAMS=str(rcfg.shard_streams),
        ROSE_SECURITY__WEIGHTS_HMAC_KEY=hmac_key,
    )
    argv = ["weights", "follow", "--model", "m", "--out", str(out), "--until-version", str(until)]
    log = open(out.parent / "follow.log", "wb")
    try:
        return subprocess.Popen([sys.executable, "-m", "rose.cli", *argv], env=env, stdout=subprocess.PIPE, stderr=log)
    finally:
        log.close()


def _wait(what: str, cond, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.stack
def test_rose_weights_follow_on_the_cluster_outlives_a_node_down(rc, rcfg, cluster, tmp_path):
    """The CLI follower, given the cluster by ROSE_REDIS__CLUSTER_NODES and
    ROSE_REDIS__SHARD_STREAMS, applies a WeightPublisher's versions; the master holding one of
    the shard streams and its replica stop (the other masters answer CLUSTERDOWN once they mark
    it failed) and come back; the follower waits, says so, and ends at the last version,
    bit-exact, each applied once."""
    vs = _versions(4, seed=7)
    key = "cluster-key"
    pub = _publisher(rc, rcfg, keyframe_every=100, hmac_key=key)
    for arrays, _ in vs[:2]:
        _publish(pub, arrays)
    keys = weight_keys(rcfg, "m")
    down = _master_of(rc, keys.shard_stream(1))  # holds shard stream 1 only
    # not the commit stream's node, nor redis-py's default node (COMMAND GETKEYS for every XREAD):
    # the follower's reads reach the other masters, which answer CLUSTERDOWN
    assert rc.get_node_from_key(keys.stream).port != down and rc.get_default_node().port != down
    # the master and its replica: no failover, the slots stay uncovered until they come back
    stopped = [down, *cluster.redis_cluster_topology()[down]]
    out = tmp_path / "w"
    p = _follow_cli(rcfg, out, until=4, hmac_key=key)
    log = tmp_path / "follow.log"
    try:
        _wait("version 2 on disk", lambda: (got := FileStateStore(out).load()) is not None and got[0].version == 2)
        for port in stopped:
            assert cluster._stop(cluster.redis_cluster_node_name(port), 10.0)
        try:
            _wait("the follower to say the cluster is down", lambda: b"ClusterDownError" in log.read_bytes(), 40)
            assert p.poll() is None, log.read_text()  # waiting, not dead
        finally:
            cluster.redis_cluster_up()
        for arrays, _ in vs[2:]:
            _publish(pub, arrays)
        stdout, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, log.read_text()[-3000:]
    said = [orjson.loads(line) for line in log.read_bytes().splitlines() if b"redis.cluster_unavailable" in line]
    assert said and said[0]["nodes"] == rcfg.cluster_nodes and said[0]["error"].startswith("ClusterDownError")
    result = orjson.loads(stdout.splitlines()[-1])
    assert result["version"] == 4 and result["duplicates"] == 0 and result["refused"] == 0
    snap, applied = FileStateStore(out).load()
    assert applied == [1, 2, 3, 4] and np.array_equal(snap.flat, vs[-1][1])


@pytest.mark.stack
def test_a_worker_config_carries_the_cluster_to_the_worker(rc, rcfg):
    """cluster_nodes and shard_streams go from the config (ROSE_* environment) through the
    executor's WorkerConfig and its JSON on a descriptor to the worker, whose weight source
    follows the cluster; a config written before them still loads, with their defaults."""
    pytest.importorskip("torch")  # the worker's weight source builds a model
    from rose.config import load_config
    from rose.executor import lease_machine as lm
    from rose.executor.workers import worker_config
    from rose.rollout.launcher import WorkerConfig, _config_file, read_config
    from rose.rollout.worker_process import weight_source

    env = {
        "ROSE_REDIS_URL": rcfg.url,
        "ROSE_REDIS__KEY_PREFIX": rcfg.key_prefix,
        "ROSE_REDIS__CLUSTER_NODES": rcfg.cluster_nodes,
        "ROSE_REDIS__SHARD_STREAMS": "3",
        "ROSE_EXECUTOR__MODEL": "m",
        "ROSE_EXECUTOR__WORKER_WEIGHTS": "follow",
    }
    cfg = load_config(env=env)
    assert cfg.redis == rcfg
    wc = worker_config(cfg, lm.Start("n/0", "l", 1, 1 << 30, 0.5, False), "flag", "cpu", 3)
    text = wc.to_json()
    assert WorkerConfig.from_json(text) == wc
    back = read_config(_config_file(text.encode()))
    assert back == wc and (back.redis.cluster_nodes, back.redis.shard_streams) == (rcfg.cluster_nodes, 3)
    old = orjson.loads(text)
    del old["redis"]["cluster_nodes"], old["redis"]["shard_streams"]
    plain = WorkerConfig.from_json(orjson.dumps(old))
    assert (plain.redis.cluster_nodes, plain.redis.shard_streams) == ("", 0) and plain.redis.url == rcfg.url
    bad = text.replace('"shard_streams":3', '"shard_streams":"3"')
    with pytest.raises(ValueError, match="redis.shard_streams: expected int, got '3'"):
        WorkerConfig.from_json(bad)

    [(arrays, flat)] = _versions(1, seed=8)
    _publish(_publisher(rc, rcfg), arrays)
    ws = weight_source(back, None)
    try:
        assert ws.follower.cluster and ws.newest() == 1
        assert np.array_equal(ws.follower.receiver.visible().flat, flat)
    finally:
        ws.follower.redis.close()


# -- failover ---------------------------------------------------------------------------------


def _node(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)


def _role(port: int) -> str:
    r = _node(port)
    try:
        return r.execute_command("ROLE")[0].decode()
    except (redis.RedisError, OSError):
        return "down"
    finally:
        r.close()


def _master_of(rc, key: str) -> int:
    """The port of the master serving `key`'s slot now (the client's slot map refreshed first)."""
    rc.nodes_manager.initialize()
    return rc.get_node_from_key(key).port


def _retry(what: str, fn, timeout_s: float = 30.0):
    """fn(), again while the cluster is away (a node down, a failover under way)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return fn()
        except unavailable_errors():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.1)


def _kill(cluster, port: int) -> None:
    """SIGKILL the node on `port` (a child of this process: reaped here)."""
    pid = int(cluster._pidfile(cluster.redis_cluster_node_name(port)).read_text())
    os.kill(pid, signal.SIGKILL)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


class _Paused:
    """CLIENT PAUSE WRITE on a replica: what its master sends it waits, unapplied, while paused
    (and is dropped with the link if the master dies meanwhile); its master's WAIT counts it not."""

    def __init__(self, port: int):
        self.r = _node(port)

    def __enter__(self):
        self.r.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
        return self

    def __exit__(self, *exc):
        self.r.execute_command("CLIENT", "UNPAUSE")
        self.r.close()


def _lose_unreplicated(cluster, master: int, act) -> int:
    """With `master`'s replica paused, `act()`; then SIGKILL `master` and make the replica take
    over without it (CLUSTER FAILOVER TAKEOVER): what `act` wrote to `master` alone is gone. The
    new master's port."""
    [replica] = cluster.redis_cluster_topology()[master]
    with _Paused(replica) as paused:
        act()
        _kill(cluster, master)
        paused.r.execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
        _wait("the replica to take over", lambda: _role(replica) == "master", 10)
    return replica


def _committed_on(port: int, keys) -> tuple[int, int]:
    """(version, seq) of the last commit entry in the commit stream on the node on `port`."""
    r = _node(port)
    try:
        [(_, fields)] = r.xrevrange(keys.stream, count=1)
        return int(fields[b"version"]), int(fields[b"seq"])
    finally:
        r.close()


@pytest.mark.stack
def test_the_cluster_is_three_masters_each_with_a_replica(cluster):
    topology = cluster.redis_cluster_topology()
    ports = cluster.redis_cluster_ports
    assert len(ports) == CLUSTER_SIZE == 6 and ports == list(range(cluster.scfg.redis_port + 1, ports[0] + 6))
    assert len(topology) == MASTERS and all(len(r) == 1 for r in topology.values())
    assert sorted(p for m, r in topology.items() for p in (m, *r)) == ports
    for port in ports:
        r = _node(port)
        assert r.config_get("cluster-node-timeout") == {"cluster-node-timeout": str(NODE_TIMEOUT_MS)}
        r.close()
    assert cluster.redis_cluster_nodes == ",".join(f"127.0.0.1:{p}" for p in ports)
    print(f"cluster-node-timeout {NODE_TIMEOUT_MS} ms; masters and their replicas {topology}")


def _digest(flat: np.ndarray) -> bytes:
    return hashlib.blake2b(flat.tobytes(), digest_size=16).digest()


class _Recording(WeightFollower):
    """A follower noting each version it makes visible, with its bytes' digest."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: list[tuple[int, bytes]] = []
        self.unblocked: list[str] = []  # the errors `follow` waited out

    def _offer_commit(self, fields):
        v = super()._offer_commit(fields)
        if v is not None:
            self.seen.append((v, _digest(self.receiver.visible().flat)))
        return v

    def _say_unavailable(self, e: BaseException) -> None:
        self.unblocked.append(f"{type(e).__name__}: {e}")
        super()._say_unavailable(e)


class _Trainer(threading.Thread):
    """Publishes `states` in turn, `pace_s` apart, on a client of its own until `stop`, and
    publishes a state again when its publish raised (a node away, a WAIT short):
    `published` {version: digest} of each publish that returned, `errors` what raised."""

    def __init__(self, rcfg: RedisConfig, states, pace_s: float = 0.05):
        super().__init__(daemon=True)
        self.rcfg, self.states, self.pace_s = rcfg, states, pace_s
        self.stop = threading.Event()
        self.published: dict[int, bytes] = {}
        self.errors: list[BaseException] = []
        self.rc = redis_client(rcfg)

    def run(self) -> None:
        pub = _publisher(self.rc, self.rcfg, keyframe_every=4)
        i = 0
        while i < len(self.states) and not self.stop.is_set():
            arrays, flat = self.states[i]
            try:
                s = _publish(pub, arrays)
            except (ReplicationTimeout, redis.ResponseError, *unavailable_errors()) as e:
                self.errors.append(e)
                self.stop.wait(0.1)
                continue
            self.published[s.version] = _digest(flat)
            i += 1
            self.stop.wait(self.pace_s)
        self.rc.close()


def _follow(f: _Recording, stop: threading.Event) -> None:
    """f.follow until `stop`: a node away, or a master turned replica ending a blocked XREAD
    (UNBLOCKED: NodeFailedOver), is waited out inside `follow` and noted in f.unblocked."""
    f.follow(block_ms=100, stop=stop)


def _publish_through(cluster, rcfg, fail_over, tmp_path) -> tuple[_Trainer, _Recording]:
    """A trainer publishing and a follower following (each on a thread of its own) while
    `fail_over()` runs, until five versions after it; the follower then catches up."""
    trainer = _Trainer(rcfg, _versions(400, seed=21))
    f = _Recording(redis_client(rcfg), rcfg, "m", FileStateStore(tmp_path))
    stop = threading.Event()
    follower = threading.Thread(target=_follow, args=(f, stop), daemon=True)
    trainer.start()
    follower.start()
    try:
        _wait("three versions published", lambda: len(trainer.published) >= 3, 30)
        fail_over()
        n = len(trainer.published)
        _wait("five versions after the failover", lambda: len(trainer.published) >= n + 5, 60)
    finally:
        trainer.stop.set()
        trainer.join(30)
    final = max(trainer.published)
    try:
        _wait(
            "the follower at the last version", lambda: (s := f.receiver.visible()) is not None and s.version >= final
        )
    finally:
        stop.set()
        follower.join(30)
        f.redis.close()
    return trainer, f


def _every_version_once(trainer: _Trainer, f: _Recording) -> None:
    versions = [v for v, _ in f.seen]
    assert versions == sorted(set(versions)), versions  # each once, in order
    seen = dict(f.seen)
    assert {v: seen.get(v) for v in trainer.published} == trainer.published  # none missed, bit-exact
    sent = {_digest(flat) for _, flat in trainer.states}
    assert all(d in sent for d in seen.values())  # nothing half-applied
    assert f.stats.duplicates == 0 and f.stats.checksum_errors == 0 and f.stats.refused == 0


@pytest.mark.stack
def test_a_manual_failover_while_publishing_loses_no_version(rc, rcfg, cluster, tmp_path):
    """CLUSTER FAILOVER on the replica of the commit stream's master (the master pauses its
    clients until the replica has everything, then hands over): without WAIT, no version lost."""
    keys = weight_keys(rcfg, "m")
    took: dict[str, float] = {}

    def fail_over() -> None:
        master = _master_of(rc, keys.stream)
        [replica] = cluster.redis_cluster_topology()[master]
        t0 = time.monotonic()
        assert _node(replica).execute_command("CLUSTER", "FAILOVER") == b"OK"
        _wait("the replica to be master", lambda: _role(replica) == "master", 20)
        took["promoted"] = time.monotonic() - t0
        _wait("the old master to replicate it", lambda: _role(master) == "slave", 20)
        took["swapped"] = time.monotonic() - t0

    trainer, f = _publish_through(cluster, rcfg, fail_over, tmp_path)
    print(
        f"CLUSTER FAILOVER: replica master after {took['promoted']:.2f}s, old master its replica after "
        f"{took['swapped']:.2f}s; {len(trainer.published)} versions, errors {trainer.errors}, follower unblocked {f.unblocked}"
    )
    _every_version_once(trainer, f)
    _wait("the cluster alive", cluster.redis_cluster_alive, 30)


@pytest.mark.stack
def test_a_killed_master_fails_over_while_publishing_with_wait(rc, rcfg, cluster, tmp_path):
    """SIGKILL of a master holding a shard stream while the trainer publishes with WAIT for one
    replica: publishes raise until its replica is elected (and, WAIT wanting a replica, the
    killed node is back as the new master's replica); the trainer publishes again; the follower
    sees every version a publish returned, once, bit-exact."""
    wcfg = dataclasses.replace(rcfg, wait_replicas=1, wait_timeout_ms=500)
    keys = weight_keys(wcfg, "m")
    took: dict[str, float] = {}

    def fail_over() -> None:
        master = _master_of(rc, keys.shard_stream(1))
        assert master != _master_of(rc, keys.stream)  # not the commit's: WAIT before it covers all it lists
        [replica] = cluster.redis_cluster_topology()[master]
        t0 = time.monotonic()
        _kill(cluster, master)
        _wait("the replica to be elected", lambda: _role(replica) == "master", 30)
        took["elected"] = time.monotonic() - t0
        cluster.redis_cluster_up()  # the killed node back, as the new master's replica
        took["replicated"] = time.monotonic() - t0
        assert cluster.redis_cluster_topology()[replica] == [master]

    trainer, f = _publish_through(cluster, wcfg, fail_over, tmp_path)
    print(
        f"SIGKILL of a master (cluster-node-timeout {NODE_TIMEOUT_MS} ms): replica elected after "
        f"{took['elected']:.2f}s, killed node its replica after {took['replicated']:.2f}s; "
        f"{len(trainer.published)} versions; {len(trainer.errors)} publishes raised: "
        f"{sorted({type(e).__name__ for e in trainer.errors})}"
    )
    _every_version_once(trainer, f)


def _on_version_1(rc, rcfg: RedisConfig, seed: int):
    """Three states, the weight keys, a publisher that published the first, a follower on it,
    and that version's commit seq."""
    vs = _versions(3, seed=seed)
    pub = _publisher(rc, rcfg, keyframe_every=100)
    f = WeightFollower(rc, rcfg, "m")
    _publish(pub, vs[0][0])
    assert f.poll(0) == 1
    keys = weight_keys(rcfg, "m")
    return vs, keys, pub, f, int(rc.hget(keys.meta, "last_seq"))


@pytest.mark.stack
def test_without_wait_a_takeover_loses_an_acknowledged_version(rc, rcfg, cluster):
    """The hole WAIT closes: version 2 acknowledged by the commit stream's master, read from it
    by a follower, never replicated; the master dies and its replica takes over without it.
    The new master's last commit is version 1: a new follower ends there, while the one that
    read version 2 holds a version the cluster no longer has."""
    vs, keys, pub, early, committed_v1 = _on_version_1(rc, rcfg, seed=11)

    def act() -> None:
        assert _publish(pub, vs[1][0]).version == 2  # acknowledged
        assert early.poll(0) == 2  # and read
        assert _committed_on(master, keys)[0] == 2

    master = _master_of(rc, keys.stream)
    try:
        new = _lose_unreplicated(cluster, master, act)
        assert _committed_on(new, keys) == (1, committed_v1)  # version 2's commit is gone
        assert _node(new).hget(keys.meta, "version") == b"1"
        late = WeightFollower(rc, rcfg, "m")
        assert _retry("a late follower", lambda: late.poll(0)) == 1
        assert np.array_equal(late.receiver.visible().flat, vs[0][1])
        assert early.receiver.visible().version == 2 and np.array_equal(early.receiver.visible().flat, vs[1][1])
        assert _retry("a follower reading on", lambda: early.poll(0)) is None
        assert early.newest() == 1  # behind what it shows
    finally:
        cluster.redis_cluster_up()


@pytest.mark.stack
def test_with_wait_a_takeover_leaves_followers_on_a_version_the_new_master_holds(rc, rcfg, cluster):
    """The same takeover with redis.wait_replicas 1: the publish of version 2 raises (its shard
    entries not replicated) and writes no commit, so no follower ever sees it; after the takeover
    followers are on version 1, the new master's last commit; the trainer publishes again."""
    wcfg = dataclasses.replace(rcfg, wait_replicas=1, wait_timeout_ms=300)
    vs, keys, pub, f, committed_v1 = _on_version_1(rc, wcfg, seed=12)
    master = _master_of(rc, keys.stream)

    def act() -> None:
        with pytest.raises(ReplicationTimeout, match=r"version 2: 0 of 1 replicas") as e:
            _publish(pub, vs[1][0])
        assert (e.value.committed, e.value.reached, e.value.node) == (False, 0, f"127.0.0.1:{master}")
        assert f.poll(0) is None and _committed_on(master, keys) == (1, committed_v1)

    try:
        new = _lose_unreplicated(cluster, master, act)
        assert _committed_on(new, keys) == (1, committed_v1) and _node(new).hget(keys.meta, "version") == b"1"
        assert _retry("the follower reading on", lambda: f.poll(0)) is None
        assert f.receiver.visible().version == 1 and np.array_equal(f.receiver.visible().flat, vs[0][1])
        late = WeightFollower(rc, wcfg, "m")
        assert _retry("a late follower", lambda: late.poll(0)) == 1
    finally:
        cluster.redis_cluster_up()  # the killed master back as the new one's replica: WAIT can be met
    s = _retry("the trainer publishing again", lambda: _publish(pub, vs[1][0]))
    assert (s.version, s.keyframe) == (2, True)
    assert f.poll(0) == 2 and np.array_equal(f.receiver.visible().flat, vs[1][1])
    assert f.stats.applied_versions == [1, 2] and late.poll(0) == 2


@pytest.mark.stack
def test_a_publish_whose_wait_times_out_raises_and_commits_nothing(rc, rcfg, cluster):
    wcfg = dataclasses.replace(rcfg, wait_replicas=1, wait_timeout_ms=200)
    vs, keys, pub, f, _ = _on_version_1(rc, wcfg, seed=13)
    master = _master_of(rc, keys.shard_stream(2))
    [replica] = cluster.redis_cluster_topology()[master]
    with _Paused(replica):
        t0 = time.monotonic()
        with pytest.raises(ReplicationTimeout, match=r"0 of 1 replicas .*no commit entry written.*200 ms") as e:
            _publish(pub, vs[1][0])
        assert time.monotonic() - t0 >= 0.2 and not e.value.committed
    last_commit = int(rc.hget(keys.meta, "last_seq"))
    assert rc.hget(keys.meta, "version") == b"1" and _committed_on(_master_of(rc, keys.stream), keys)[0] == 1
    tails = [int(rc.xinfo_stream(keys.shard_stream(i))["last-generated-id"].split(b"-")[1]) for i in range(3)]
    assert max(tails) > last_commit  # its shard entries are there, no commit lists them
    assert f.poll(0) is None and np.array_equal(f.receiver.visible().flat, vs[0][1])
    s = _publish(pub, vs[1][0])  # the trainer publishes again, the replica answering
    assert (s.version, s.keyframe) == (2, True) and s.seq_first > max(tails)
    assert f.poll(0) == 2 and np.array_equal(f.receiver.visible().flat, vs[1][1])
    # more replicas wanted than there are: the count reached is said
    with pytest.raises(ReplicationTimeout, match=r"version 3: 1 of 2 replicas"):
        _publish(_publisher(rc, dataclasses.replace(wcfg, wait_replicas=2)), vs[2][0])
    assert f.poll(0) is None and f.stats.applied_versions == [1, 2]


@pytest.mark.stack
def test_wait_on_a_single_redis_without_a_replica(cluster):
    """One stream on a single Redis: the commit goes with its shards, WAIT after it; with no
    replica to count, the publish raises once the version is committed (followers see it) and
    says so; wait_replicas 0 publishes on. Negative settings are refused."""
    cluster.redis_up()
    try:
        cfg = RedisConfig(url=cluster.redis_url, key_prefix=f"t{uuid.uuid4().hex[:10]}:")
        r = redis_client(cfg)
        vs = _versions(2, seed=14)
        waiting = _publisher(r, dataclasses.replace(cfg, wait_replicas=1, wait_timeout_ms=100))
        with pytest.raises(ReplicationTimeout, match=r"version 1: 0 of 1 replicas .*its commit entry") as e:
            _publish(waiting, vs[0][0])
        assert e.value.committed and e.value.node == cfg.safe_url
        f = WeightFollower(r, cfg, "m")
        assert f.poll(0) == 1 and np.array_equal(f.receiver.visible().flat, vs[0][1]) and f.newest() == 1
        assert _publish(_publisher(r, cfg), vs[1][0]).version == 2 and f.poll(0) == 2
        with pytest.raises(ValueError, match="redis.wait_replicas -1"):
            _publisher(r, dataclasses.replace(cfg, wait_replicas=-1))
        one_stream = dataclasses.replace(cfg, cluster_nodes="127.0.0.1:1", wait_replicas=1)
        with pytest.raises(ValueError, match=r"on a Redis Cluster needs redis.shard_streams > 0"):
            _publisher(r, one_stream)
        r.close()
    finally:
        cluster.redis_down()
