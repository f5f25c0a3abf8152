"""Every rollout policy `rose simulate` runs, by name (docs/simulator.md "Policies"): the
default comparison (`POLICIES`: static, elastic, share-all, rose: both lease kinds, chosen per
replica, the product's default) and the lease kinds apart, `rose-coresident` (co-resident leases
only) and `rose-replica` (replica leases only, docs/contract.md §7)."""

from __future__ import annotations

from rose.sim.lease_kinds_run import LeaseKindsRun
from rose.sim.replica_run import ReplicaRun
from rose.sim.rose_run import RoseRun
from rose.sim.runs import ElasticRun, Run, ShareAllRun

RUNS = {"static": Run, "elastic": ElasticRun, "share-all": ShareAllRun, "rose": LeaseKindsRun}
POLICIES = tuple(RUNS)

ALL_RUNS: dict[str, type[Run]] = {**RUNS, "rose-coresident": RoseRun, "rose-replica": ReplicaRun}
ALL_POLICIES = tuple(ALL_RUNS)
# the policies a large run hands to a second process: the scheduling core's calls and the lease
# machines of co-resident leases are most of their work
FORKED = tuple(p for p, run in ALL_RUNS.items() if issubclass(run, RoseRun))

__all__ = ["ALL_POLICIES", "ALL_RUNS", "FORKED", "POLICIES"]
