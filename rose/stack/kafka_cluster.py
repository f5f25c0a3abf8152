"""The stack's three-node Kafka cluster (`rose stack up --brokers 3`): three KRaft nodes on
loopback, each a combined broker+controller, the three of them the controller quorum (static
voters). Node i (0, 1, 2) has node.id i + 1, PLAINTEXT on `kafka_cluster_port` + i and
CONTROLLER on `kafka_cluster_port` + 100 + i (9192-9194 and 9292-9294 by default, apart from the
single broker's 9092-9095), its data under root/kafka-cluster/<i>. Internal topics and the
brokers' topic defaults are replicated three times with two in sync (`REPLICATION`), and the
failure-detection timeouts are lowered (`FAILURE_DETECTION`) so that a killed or frozen node
costs seconds. Jars, storage format, JVM and readiness are the single broker's (rose.stack.kafka).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from rose.stack.errors import StackError
from rose.stack.kafka import (
    NODE_DEFAULTS,
    KafkaBroker,
    kafka_brokers,
    kafka_cluster_id,
    kafka_ready,
    write_log4j,
    write_properties,
)
from rose.stack.ownership import StackOwnership

CLUSTER_SIZE = 3
CONTROLLER_OFFSET = 100  # node i's CONTROLLER port: kafka_cluster_port + CONTROLLER_OFFSET + i

# Replication of the internal topics and the brokers' defaults for created topics: a write
# acknowledged by acks=all is on two nodes at least, and one node may be down.
REPLICATION = {
    "offsets.topic.replication.factor": "3",
    "transaction.state.log.replication.factor": "3",
    "transaction.state.log.min.isr": "2",
    "share.coordinator.state.topic.replication.factor": "3",
    "share.coordinator.state.topic.min.isr": "2",
    "default.replication.factor": "3",
    "min.insync.replicas": "2",
    "unclean.leader.election.enable": "false",
}

# How fast the cluster notices a dead or frozen node (Kafka's defaults in the comments). A
# broker is fenced, and its partitions get new leaders, broker.session.timeout.ms after its
# last heartbeat; a follower leaves the ISR replica.lag.time.max.ms after it last caught up; a
# controller that hears nothing from the quorum leader for controller.quorum.fetch.timeout.ms
# stands for election, and an election without a winner is retried after a random backoff.
FAILURE_DETECTION = {
    "broker.heartbeat.interval.ms": "500",  # 2000
    "broker.session.timeout.ms": "3000",  # 9000
    "replica.lag.time.max.ms": "3000",  # 30000
    "controller.quorum.election.timeout.ms": "1000",  # 1000
    "controller.quorum.fetch.timeout.ms": "1500",  # 2000
    "controller.quorum.election.backoff.max.ms": "500",  # 1000
    "controller.quorum.request.timeout.ms": "1500",  # 2000
    # a frozen (SIGSTOPped) peer keeps its sockets open: requests to it time out, not fail
    "replica.socket.timeout.ms": "5000",  # 30000
    "controller.socket.timeout.ms": "5000",  # 30000
    "request.timeout.ms": "5000",  # 30000 (the brokers' own clients)
}


def kafka_cluster_node_names() -> list[str]:
    return [f"kafka-cluster-{i}" for i in range(CLUSTER_SIZE)]


class KafkaClusterNodes(KafkaBroker, StackOwnership):
    """Configures, starts, checks and stops the stack's three-node Kafka cluster."""

    @property
    def kafka_cluster_ports(self) -> list[int]:
        """Each node's PLAINTEXT port."""
        return [self.scfg.kafka_cluster_port + i for i in range(CLUSTER_SIZE)]

    @property
    def kafka_cluster_bootstrap(self) -> str:
        """The nodes as `kafka.bootstrap` takes them (ROSE_KAFKA_BOOTSTRAP)."""
        return ",".join(f"127.0.0.1:{p}" for p in self.kafka_cluster_ports)

    def kafka_cluster_dir(self, i: int) -> Path:
        """Node i's data, logs and log4j config (its server.properties is beside the stack's
        own, root/kafka-cluster-<i>.server.properties, which marks it as this stack's)."""
        return self.root / "kafka-cluster" / str(i)

    def kafka_cluster_properties(self, i: int) -> dict[str, str]:
        base = self.scfg.kafka_cluster_port
        voters = ",".join(f"{n + 1}@127.0.0.1:{base + CONTROLLER_OFFSET + n}" for n in range(CLUSTER_SIZE))
        return {
            "process.roles": "broker,controller",
            "node.id": str(i + 1),
            "controller.quorum.voters": voters,
            "listeners": f"PLAINTEXT://127.0.0.1:{base + i},CONTROLLER://127.0.0.1:{base + CONTROLLER_OFFSET + i}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{base + i}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.kafka_cluster_dir(i) / "data"),
            **NODE_DEFAULTS,
            **REPLICATION,
            **FAILURE_DETECTION,
        }

    def _cluster_props_file(self, i: int) -> Path:
        return self.root / f"kafka-cluster-{i}.server.properties"

    def kafka_cluster_started(self) -> bool:
        """`up --brokers 3` started it and `down` has not stopped it (its pid files are there)."""
        return any(self._pidfile(n).exists() for n in kafka_cluster_node_names())

    def kafka_cluster_alive(self) -> bool:
        """All three brokers in the metadata, every partition led."""
        return kafka_ready(self.kafka_cluster_bootstrap, CLUSTER_SIZE, timeout_s=3.0)

    def kafka_cluster_up(self, timeout_s: float = 120.0, claim: bool = True) -> None:
        """Start the nodes not running yet (formatting a new cluster's storage, one cluster id
        for the three), wait until all three are in the metadata with every partition led.
        With `claim`, another stack's or program's listeners on the ports are refused first."""
        if self.kafka_cluster_alive():
            return
        if claim and (foreign := self.foreign(kafka_cluster_node_names())):
            raise StackError(self._not_owned_message(foreign))
        self.fetch_kafka()
        self._mark()
        cid_file = self.root / "kafka-cluster" / "cluster.id"
        cid_file.parent.mkdir(parents=True, exist_ok=True)
        if not cid_file.exists():
            cid_file.write_text(kafka_cluster_id())
        up = kafka_brokers(self.kafka_cluster_bootstrap)
        cid = cid_file.read_text()
        procs = {i: self.kafka_cluster_node_up(i, cid) for i in range(CLUSTER_SIZE) if i + 1 not in up}
        for i, proc in procs.items():
            self._wait_kafka(proc, self.kafka_cluster_bootstrap, self.kafka_cluster_dir(i), timeout_s, CLUSTER_SIZE)

    def kafka_cluster_node_up(self, i: int, cluster_id: str | None = None) -> subprocess.Popen:
        """Start node i (its storage formatted first if new) without waiting for it."""
        ndir = self.kafka_cluster_dir(i)
        ndir.mkdir(parents=True, exist_ok=True)
        props = self._cluster_props_file(i)
        write_properties(props, self.kafka_cluster_properties(i))
        write_log4j(ndir)
        if not (ndir / "data" / "meta.properties").exists():
            cid = cluster_id or (self.root / "kafka-cluster" / "cluster.id").read_text()
            self._format_storage(props, cid)
        proc = self._start_kafka(props, ndir, self.scfg.kafka_cluster_heap)
        self._pidfile(f"kafka-cluster-{i}").write_text(str(proc.pid))
        return proc

    def kafka_cluster_down(self, timeout_s: float = 30.0) -> bool:
        """Stop the three nodes at once: one by one, the last would wait out its controlled
        shutdown without a quorum to confirm it."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(CLUSTER_SIZE) as pool:
            stopped = list(pool.map(lambda n: self._stop(n, timeout_s), kafka_cluster_node_names()))
        return any(stopped)
