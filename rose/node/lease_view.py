"""What a serving node knows of its GPUs' leases: the newest lease state per GPU and the compute
share each lease was last given (grant, renew or throttle), read from the lease-state and
commands topics without ever blocking. The simulated agent and the demo's co-served device use
it to play the rollout side of a GPU: `active` runs at the lease's share, `paused` (v1.1) holds
the lease's memory and runs nothing, any other state means no rollout. The NVML agent reads from it what each GPU's serving replica is
doing (`serving_state`, CONTRACT §7): a replica lease takes the replica out of its router, a
co-resident lease never does."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from rose.config import Config
from rose.contract.events import LEASE_SETTING_KINDS, Command, InvalidEvent, LeaseState

# a replica lease's states (CONTRACT §7) as what its replica is doing: draining while it leaves
# its router, lent while rollout holds it (`paused` and `revoking` too: the replica is still out),
# reclaiming while its engine wakes; a terminal state (revoked, expired, rejected) is published
# only once the replica serves again
REPLICA_SERVING_STATE = {
    "draining": "draining",
    "active": "lent",
    "paused": "lent",
    "revoking": "lent",
    "reclaiming": "reclaiming",
}
# only a replica lease is ever in these states: they name its kind where its grant was not read
REPLICA_ONLY_STATES = ("draining", "reclaiming")


def serving_state_of(lease_kind: str, lease_state: str | None) -> str:
    """What a GPU's serving replica is doing, from the kind and newest state of the GPU's lease
    (None: no lease seen). A co-resident lease leaves its replica serving whatever its state."""
    if lease_kind != "replica" or lease_state is None:
        return "serving"
    return REPLICA_SERVING_STATE.get(lease_state, "serving")


@dataclass
class LeaseView:
    """Latest lease state per GPU and the compute share granted to each lease."""

    default_share: float = 0.5
    states: dict[str, LeaseState] = field(default_factory=dict)
    shares: dict[str, float] = field(default_factory=dict)  # lease_id -> compute_share
    replica_leases: set[str] = field(default_factory=set)  # lease_ids known to be replica leases

    def on_command(self, c: Command) -> None:
        if c.kind in LEASE_SETTING_KINDS:
            self.shares[c.lease_id] = c.compute_share
        if c.lease_kind == "replica":
            self.replica_leases.add(c.lease_id)

    def on_lease_state(self, s: LeaseState) -> None:
        if s.state in REPLICA_ONLY_STATES:
            self.replica_leases.add(s.lease_id)
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

    def serving_state(self, gpu: str) -> str:
        """What `gpu`'s serving replica is doing now (`serving_state_of` its newest lease state)."""
        s = self.states.get(gpu)
        if s is None:
            return "serving"
        return serving_state_of("replica" if s.lease_id in self.replica_leases else "coresident", s.state)


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
