"""The stack's Redis Cluster (`rose stack up --redis-cluster`): three redis-server masters on
loopback, cluster-enabled, on the three ports after the stack's Redis port (their cluster bus
on each port + 10000), data under root/redis-cluster/<port>; the slots split in three equal
ranges (as `redis-cli --cluster create` splits them), formed by CLUSTER ADDSLOTSRANGE and MEET;
ready when every node says cluster_state:ok and knows the other two. A restarted node rejoins
from its nodes.conf, so a stack brought down and up again keeps its cluster."""

from __future__ import annotations

import subprocess
import time
from typing import Any

from rose.stack.errors import StackError
from rose.stack.ownership import StackOwnership
from rose.stack.redis import RedisServer, server_args

CLUSTER_SIZE = 3
SLOTS = 16384


def cluster_node_names() -> list[str]:
    return [f"redis-cluster-{i}" for i in range(CLUSTER_SIZE)]


class RedisClusterNodes(RedisServer, StackOwnership):
    """Starts, forms, checks and stops the stack's three-node Redis Cluster."""

    @property
    def redis_cluster_ports(self) -> list[int]:
        return [self.scfg.redis_port + 1 + i for i in range(CLUSTER_SIZE)]

    @property
    def redis_cluster_nodes(self) -> str:
        """The nodes as `redis.cluster_nodes` takes them (ROSE_REDIS__CLUSTER_NODES)."""
        return ",".join(f"127.0.0.1:{p}" for p in self.redis_cluster_ports)

    def _node(self, port: int, timeout_s: float = 1.0) -> Any:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # no retries: redis-py's default backs off for seconds on every refused connection
        return redis.Redis(
            host="127.0.0.1",
            port=port,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )

    def _cluster_info(self, port: int) -> dict[str, str] | None:
        """CLUSTER INFO of the node on `port`, None when nothing answers there as a cluster node."""
        import redis

        r = self._node(port)
        try:
            raw = r.execute_command("CLUSTER", "INFO")
        except (redis.RedisError, OSError):
            return None
        finally:
            r.close()
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    def redis_cluster_started(self) -> bool:
        """`up --redis-cluster` started it and `down` has not stopped it (its pid files are there)."""
        return any(self._pidfile(n).exists() for n in cluster_node_names())

    def redis_cluster_alive(self) -> bool:
        """Every node answers and says cluster_state:ok, knowing all three."""
        for port in self.redis_cluster_ports:
            info = self._cluster_info(port)
            if info is None or info.get("cluster_state") != "ok" or info.get("cluster_known_nodes") != "3":
                return False
        return True

    def redis_cluster_up(self, timeout_s: float = 30.0, claim: bool = True) -> None:
        """Start the nodes not running yet, form the cluster if it is new, wait for
        cluster_state:ok on every node. With `claim`, another stack's or program's listeners
        on the nodes' ports are refused first (`up` checks that before starting anything)."""
        ports = self.redis_cluster_ports
        if ports[-1] + 10000 > 65535:
            raise StackError(
                f"Redis Cluster ports {ports} leave no room for their cluster bus (port + 10000); "
                "give the stack a lower Redis port (ROSE_STACK__REDIS_PORT=…)"
            )
        if self.redis_cluster_alive():
            return
        if claim and (foreign := self.foreign(cluster_node_names())):
            raise StackError(self._not_owned_message(foreign))
        exe = self._redis_server()
        self._mark()
        procs = {}
        for name, port in zip(cluster_node_names(), ports, strict=True):
            if self._node_answers(port):
                continue
            procs[port] = self._start_node(exe, name, port)
        deadline = time.monotonic() + timeout_s
        for port, proc in procs.items():
            while not self._node_answers(port):
                if proc.poll() is not None:
                    raise StackError(
                        f"redis-server (cluster node 127.0.0.1:{port}) exited with code {proc.returncode}; "
                        f"see {self._node_dir(port)}.out"
                    )
                if time.monotonic() > deadline:
                    raise StackError(f"Redis Cluster node 127.0.0.1:{port} did not answer PING within {timeout_s}s")
                time.sleep(0.05)
        self._form(ports)
        while time.monotonic() < deadline:
            if self.redis_cluster_alive():
                return
            time.sleep(0.1)
        raise StackError(f"Redis Cluster on {self.redis_cluster_nodes} is not ok after {timeout_s}s: {self._said()}")

    def _said(self) -> str:
        """Each node's state, for an error message."""
        out = []
        for port in self.redis_cluster_ports:
            info = self._cluster_info(port)
            out.append(
                f"127.0.0.1:{port} "
                + (
                    "does not answer as a cluster node"
                    if info is None
                    else f"cluster_state:{info.get('cluster_state')}, slots assigned "
                    f"{info.get('cluster_slots_assigned')}, known nodes {info.get('cluster_known_nodes')}"
                )
            )
        return "; ".join(out) + (
            f" (logs: {self.root}/redis-cluster/<port>.out; `rose stack up --redis-cluster` restarts "
            f"stopped nodes; to start afresh: `rose stack down`, then remove {self.root}/redis-cluster)"
        )

    def _node_dir(self, port: int):
        return self.root / "redis-cluster" / str(port)

    def _node_answers(self, port: int) -> bool:
        import redis

        r = self._node(port)
        try:
            return bool(r.ping())
        except (redis.RedisError, OSError):
            return False
        finally:
            r.close()

    def _start_node(self, exe: str, name: str, port: int) -> subprocess.Popen:
        ndir = self._node_dir(port)
        ndir.mkdir(parents=True, exist_ok=True)
        out = open(ndir.parent / f"{port}.out", "ab")
        proc = subprocess.Popen(
            [
                *server_args(exe, port, ndir),
                *("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
                *("--cluster-node-timeout", "5000"),
            ],
            cwd=ndir,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        self._pidfile(name).write_text(str(proc.pid))
        return proc

    def _form(self, ports: list[int]) -> None:
        """Fresh nodes (no slots, knowing only themselves): one slot range each, then MEET.
        Nodes that already know each other (restarted from their nodes.conf) rejoin by
        themselves; a mix of fresh and formed nodes cannot be repaired here and is said so."""
        infos = {p: self._cluster_info(p) for p in ports}
        missing = [p for p, i in infos.items() if i is None]
        if missing:
            raise StackError(f"127.0.0.1:{missing[0]} does not answer as a Redis Cluster node: {self._said()}")
        fresh = [p for p, i in infos.items() if i and i.get("cluster_slots_assigned") == "0"]
        if fresh and len(fresh) != len(ports):
            raise StackError(f"Redis Cluster on {self.redis_cluster_nodes} is half formed: {self._said()}")
        for i, port in enumerate(ports if fresh else []):
            r = self._node(port, 5.0)
            try:
                if infos[port].get("cluster_current_epoch") == "0":  # type: ignore[union-attr]
                    r.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
                lo, hi = i * SLOTS // len(ports), (i + 1) * SLOTS // len(ports) - 1
                r.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
            finally:
                r.close()
        if all(i and i.get("cluster_known_nodes") == str(len(ports)) for i in infos.values()):
            return  # formed before: they find each other again from their nodes.conf
        r = self._node(ports[0], 5.0)
        try:  # MEET again is harmless: an `up` stopped between ADDSLOTSRANGE and MEET ends here
            for port in ports[1:]:
                r.execute_command("CLUSTER", "MEET", "127.0.0.1", port)
        finally:
            r.close()

    def redis_cluster_down(self, timeout_s: float = 10.0) -> bool:
        stopped = [self._stop(n, timeout_s) for n in cluster_node_names()]
        return any(stopped)
