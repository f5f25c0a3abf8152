"""LocalStack: the local development stack (Kafka, Redis and, on request, Jaeger on loopback)
as one object, from `up` to `down`."""

from __future__ import annotations

from dataclasses import dataclass

from rose.config import Config
from rose.stack.jaeger import JaegerServer
from rose.stack.kafka import KafkaBroker
from rose.stack.ownership import Holder, StackOwnership
from rose.stack.redis import RedisServer


@dataclass
class LocalStack(KafkaBroker, RedisServer, JaegerServer, StackOwnership):
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
    def up(self, jaeger: bool = False, own: bool = False) -> list[Holder]:
        """Start what is not running yet and wait until it answers (Jaeger too with `jaeger`).
        Another stack's services already answering on these ports are used, with a warning
        naming them, or with `own` refused before anything starts (see `claim`)."""
        names = ["redis", "kafka"] + (["jaeger"] if jaeger else [])
        used = self.claim(names, own=own)
        self.redis_up()
        self.kafka_up()
        if jaeger:
            self.jaeger_up()
        return used

    def down(self) -> list[str]:
        return [n for n in ("jaeger", "kafka", "redis") if self._stop(n, 30.0)]

    def status(self, jaeger: bool = False) -> dict[str, bool]:
        st = {"kafka": self.kafka_alive(), "redis": self.redis_alive()}
        if jaeger:
            st["jaeger"] = self.jaeger_alive()
        return st
