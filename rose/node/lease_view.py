"""What a serving node knows of its GPUs' leases: the newest lease state per GPU and the compute
share each lease was last given (grant, renew or throttle), read from the lease-state and
commands topics without ever blocking. The simulated agent and the demo's co-served device use
it to play the rollout side of a GPU: `active` runs at the lease's share, `paused` (v1.1) holds
the lease's memory and runs nothing, any other state means no rollout."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from rose.config import Config
from rose.contract.events import LEASE_SETTING_KINDS, Command, LeaseState


@dataclass
class LeaseView:
    """Latest lease state per GPU and the compute share granted to each lease."""

    default_share: float = 0.5
    states: dict[str, LeaseState] = field(default_factory=dict)
    shares: dict[str, float] = field(default_factory=dict)  # lease_id -> compute_share

    def on_command(self, c: Command) -> None:
        if c.kind in LEASE_SETTING_KINDS:
            self.shares[c.lease_id] = c.compute_share

    def on_lease_state(self, s: LeaseState) -> None:
        old = self.states.get(s.gpu)
        if old is None or (s.epoch, s.ts) >= (old.epoch, old.ts):
            self.states[s.gpu] = s

    def rollout(self, gpu: str) -> tuple[float, bool, int]:
        """(compute_share, running, rollout_mem_bytes) of `gpu` now."""
        s = self.states.get(gpu)
        if s is not None and s.state == "paused":  # the lease holds its memory; its worker waits
            return 0.0, False, s.rollout_mem_bytes
        if s is None or s.state != "active":
            return 0.0, False, 0
        return self.shares.get(s.lease_id, self.default_share), True, s.rollout_mem_bytes


class LeaseFollower:
    """Reads lease-state and commands from their beginning, without ever blocking."""

    def __init__(self, cfg: Config, view: LeaseView, dlq: Callable | None = None):
        from rose.kafka.consumer import OFFSET_BEGINNING, TopicPartition, make_consumer

        self.k, self.view, self.dlq = cfg.kafka, view, dlq
        self.consumer = make_consumer(
            cfg.kafka, group_id=f"rose-agent-{uuid.uuid4().hex[:12]}", **{"socket.timeout.ms": 2000}
        )
        self.assigned = False
        self._tp, self._begin = TopicPartition, OFFSET_BEGINNING

    def _assign(self) -> None:
        try:
            md = self.consumer.list_topics(timeout=0.5)
        except Exception:  # noqa: BLE001 - broker away: try again next poll
            return
        tps = []
        for t in (self.k.lease_state_topic, self.k.commands_topic):
            if t in md.topics:
                tps += [self._tp(t, p, self._begin) for p in md.topics[t].partitions]
        if tps:
            self.consumer.assign(tps)
            self.assigned = True

    def poll(self, max_batches: int = 20) -> int:
        from rose.contract.events import InvalidEvent
        from rose.contract.wire import decode

        if not self.assigned:
            self._assign()
            if not self.assigned:
                return 0
        n = 0
        for _ in range(max_batches):
            msgs = self.consumer.consume(num_messages=1000, timeout=0)
            for m in msgs:
                if m.error() or m.value() is None:  # errors are transient here; tombstones clear nothing
                    continue
                try:
                    ev = decode(m.value())
                except InvalidEvent as e:
                    if self.dlq:
                        self.dlq(m, str(e), e.field)
                    continue
                if isinstance(ev, LeaseState):
                    self.view.on_lease_state(ev)
                elif isinstance(ev, Command):
                    self.view.on_command(ev)
                n += 1
            if len(msgs) < 1000:
                break
        return n

    def close(self) -> None:
        self.consumer.close()
