"""Where a local stack lives: its state dir (pid files, and stack.json saying where its `up` ran)
and the loopback ports each of its services listens on."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from rose.config import StackConfig

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class StackLayout:
    """A stack's configuration, its clients' addresses, its state dir and its ports."""

    scfg: StackConfig
    kafka_bootstrap: str
    redis_url: str

    @property
    def root(self) -> Path:
        return Path(self.scfg.data_dir).resolve()

    def _pidfile(self, name: str) -> Path:
        return self.root / f"{name}.pid"

    def _ports(self, name: str) -> list[int]:
        """The TCP ports a service of this stack listens on, its client port first."""
        s = self.scfg
        if name == "redis-cluster":  # `up --redis-cluster`: its six nodes' client ports (3 masters, 3 replicas)
            return [s.redis_port + 1 + i for i in range(6)]
        if name.startswith("redis-cluster-"):  # node i: its client port, then its cluster bus
            port = s.redis_port + 1 + int(name.rsplit("-", 1)[1])
            return [port, port + 10000]
        if name == "kafka-cluster":  # `up --brokers 3`: its three nodes' PLAINTEXT ports
            return [s.kafka_cluster_port + i for i in range(3)]
        if name.startswith("kafka-cluster-"):  # node i: PLAINTEXT, then CONTROLLER
            port = s.kafka_cluster_port + int(name.rsplit("-", 1)[1])
            return [port, port + 100]
        return {
            "kafka": [s.kafka_port, s.controller_port, s.sasl_port, s.tls_port],
            "redis": [s.redis_port],
            "jaeger": [s.jaeger_query_port, s.jaeger_otlp_grpc_port, s.jaeger_otlp_http_port],
        }[name]

    def _redis_dir(self, name: str) -> Path:
        """The working directory of this stack's redis-server `name` (Redis or a cluster node)."""
        if name.startswith("redis-cluster-"):
            return self.root / "redis-cluster" / str(self._ports(name)[0])
        return self.root / "redis"

    def _mark(self) -> None:
        """stack.json in the state dir: where `rose stack up` ran, so another checkout finding
        this stack on its ports can say whose it is."""
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "stack.json").write_text(
            json.dumps({"checkout": os.getcwd(), "state_dir": str(self.root), "rose": str(REPO_ROOT)}) + "\n"
        )
