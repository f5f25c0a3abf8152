"""The local development stack: one Apache Kafka (KRaft, combined broker+controller) and one
Redis, on loopback, owned by this module from download to shutdown.

Kafka's jars come from Maven Central (deploy/kafka/pom.xml, `mvn dependency:copy-dependencies`),
the broker runs as `java -cp libs/* kafka.Kafka server.properties` with a bounded heap, and
readiness is decided by asking the broker for cluster metadata (and Redis for PING), never
by sleeping. `down` stops only the processes `up` started (tracked by pid files).

`up --jaeger` adds Jaeger v2 (built once from the Go module proxy into root/bin/jaeger, run
with in-memory storage, every listener on loopback) for looking at the OpenTelemetry traces.
Each stack writes root/stack.json (where its `up` ran): a stack finding another one on its
ports says whose it is, and `up --own` (used by `make test`) refuses to run on it.

`up --redis-cluster` adds a Redis Cluster of three masters and their three replicas (the six
ports after Redis's; for the weights' shard streams, `redis.cluster_nodes`).

`up --brokers 3` adds a three-node Kafka cluster (KRaft, each node broker and controller, on
`kafka_cluster_port` + i and controllers on + 100 + i: 9192-9194 and 9292-9294; replication 3,
min.insync.replicas 2, lowered failure-detection timeouts; docs/stack.md).

Modules: `local` (LocalStack: up, down, status), `kafka` (the broker; `tls` its certificate),
`kafka_cluster` (the three-node cluster),
`redis`, `redis_cluster`, `jaeger`, `ownership` (whose stack holds these ports), `processes` (stopping what this
stack started), `layout` (state dir and ports), `ports`, `errors`.
"""

from rose.stack.errors import NotOwnedError, StackError
from rose.stack.kafka import kafka_cluster_id
from rose.stack.local import LocalStack
from rose.stack.ownership import Holder
from rose.stack.ports import free_port

__all__ = ["Holder", "LocalStack", "NotOwnedError", "StackError", "free_port", "kafka_cluster_id"]
