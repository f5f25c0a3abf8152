"""The executors' warm pools in the simulator: what starting a lease's rollout worker costs on a
node (docs/simulator.md "What starting and resuming rollout costs"). Co-resident leases
(`rose.sim.rose_run.RoseRun`) and replica leases (`rose.sim.replica_run.ReplicaRun`) start their
workers by the same rule."""

from __future__ import annotations


class WarmPools:
    """Each node's warm workers, as the times at which each is (or will be) ready. A start takes
    a ready one (`warm_s` to decoding) and launches its replacement, ready `build_s` after the
    lease decodes; a start that finds none ready is cold (`cold_s`)."""

    def __init__(self, nodes: int, per_node: int, warm_s: float, cold_s: float, build_s: float):
        self.ready_at = [[0.0] * per_node for _ in range(nodes)]
        self.warm_s, self.cold_s, self.build_s = warm_s, cold_s, build_s
        self.warm_starts = self.cold_starts = 0

    def start(self, node: int, now: float) -> float:
        """Seconds from a start on `node` at `now` to its worker decoding."""
        pool = self.ready_at[node]
        ready = [i for i, t in enumerate(pool) if t <= now]
        if ready:
            pool[ready[0]] = now + self.warm_s + self.build_s
            self.warm_starts += 1
            return self.warm_s
        self.cold_starts += 1
        return self.cold_s
