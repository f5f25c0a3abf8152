"""The stack's Redis Cluster (`rose stack up --redis-cluster`): three redis-server masters and one
replica of each on loopback, cluster-enabled, on the six ports after the stack's Redis port
(masters first: node i replicates node i - 3 when formed; the cluster bus of each on its port +
10000), data under root/redis-cluster/<port>. The slots split in three equal ranges (as
`redis-cli --cluster create` splits them), formed by CLUSTER ADDSLOTSRANGE, MEET and REPLICATE.
`cluster-node-timeout` is NODE_TIMEOUT_MS (2 s): a master that stops answering is failed over to
its replica within seconds. Ready when every node says cluster_state:ok and knows the other
five, and each of the three masters has a replica whose link is up. A restarted node rejoins
from its nodes.conf (a master failed over comes back as its successor's replica), so a stack
brought down and up again keeps its cluster; a three-node cluster of an earlier release gets its
three replicas."""

from __future__ import annotations

import subprocess
import time
from typing import Any

from rose.contract.records import as_text
from rose.stack.errors import StackError
from rose.stack.ownership import StackOwnership
from rose.stack.redis import RedisServer, server_args

MASTERS = 3
REPLICAS_PER_MASTER = 1
CLUSTER_SIZE = MASTERS * (1 + REPLICAS_PER_MASTER)
SLOTS = 16384
# cluster-node-timeout: a node unreachable this long is suspected, then failed by a majority of
# the masters, and its replica is elected (0.5-1 s later): a failover takes about 3-4 s
NODE_TIMEOUT_MS = 2000


def cluster_node_names() -> list[str]:
    return [f"redis-cluster-{i}" for i in range(CLUSTER_SIZE)]


def parse_cluster_nodes(text: str) -> dict[int, dict[str, Any]]:
    """CLUSTER NODES, by port: id, flags (a set), master (its master's id, or None), slots (bool)."""
    nodes = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 8:
            continue
        port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
        master = None if parts[3] == "-" else parts[3]
        nodes[port] = {"id": parts[0], "flags": set(parts[2].split(",")), "master": master, "slots": len(parts) > 8}
    return nodes


class RedisClusterNodes(RedisServer, StackOwnership):
    """Starts, forms, checks and stops the stack's Redis Cluster: three masters, three replicas."""

    @property
    def redis_cluster_ports(self) -> list[int]:
        return [self.scfg.redis_port + 1 + i for i in range(CLUSTER_SIZE)]

    @property
    def redis_cluster_nodes(self) -> str:
        """The nodes as `redis.cluster_nodes` takes them (ROSE_REDIS__CLUSTER_NODES)."""
        return ",".join(f"127.0.0.1:{p}" for p in self.redis_cluster_ports)

    def redis_cluster_node_name(self, port: int) -> str:
        """The stack's name of the node on `port` (its pid file's)."""
        return cluster_node_names()[self.redis_cluster_ports.index(port)]

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

    def _ask(self, port: int, *command: Any) -> Any:
        """`command`'s raw reply from the node on `port`, None when nothing answers there."""
        import redis

        r = self._node(port)
        try:
            return r.execute_command(*command)
        except (redis.RedisError, OSError):
            return None
        finally:
            r.close()

    def _cluster_info(self, port: int) -> dict[str, str] | None:
        """CLUSTER INFO of the node on `port`, None when nothing answers there as a cluster node."""
        raw = self._ask(port, "CLUSTER", "INFO")
        if raw is None:
            return None
        return dict(line.split(":", 1) for line in as_text(raw).splitlines() if ":" in line)

    def redis_cluster_topology(self, port: int | None = None) -> dict[int, list[int]]:
        """{master port: [its replicas' ports]} as the node on `port` (default: the first that
        answers) sees it: masters serving slots, replicas not marked failing; {} if none answers."""
        for p in [port] if port is not None else self.redis_cluster_ports:
            raw = self._ask(p, "CLUSTER", "NODES")
            if raw is None:
                continue
            nodes = parse_cluster_nodes(as_text(raw))
            ids = {n["id"]: q for q, n in nodes.items()}
            up = {q: n for q, n in nodes.items() if not n["flags"] & {"fail", "fail?", "handshake", "noaddr"}}
            out: dict[int, list[int]] = {q: [] for q, n in up.items() if "master" in n["flags"] and n["slots"]}
            for q, n in up.items():
                if "slave" in n["flags"] and ids.get(n["master"]) in out:
                    out[ids[n["master"]]].append(q)
            return out
        return {}

    def redis_cluster_started(self) -> bool:
        """`up --redis-cluster` started it and `down` has not stopped it (its pid files are there)."""
        return any(self._pidfile(n).exists() for n in cluster_node_names())

    def redis_cluster_alive(self) -> bool:
        """Every node answers and says cluster_state:ok, knowing all six; three masters, each
        with a replica whose link to it is up."""
        for port in self.redis_cluster_ports:
            info = self._cluster_info(port)
            if info is None or info.get("cluster_state") != "ok":
                return False
            if info.get("cluster_known_nodes") != str(CLUSTER_SIZE):
                return False
        topology = self.redis_cluster_topology()
        if len(topology) != MASTERS or any(len(r) < REPLICAS_PER_MASTER for r in topology.values()):
            return False
        return all(self._replica_linked(r) for rs in topology.values() for r in rs)

    def _replica_linked(self, port: int) -> bool:
        """ROLE of a replica: ["slave", host, port, "connected", offset] once synced."""
        role = self._ask(port, "ROLE")
        return bool(role) and as_text(role[0]) == "slave" and as_text(role[3]) == "connected"

    def redis_cluster_up(self, timeout_s: float = 60.0, claim: bool = True) -> None:
        """Start the nodes not running yet, form the cluster if it is new (or give an older
        three-node one its replicas), wait for it to be alive. With `claim`, another stack's or
        program's listeners on the nodes' ports are refused first (`up` checks that before
        starting anything)."""
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
                self._before(deadline, f"Redis Cluster node 127.0.0.1:{port} did not answer PING within {timeout_s}s")
                time.sleep(0.05)
        self._form(ports, deadline)
        while not self.redis_cluster_alive():
            self._before(deadline, f"Redis Cluster on {self.redis_cluster_nodes} is not ok after {timeout_s}s")
            time.sleep(0.1)

    def _before(self, deadline: float, message: str) -> None:
        if time.monotonic() > deadline:
            raise StackError(f"{message}: {self._said()}")

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
            f"; masters and their replicas: {self.redis_cluster_topology()}"
            f" (logs: {self.root}/redis-cluster/<port>.out; `rose stack up --redis-cluster` restarts "
            f"stopped nodes; to start afresh: `rose stack down`, then remove {self.root}/redis-cluster)"
        )

    def _node_dir(self, port: int):
        return self.root / "redis-cluster" / str(port)

    def _node_answers(self, port: int) -> bool:
        return self._ask(port, "PING") is not None

    def _start_node(self, exe: str, name: str, port: int) -> subprocess.Popen:
        ndir = self._node_dir(port)
        ndir.mkdir(parents=True, exist_ok=True)
        out = open(ndir.parent / f"{port}.out", "ab")
        proc = subprocess.Popen(
            [
                *server_args(exe, port, ndir),
                *("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"),
                *("--cluster-node-timeout", str(NODE_TIMEOUT_MS)),
                # a replica always stands for election, however long its link was down
                *("--cluster-replica-validity-factor", "0"),
                # a new replica syncs at once (the default waits 5 s for more replicas)
                *("--repl-diskless-sync-delay", "0"),
            ],
            cwd=ndir,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        self._pidfile(name).write_text(str(proc.pid))
        return proc

    def _form(self, ports: list[int], deadline: float) -> None:
        """All nodes fresh (no slots, knowing only themselves): the first three take one slot
        range each. Then every node MEETs the first, and each fresh node replicates a master
        without a replica. Nodes that know each other (restarted from their nodes.conf) rejoin
        by themselves; fresh masters-to-be next to formed nodes cannot be repaired here and are
        said so."""
        infos = {p: self._cluster_info(p) for p in ports}
        missing = [p for p, i in infos.items() if i is None]
        if missing:
            raise StackError(f"127.0.0.1:{missing[0]} does not answer as a Redis Cluster node: {self._said()}")
        fresh = [p for p, i in infos.items() if i and i.get("cluster_slots_assigned") == "0"]
        if len(fresh) == len(ports):
            self._assign_slots(ports[:MASTERS], infos)
            fresh = ports[MASTERS:]
        elif any(p in fresh for p in ports[:MASTERS]) and not self.redis_cluster_topology():
            raise StackError(f"Redis Cluster on {self.redis_cluster_nodes} is half formed: {self._said()}")
        if any(i and i.get("cluster_known_nodes") != str(len(ports)) for i in infos.values()):
            r = self._node(ports[0], 5.0)
            try:  # MEET again is harmless: an `up` stopped in the middle of forming ends here
                for port in ports[1:]:
                    r.execute_command("CLUSTER", "MEET", "127.0.0.1", port)
            finally:
                r.close()
        for port in fresh:
            self._replicate(port, deadline)

    def _assign_slots(self, masters: list[int], infos: dict) -> None:
        for i, port in enumerate(masters):
            r = self._node(port, 5.0)
            try:
                if infos[port].get("cluster_current_epoch") == "0":
                    r.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
                lo, hi = i * SLOTS // len(masters), (i + 1) * SLOTS // len(masters) - 1
                r.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
            finally:
                r.close()

    def _replicate(self, port: int, deadline: float) -> None:
        """The fresh node on `port` replicates a master that has no replica yet (preferably the
        one three ports below), once it knows them all."""
        import redis

        while True:
            raw = self._ask(port, "CLUSTER", "NODES")
            nodes = parse_cluster_nodes(as_text(raw)) if raw is not None else {}
            mine = nodes.get(port, {})
            if mine.get("master"):
                return  # a replica already
            topology = self.redis_cluster_topology(port)
            lonely = sorted(topology, key=lambda m: (m != port - MASTERS, m))
            lonely = [m for m in lonely if len(topology[m]) < REPLICAS_PER_MASTER]
            if len(nodes) == CLUSTER_SIZE and len(topology) == MASTERS and lonely:
                r = self._node(port, 5.0)
                try:
                    r.execute_command("CLUSTER", "REPLICATE", nodes[lonely[0]]["id"])
                    return
                except redis.RedisError:
                    pass  # not yet known to it as a master: gossip goes on
                finally:
                    r.close()
            self._before(deadline, f"Redis Cluster node 127.0.0.1:{port} found no master to replicate")
            time.sleep(0.1)

    def redis_cluster_down(self, timeout_s: float = 10.0) -> bool:
        stopped = [self._stop(n, timeout_s) for n in cluster_node_names()]
        return any(stopped)
