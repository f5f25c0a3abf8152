"""LocalStack: the local development stack (Kafka, Redis and, on request, Jaeger, a
Redis Cluster of three masters and their replicas and a three-node Kafka cluster on loopback)
as one object, from `up` to `down`."""

from __future__ import annotations

from dataclasses import dataclass

from rose.config import Config
from rose.stack.errors import StackError
from rose.stack.jaeger import JaegerServer
from rose.stack.kafka_cluster import KafkaClusterNodes, kafka_cluster_node_names
from rose.stack.ownership import Holder, StackOwnership
from rose.stack.redis_cluster import RedisClusterNodes, cluster_node_names


@dataclass
class LocalStack(KafkaClusterNodes, RedisClusterNodes, JaegerServer, StackOwnership):
    """The stack whose state dir and ports `scfg` names; `up` starts what is not running yet,
    `down` stops only what it started."""

    @classmethod
    def from_config(cls, cfg: Config) -> LocalStack:
        return cls(
            cfg.stack,
            kafka_bootstrap=f"127.0.0.1:{cfg.stack.kafka_port}",
            redis_url=f"redis://127.0.0.1:{cfg.stack.redis_port}/0",
        )

    # ---- all ---------------------------------------------------------------------------
    def up(
        self, jaeger: bool = False, own: bool = False, redis_cluster: bool = False, brokers: int = 1
    ) -> list[Holder]:
        """Start what is not running yet and wait until it answers (Jaeger too with `jaeger`,
        a Redis Cluster of three masters and their replicas with `redis_cluster`, a three-node
        Kafka cluster with `brokers` 3, besides the single broker). Another stack's services already
        answering on these ports are used, with a warning naming them, or with `own` refused
        before anything starts (see `claim`); another's cluster nodes are always refused."""
        names = ["redis", "kafka"] + (["jaeger"] if jaeger else [])
        used = self.claim(names, own=own)
        if brokers not in (1, 3):
            raise StackError(f"--brokers takes 1 (the single broker) or 3 (and the three-node cluster), not {brokers}")
        if redis_cluster and (foreign := self.foreign(cluster_node_names())):
            raise StackError(self._not_owned_message(foreign))
        if brokers == 3 and (foreign := self.foreign(kafka_cluster_node_names())):
            raise StackError(self._not_owned_message(foreign))
        self.redis_up()
        self.kafka_up()
        if jaeger:
            self.jaeger_up()
        if redis_cluster:
            self.redis_cluster_up(claim=False)
        if brokers == 3:
            self.kafka_cluster_up(claim=False)
        return used

    def down(self) -> list[str]:
        stopped = [n for n in ("jaeger", "kafka", "redis") if self._stop(n, 30.0)]
        stopped += ["redis-cluster"] if self.redis_cluster_down() else []
        return stopped + (["kafka-cluster"] if self.kafka_cluster_down() else [])

    def status(self, jaeger: bool = False, redis_cluster: bool = False, kafka_cluster: bool = False) -> dict[str, bool]:
        st = {"kafka": self.kafka_alive(), "redis": self.redis_alive()}
        if jaeger:
            st["jaeger"] = self.jaeger_alive()
        if redis_cluster:
            st["redis-cluster"] = self.redis_cluster_alive()
        if kafka_cluster:
            st["kafka-cluster"] = self.kafka_cluster_alive()
        return st
