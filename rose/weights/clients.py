"""The Redis side of the weight streams: the keys of a model's streams (one stream, or a commit
stream and N shard streams spread over a Redis Cluster's slots), the clients that reach them (a
single Redis or a checked RedisCluster) and the errors that mean a node is away rather than a
fault. The publisher (rose.weights.stream) and the follower (rose.weights.follower) share them.
redis itself is imported inside the functions that need it, so that importing this module does not.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from rose.config import RedisConfig


def meta_key(stream: str) -> str:
    return f"{stream}:meta"


CLUSTER_SLOTS = 16384
MAX_SHARD_STREAMS = 1024


class ClusterUnavailable(RuntimeError):
    """The configured Redis Cluster cannot be used; the message names the nodes and why."""


@dataclass(frozen=True)
class WeightKeys:
    """A model's weight-stream keys. `stream` is what followers XREAD: every entry with one
    stream (shard_streams 0), the commit entries alone with shard streams."""

    stream: str
    meta: str
    shard_streams: int  # 0: the single-stream layout
    prefix: str
    model: str

    def shard_stream(self, i: int, n: int | None = None) -> str:
        """Shard stream `i` of `n` (default: this layout's count)."""
        return shard_stream_key(self.prefix, self.model, i, self.shard_streams if n is None else n)


def weight_keys(rcfg: RedisConfig, model: str) -> WeightKeys:
    """The keys of `model`'s weights under `rcfg`: `{prefix}weights:{model}` and its `:meta`
    hash by default (unchanged since the first release), or, with `shard_streams` N > 0, the
    commit stream `{prefix}weights:{<model>}` and its meta hash `{prefix}weights:{<model>}:meta`
    (one hash tag, one slot) and N shard streams `{prefix}weights:{<model>:s<i>.<j>}`, `j` the
    first integer that puts shard stream i's slot in the i-th N-th of the 16384 slots."""
    n = rcfg.shard_streams
    if n == 0:
        stream = rcfg.key("weights", model)
        return WeightKeys(stream, meta_key(stream), 0, rcfg.key_prefix, model)
    if not 0 < n <= MAX_SHARD_STREAMS:
        raise ValueError(f"redis.shard_streams: {n} is not between 0 and {MAX_SHARD_STREAMS}")
    for what, value in (("redis.key_prefix", rcfg.key_prefix), ("model name", model)):
        if "{" in value or "}" in value:
            raise ValueError(
                f"{what} {value!r} holds a brace: with redis.shard_streams the weight keys' hash tags "
                "({model}, {model:s<i>.<j>}) must be the first braces of each key"
            )
    stream = rcfg.key("weights", "{" + model + "}")
    return WeightKeys(stream, meta_key(stream), n, rcfg.key_prefix, model)


@functools.lru_cache(maxsize=4096)
def shard_stream_key(prefix: str, model: str, i: int, n: int) -> str:
    """`{prefix}weights:{<model>:s<i>.<j>}`: shard stream i of n, its hash tag's slot in
    [i*16384/n, (i+1)*16384/n). Masters splitting the slots evenly (`redis-cli --cluster create`,
    `rose stack up --redis-cluster`) so hold the n streams in turn, one per master when n is their
    number."""
    from redis.crc import key_slot

    if not 0 <= i < n <= MAX_SHARD_STREAMS:
        raise ValueError(f"shard stream {i} of {n}: not a valid shard stream")
    lo, hi = i * CLUSTER_SLOTS // n, (i + 1) * CLUSTER_SLOTS // n
    j = 0
    while not lo <= key_slot(f"{model}:s{i}.{j}".encode()) < hi:
        j += 1
    return f"{prefix}weights:{{{model}:s{i}.{j}}}"


def cluster_nodes(rcfg: RedisConfig) -> list[tuple[str, int]]:
    """`redis.cluster_nodes` as (host, port) pairs; ValueError naming a malformed one."""
    nodes = []
    for item in rcfg.cluster_nodes.split(","):
        item = item.strip()
        if not item:
            continue
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"redis.cluster_nodes: {item!r} is not host:port (in {rcfg.cluster_nodes!r})")
        nodes.append((host.strip("[]"), int(port)))
    return nodes


def redis_client(rcfg: RedisConfig, *, timeout_s: float = 5.0) -> Any:
    """A client for `rcfg`: redis.Redis at `url`, or, with `cluster_nodes`, a
    redis.cluster.RedisCluster started from those nodes (the url's scheme, user and password
    apply to each) whose every configured node answers and every node says cluster_state:ok;
    ClusterUnavailable otherwise."""
    import redis

    if not rcfg.cluster_nodes.strip():
        return redis.Redis.from_url(rcfg.url)
    from redis.cluster import ClusterNode, RedisCluster
    from redis.connection import SSLConnection, parse_url
    from redis.exceptions import RedisClusterException  # not a RedisError

    nodes = cluster_nodes(rcfg)
    where = ",".join(f"{h}:{p}" for h, p in nodes)
    kwargs = {k: v for k, v in parse_url(rcfg.url).items() if k not in ("host", "port", "db", "path")}
    if kwargs.pop("connection_class", None) is SSLConnection:
        kwargs["ssl"] = True
    kwargs.setdefault("socket_connect_timeout", timeout_s)
    try:
        rc = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], **kwargs)
    except (redis.RedisError, RedisClusterException, OSError) as e:
        raise ClusterUnavailable(
            f"Redis Cluster at {where} (redis.cluster_nodes) is not usable: {e}; "
            "start a local one with `rose stack up --redis-cluster`"
        ) from None
    try:
        info = rc.cluster_info(target_nodes=RedisCluster.ALL_NODES)
    except (redis.RedisError, RedisClusterException, OSError) as e:
        rc.close()
        raise ClusterUnavailable(f"Redis Cluster at {where}: CLUSTER INFO failed: {e}") from None
    # one dict per node ({node: info}), or one info dict when a single node answered
    per_node: dict[str, Any] = info if all(isinstance(v, dict) for v in info.values()) else {where: info}
    bad = {n: f"cluster_state:{i.get('cluster_state')}" for n, i in per_node.items() if i.get("cluster_state") != "ok"}
    bad.update(_configured_nodes_down(nodes, kwargs, timeout_s))
    if bad:
        rc.close()
        said = ", ".join(f"{n} {s}" for n, s in bad.items())
        raise ClusterUnavailable(f"Redis Cluster at {where} is not ok: {said}")
    return rc


def _configured_nodes_down(nodes: list[tuple[str, int]], kwargs: dict[str, Any], timeout_s: float) -> dict[str, str]:
    """The configured nodes that do not answer CLUSTER INFO, each with why. Asked one by one:
    the cluster's own view drops a stopped replica once the others mark it failed, so asking
    through the cluster client names a stopped node or not depending on when it is asked."""
    import redis

    down = {}
    for h, p in nodes:
        node = redis.Redis(host=h, port=p, **{**kwargs, "socket_timeout": timeout_s})
        try:
            node.execute_command("CLUSTER INFO")
        except (redis.RedisError, OSError) as e:
            down[f"{h}:{p}"] = f"does not answer ({type(e).__name__}: {e})"
        finally:
            node.close()
    return down


def weights_client(rcfg: RedisConfig, plain: Any = None) -> Any:
    """The client for `rcfg`'s weight streams. Without `cluster_nodes`: `plain` when given (the
    process's redis.Redis at `url`, shared with its task streams), else a new one; with
    `cluster_nodes`: a new RedisCluster (`redis_client`: ClusterUnavailable, or ValueError for
    malformed nodes), whatever `plain` is. Only the weight streams live on the cluster; task
    streams, heartbeats and the rest stay on the single Redis at `url`."""
    if plain is not None and not rcfg.cluster_nodes.strip():
        return plain
    return redis_client(rcfg)


@functools.cache
def unavailable_errors() -> tuple[type[BaseException], ...]:
    """What Redis commands raise while Redis or a cluster node is away, to be retried rather than
    fatal: refused and timed-out connections (LOADING after a restart is a ConnectionError) and,
    on a Redis Cluster, CLUSTERDOWN and MASTERDOWN (ClusterError), TRYAGAIN while slots move, a
    slot no node serves (SlotNotCoveredError) and no startup node answering a re-discovery
    (RedisClusterException, which is not a RedisError). A weight follower's commands (XREAD,
    XRANGE, HGET of one key each) raise no other RedisClusterException."""
    import redis
    from redis.exceptions import ClusterError, RedisClusterException, TryAgainError

    return (redis.ConnectionError, redis.TimeoutError, ClusterError, TryAgainError, RedisClusterException)


def failed_over(e: BaseException) -> bool:
    """Whether `e` ended a blocked command because its node turned replica (redis-py's
    ResponseError `UNBLOCKED ... (master -> replica?)`). redis is imported here, when asked, so
    that importing the follower does not import it."""
    import redis

    return isinstance(e, redis.ResponseError) and str(e).startswith("UNBLOCKED")


@functools.cache
def node_failed_over() -> type[Exception]:
    """NodeFailedOver, made on first use (redis is imported here, not with this module)."""
    import redis

    class NodeFailedOver(redis.ConnectionError):
        """A blocked XREAD its node ended on turning replica (`failed_over`), raised by the
        follower in place of redis-py's ResponseError. A failover in progress, waited out like a
        node that is away: a ConnectionError, so every loop that retries `unavailable_errors`
        retries it."""

    return NodeFailedOver
