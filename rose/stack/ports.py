"""Loopback TCP ports: a free one, whether one is listened on, and the environment variables
that move each service of the stack to other ports."""

from __future__ import annotations

import socket

from rose.child_server import free_port as free_port  # the one definition, re-exported

# the environment variables that set each service's ports (`ROSE_STACK__<NAME>`)
PORT_ENV = {
    "kafka": ["KAFKA_PORT", "CONTROLLER_PORT", "SASL_PORT", "TLS_PORT"],
    "redis": ["REDIS_PORT"],
    "redis-cluster": ["REDIS_PORT"],  # `up --redis-cluster`: the six ports after it
    **{f"redis-cluster-{i}": ["REDIS_PORT"] for i in range(6)},
    "kafka-cluster": ["KAFKA_CLUSTER_PORT"],  # `up --brokers 3`: node i on it + i, controller + 100 + i
    **{f"kafka-cluster-{i}": ["KAFKA_CLUSTER_PORT"] for i in range(3)},
    "jaeger": ["JAEGER_QUERY_PORT", "JAEGER_OTLP_GRPC_PORT", "JAEGER_OTLP_HTTP_PORT"],
}


def listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0
