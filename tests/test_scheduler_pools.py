"""The scheduler's pool stage on the real Kafka broker (docs/scheduler.md "Pool decisions and
partitioning"): telemetry of a pool with replica leases becomes pool samples, the pool stage's
intents, and the GPU stage's replica commands, each hop exactly once; and `policy.pools` is
checked at start."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from rose.config import ConfigError, PoolConfig, load_config
from rose.kafka.consumer import read_all
from rose.kafka.producer import make_producer, produce_event
from rose.policy.pool_records import PoolIntent, PoolSample
from tests.examples import telemetry_example
from tests.kafka_checks import commands, duplicate_ids

# capacity 10 rps per replica: 3 replicas at 1 rps need one (3 × 1.3 / 10), 25 rps need four
POOL = PoolConfig(replica_capacity_rps=10.0, window_s=20.0, bin_s=5.0)
GPUS = {"r0": "pl/0", "r1": "pl/1", "r2": "pl/2"}  # one single-GPU replica each


# ---------------------------------------------------------------- configuration


def test_pools_are_read_from_their_tables(tmp_path):
    f = tmp_path / "rose.toml"
    f.write_text("[policy.pools.chat]\nreplica_capacity_rps = 12\nwindow_s = 60\n")
    cfg = load_config(f, env={})
    assert cfg.policy.pools == {"chat": PoolConfig(replica_capacity_rps=12.0, window_s=60.0)}
    assert load_config(None, env={}).policy.pools == {}


@pytest.mark.parametrize(
    ("toml", "names"),
    [
        ("[policy.pools.chat]\nheadroom = 1.5\n", "policy.pools.chat.replica_capacity_rps"),  # nothing to estimate
        ("[policy.pools.chat]\nreplica_capacity = 3\n", "policy.pools.chat.replica_capacity:"),
        ("[policy.pools.chat]\nreplica_capacity_rps = -1\n", "policy.pools.chat.replica_capacity_rps"),
        ("[policy.pools.chat]\nwindow_s = 2\n", "policy.pools.chat.window_s"),
        ("[policy.pools.chat]\nwake_s = -1\n", "policy.pools.chat.wake_s"),
        ("[policy.pools.chat]\nforecast = 'daily'\n", "policy.pools.chat.forecast"),
        ("[policy.pools.chat]\nbin_s = 'x'\n", "policy.pools.chat.bin_s"),
        ("[policy]\npools = 3\n", "policy.pools:"),
    ],
)
def test_a_bad_pool_setting_is_one_line_naming_it(tmp_path, toml, names):
    f = tmp_path / "rose.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError) as e:
        load_config(f, env={})
    assert str(e.value).startswith(names) and "\n" not in str(e.value)


def test_the_command_exits_2_on_a_bad_pool_setting(tmp_path):
    import subprocess
    import sys

    f = tmp_path / "rose.toml"
    f.write_text("[policy.pools.chat]\nheadroom = 1.5\n")
    r = subprocess.run(
        [sys.executable, "-m", "rose", "--config-file", str(f), "scheduler"], capture_output=True, timeout=60
    )
    assert r.returncode == 2
    assert b"policy.pools.chat.replica_capacity_rps" in r.stderr


# ---------------------------------------------------------------- on the broker


class Fleet:
    """Three single-GPU replicas of pool `chat` publishing telemetry every 0.5 s (event time:
    now) from a thread; `state` per replica: (rps, serving_state)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.state = {r: (1.0, "serving") for r in GPUS}
        self.ticks = 0
        self._stop = threading.Event()
        self._producer = make_producer(cfg.kafka)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            now = time.time()
            for r, gpu in GPUS.items():
                rps, st = self.state[r]
                ev = telemetry_example(
                    event_id=f"{gpu}#{self.ticks}", ts=now, node="pl", gpu=gpu, pool="chat", replica=r,
                    serving_state=st, rps=rps,
                )  # fmt: skip
                produce_event(self._producer, self.cfg.kafka.telemetry_topic, ev)
            self._producer.flush(10)
            self.ticks += 1

    def __enter__(self) -> Fleet:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def __exit__(self, *_exc: object) -> None:
        self.stop()


class Running:
    """A Scheduler instance running its loop on a thread."""

    def __init__(self, cfg, instance: str):
        from rose.scheduler.service import Scheduler

        self.scheduler = Scheduler(cfg, instance=instance)
        self._thread = threading.Thread(target=self.scheduler.run, daemon=True)

    def __enter__(self) -> Running:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.scheduler.stop()
        self._thread.join(30)


def _pool_cfg(cfg):
    return dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, pools={"chat": POOL}))


def _replica(cmds: list[dict], kind: str) -> list[dict]:
    return [c for c in cmds if c["kind"] == kind and c.get("lease_kind") == "replica"]


def _wait_for(cfg, done: Callable[[list[dict]], bool], what: str, timeout_s: float = 120.0) -> list[dict]:
    """The committed commands (read_committed) once `done(commands)` holds; fails at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = commands(cfg)
        if done(got):
            return got
        time.sleep(0.5)
    pytest.fail(f"no {what} within {timeout_s:.0f}s: {[(c['kind'], c['gpu'], c.get('lease_kind')) for c in got]}")


@pytest.mark.stack
def test_an_idle_pool_lends_two_replicas_once_and_a_load_rise_reclaims_them(cfg):
    cfg = _pool_cfg(cfg)
    with Fleet(cfg) as fleet, Running(cfg, "pl"):
        got = _wait_for(cfg, lambda cs: len(_replica(cs, "grant")) >= 2, "replica grants")
        grants = _replica(got, "grant")
        assert sorted(g["gpu"] for g in grants) == ["pl/1", "pl/2"], "the highest ids are lent, never the last one"
        fleet.state = {"r0": (25.0, "serving"), "r1": (0.0, "lent"), "r2": (0.0, "lent")}
        lent = {g["lease_id"] for g in grants}
        got = _wait_for(cfg, lambda cs: {c["lease_id"] for c in _replica(cs, "revoke")} >= lent, "reclaim")
        # a later tick's commands committed after the reclaim: a duplicate would be there by now
        n = len(got)
        got = _wait_for(cfg, lambda cs: len(cs) > n, "later commands")
    assert not duplicate_ids(got)
    assert len(_replica(got, "grant")) == 2, "each replica lent once"
    revokes = _replica(got, "revoke")
    assert sorted(r["lease_id"] for r in revokes) == sorted(lent), "each replica lease revoked once"
    for g in grants:  # each replica grant comes after any co-resident lease of its GPU ended
        mine = [c for c in got if c["gpu"] == g["gpu"]]
        assert [c["epoch"] for c in mine] == sorted(c["epoch"] for c in mine)
    samples = [PoolSample.from_bytes(m.value()) for m in read_all(cfg.kafka, [cfg.kafka.pool_samples_topic])]
    assert len({s.event_id for s in samples}) == len(samples), "a sample per committed event, once"
    assert {s.pool for s in samples} == {"chat"}
    intents = [PoolIntent.from_bytes(m.value()) for m in read_all(cfg.kafka, [cfg.kafka.pool_intents_topic])]
    assert {(i.replica, i.action) for i in intents} >= {("r1", "lend"), ("r2", "lend"), ("r1", "reclaim")}
    assert "r0" not in {i.replica for i in intents if i.action == "lend"}


@pytest.mark.stack
def test_a_new_instance_takes_over_both_stages_from_the_log(cfg, monkeypatch):
    """The first instance lends and closes; the next one (same group, same instance id) rebuilds
    the pool's window and pending intents from the two topics and the GPU stage's positions from
    the group's offsets: it lends nothing twice, and reclaims from the window it read back."""
    from rose.kafka.consumer import TopicPartition, make_consumer
    from rose.scheduler.pool_service import PoolStage

    taken_over: list[tuple[int, int]] = []  # per takeover of the pool: (samples, pending intents) folded
    take_over = PoolStage._take_over

    def recorded(self, partition, committed):
        take_over(self, partition, committed)
        if "chat" in self.states:
            taken_over.append((len(self.states["chat"].samples), len(self.states["chat"].pending)))

    monkeypatch.setattr(PoolStage, "_take_over", recorded)
    cfg = _pool_cfg(cfg)
    with Fleet(cfg) as fleet:
        with Running(cfg, "pt"):
            got = _wait_for(cfg, lambda cs: len(_replica(cs, "grant")) >= 2, "replica grants")
        grants = _replica(got, "grant")
        group = make_consumer(cfg.kafka, f"{cfg.kafka.topic_prefix}rose-scheduler")
        try:
            parts = [TopicPartition(cfg.kafka.pool_intents_topic, p) for p in range(cfg.kafka.partitions)]
            committed = {tp.partition: tp.offset for tp in group.committed(parts, timeout=10) if tp.offset > 0}
        finally:
            group.close()
        assert committed, "the GPU stage committed its pool-intents positions with the group"
        with Running(cfg, "pt"):
            n = len(got)
            got = _wait_for(cfg, lambda cs: len(cs) > n + 3, "the second instance's commands")
            print(f"\n[takeover] (samples, pending intents) folded: {taken_over}")
            assert taken_over and taken_over[0][0] > 0, "the window was read back, not started empty"
            fleet.state = {"r0": (25.0, "serving"), "r1": (0.0, "lent"), "r2": (0.0, "lent")}
            lent = {g["lease_id"] for g in grants}
            got = _wait_for(cfg, lambda cs: {c["lease_id"] for c in _replica(cs, "revoke")} >= lent, "reclaim")
    assert not duplicate_ids(got)
    # the same grants, read again (commands of different GPUs sit on different partitions, whose
    # records a read interleaves in any order)
    assert sorted(c["command_id"] for c in _replica(got, "grant")) == sorted(c["command_id"] for c in grants), (
        "nothing lent twice across the takeover"
    )
    assert sorted(r["lease_id"] for r in _replica(got, "revoke")) == sorted(lent)


class SchedulerProcesses:
    """`rose scheduler` processes on the test's topics with the pool configured and a 60 s lease
    TTL, each logging to `<name>.log` under `tmp_path`; SIGKILLed at will, the kill times kept
    (the windows in which the pool stage may have been taken over)."""

    def __init__(self, cfg, tmp_path):
        import os

        self.cfg, self.tmp_path = cfg, tmp_path
        toml = tmp_path / "rose.toml"
        toml.write_text(f"[policy]\nttl_s = 60.0\n[policy.pools.chat]\nreplica_capacity_rps = {POOL.replica_capacity_rps}\n"
                        f"window_s = {POOL.window_s}\nbin_s = {POOL.bin_s}\n")  # fmt: skip
        self.env = {
            **os.environ,
            "ROSE_CONFIG": str(toml),
            "ROSE_KAFKA_BOOTSTRAP": cfg.kafka.bootstrap,
            "ROSE_KAFKA__TOPIC_PREFIX": cfg.kafka.topic_prefix,
            "ROSE_KAFKA__PARTITIONS": str(cfg.kafka.partitions),
        }
        self.kill_times: list[float] = []
        self.at_kill: list[tuple[int, int, int]] = []  # (samples, replica grants, replica revokes) committed

    def start(self, name: str, instance: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "rose", "scheduler", "--instance", instance, "--log-level", "WARNING"]
        log = open(self.tmp_path / f"{name}.log", "wb")
        return subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=log)

    def kill(self, proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        self.kill_times.append(time.time())
        samples, cmds = read_all(self.cfg.kafka, [self.cfg.kafka.pool_samples_topic]), commands(self.cfg)
        self.at_kill.append((len(samples), len(_replica(cmds, "grant")), len(_replica(cmds, "revoke"))))

    def drain_and_audit(self, fleet: Fleet) -> dict:
        """Stop the telemetry, wait until both stages have decided everything committed, and run
        the fault suite's replica audit over the whole log, a takeover allowed within a minute
        of each kill."""
        from tests.faults import audit

        fleet.stop()
        deadline = time.monotonic() + 60
        while audit.pool_backlog(self.cfg) != 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        return audit.audit_replica_commands(self.cfg, rebuilds=[(t, t + 60) for t in self.kill_times])


def _ttl_60(cfg):
    # a lease outlives the restarts: a replica grant is applied up to a restart's time after its
    # cause, and with the default 5 s it could be born expired (the pool would then lend again)
    return _pool_cfg(dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, ttl_s=60.0)))


@pytest.mark.stack
def test_sigkill_of_the_scheduler_loses_and_duplicates_no_replica_command(cfg, tmp_path):
    """Fault: `rose scheduler` SIGKILLed at random points while the pool lends and while it
    reclaims, a fresh process (same instance id) taking over each time. Expectation, read with
    read_committed: each replica lent once and each of its leases revoked once, no command id
    twice; once the telemetry stops and both stages have drained, the fault suite's replica audit
    holds (tests/faults/replica_audit.py: every sample's intents the pool stage's decision, or a
    takeover's within a minute of a kill; every intent's replica command once, where due).
    Counted: kills, the samples, replica grants and revokes committed at each kill, and the
    audit's counts."""
    import random

    from tests.processes import terminate_all

    cfg = _ttl_60(cfg)
    procs = SchedulerProcesses(cfg, tmp_path)
    rng = random.Random(5)
    with Fleet(cfg) as fleet:
        for round_ in range(3):  # while the pool lends
            proc = procs.start(f"lend{round_}", "pk")
            time.sleep(rng.uniform(3.0, 9.0))
            procs.kill(proc)
        proc = procs.start("lent", "pk")
        try:
            got = _wait_for(cfg, lambda cs: len(_replica(cs, "grant")) >= 2, "replica grants")
            grants = _replica(got, "grant")
            lent = {g["lease_id"] for g in grants}
            fleet.state = {"r0": (25.0, "serving"), "r1": (0.0, "lent"), "r2": (0.0, "lent")}
            time.sleep(rng.uniform(0.5, 2.0))
            procs.kill(proc)  # while it reclaims
            proc = procs.start("final", "pk")
            got = _wait_for(cfg, lambda cs: {c["lease_id"] for c in _replica(cs, "revoke")} >= lent, "reclaim")
            n = len(got)
            got = _wait_for(cfg, lambda cs: len(cs) > n, "later commands")
            counts = procs.drain_and_audit(fleet)
        finally:
            terminate_all({"scheduler": proc})
    print(f"\n[pool sigkill] kills={len(procs.at_kill)} (samples, replica grants, replica revokes) at each "
          f"kill={procs.at_kill}\n[pool sigkill] replica audit: {counts}")  # fmt: skip
    assert any(samples for samples, _, _ in procs.at_kill), "a kill must land after samples were committed"
    assert not duplicate_ids(got)
    assert sorted(g["gpu"] for g in _replica(got, "grant")) == ["pl/1", "pl/2"], "each replica lent once"
    assert sorted(r["lease_id"] for r in _replica(got, "revoke")) == sorted(lent), "each lease revoked once"
    assert counts["replica_grant"] == 2 and counts["replica_revoke"] == 2, counts


def _pool_owner(cfg, timeout_s: float = 30.0) -> str:
    """The instance whose pool stage holds the partition of pool `chat`'s samples, once a member
    holds it (during a rebalance none may)."""
    from confluent_kafka.admin import AdminClient

    from rose.scheduler.service import SCHEDULER_GROUP

    k = cfg.kafka
    partition = read_all(k, [k.pool_samples_topic])[0].partition()
    group = f"{k.topic_prefix}{SCHEDULER_GROUP}-pools"
    admin = AdminClient({"bootstrap.servers": k.bootstrap})
    deadline = time.monotonic() + timeout_s
    while True:
        members = admin.describe_consumer_groups([group])[group].result(timeout=10).members
        for m in members:
            if any(
                tp.topic == k.pool_samples_topic and tp.partition == partition for tp in m.assignment.topic_partitions
            ):
                return str(m.group_instance_id).rsplit("-", 1)[-1]
        assert time.monotonic() < deadline, f"no member of {group} held {k.pool_samples_topic}[{partition}]: {members}"
        time.sleep(0.5)


@pytest.mark.stack
def test_sigkill_of_the_instance_that_owns_the_pool_hands_it_to_the_other(cfg, tmp_path):
    """Fault, scaled out: two `rose scheduler` processes (instances pa and pb) share both groups.
    The one whose pool stage owns the pool's partition is SIGKILLed while two replicas are lent,
    and the load rises. The other instance is assigned the pool after the group's session
    timeout, takes it over from the log and reclaims: each replica lent once, each lease revoked
    once, no command id twice, and the replica audit holds over the whole log."""
    from tests.processes import terminate_all

    cfg = _ttl_60(cfg)
    procs = SchedulerProcesses(cfg, tmp_path)
    with Fleet(cfg) as fleet:
        running = {i: procs.start(i, i) for i in ("pa", "pb")}
        try:
            got = _wait_for(cfg, lambda cs: len(_replica(cs, "grant")) >= 2, "replica grants")
            grants = _replica(got, "grant")
            lent = {g["lease_id"] for g in grants}
            owner = _pool_owner(cfg)
            procs.kill(running.pop(owner))
            fleet.state = {"r0": (25.0, "serving"), "r1": (0.0, "lent"), "r2": (0.0, "lent")}
            got = _wait_for(cfg, lambda cs: {c["lease_id"] for c in _replica(cs, "revoke")} >= lent, "reclaim")
            n = len(got)
            got = _wait_for(cfg, lambda cs: len(cs) > n, "later commands")
            survivor = _pool_owner(cfg)
            counts = procs.drain_and_audit(fleet)
        finally:
            terminate_all({f"scheduler {i}": p for i, p in running.items()})
    print(f"\n[pool owner sigkill] killed {owner}, the pool went to {survivor}; replica audit: {counts}")
    assert survivor != owner, "the surviving instance owns the pool"
    assert not duplicate_ids(got)
    assert sorted(g["gpu"] for g in _replica(got, "grant")) == ["pl/1", "pl/2"], "each replica lent once"
    assert sorted(r["lease_id"] for r in _replica(got, "revoke")) == sorted(lent), "each lease revoked once"
    assert counts["replica_grant"] == 2 and counts["replica_revoke"] == 2, counts


@pytest.mark.stack
def test_a_bounded_read_leaves_out_the_records_one_fetch_brings_past_its_end(cfg):
    """The pool stage's takeover reads its partition up to the committed offset; the records
    after it arrive in the same fetch, and one folded there would be decided again once consumed
    (the SIGKILL test above found a sample folded twice that way)."""
    from rose.kafka.consumer import read_partitions
    from rose.kafka.producer import produce

    topic = cfg.kafka.pool_samples_topic
    producer = make_producer(cfg.kafka)
    for n in range(40):
        produce(producer, topic, str(n).encode(), "chat", partition=0)
    assert producer.flush(10) == 0
    for lo, hi in ((10, 20), (19, 20), (0, 1)):
        got = read_partitions(cfg.kafka, [(topic, 0)], bounds={(topic, 0): (lo, hi)})
        assert [m.offset() for m in got] == list(range(lo, hi)), (lo, hi)
        assert [m.value() for m in got] == [str(n).encode() for n in range(lo, hi)]
    assert len(read_partitions(cfg.kafka, [(topic, 0)])) == 40


@pytest.mark.stack
def test_pool_intents_with_another_partition_count_than_telemetry_is_a_config_error(cfg):
    """An intent goes to its GPU's telemetry partition: with another count it would land beside
    another GPU's telemetry, so the pool stage refuses to start, naming both topics."""
    from confluent_kafka.admin import NewPartitions

    from rose.kafka.admin import make_admin, partitions_of
    from rose.scheduler.service import Scheduler

    cfg = _pool_cfg(cfg)
    topic = cfg.kafka.telemetry_topic
    admin = make_admin(cfg.kafka)  # held until its futures are done
    for fut in admin.create_partitions([NewPartitions(topic, cfg.kafka.partitions + 2)]).values():
        fut.result(30)
    deadline = time.monotonic() + 30
    while len(partitions_of(cfg.kafka, topic)) != cfg.kafka.partitions + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    s = Scheduler(cfg, instance="pm")
    try:
        with pytest.raises(ConfigError) as e:
            s.start()
    finally:
        s.close()
    assert cfg.kafka.pool_intents_topic in str(e.value) and topic in str(e.value)
