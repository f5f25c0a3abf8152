"""What the demo observes of the running system: the three Kafka topics (telemetry, commands,
lease state) and the Redis side (trajectories, published versions, trainer, co-served device,
worker heartbeats, when each task was first taken). One `Observed` is filled live for the view
by `Collector` (a thread), and a fresh one is read to the end of every topic for the report,
through the same `ingest`; when each task started is only seen live (`ClaimClock`), and the
report takes it from the live one.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import orjson

from rose.contract.records import Heartbeat, Trajectory, WorkerRegistry, as_text


@dataclass
class Observed:
    # gpu -> rows (ts, ttft_p99, tpot_p99, slo_ttft, slo_tpot, gpu_util, mem_used, mem_total, rollout_mem, record_ms)
    telemetry: dict[str, list[tuple]] = field(default_factory=dict)
    event_ms: dict[str, int] = field(default_factory=dict)  # telemetry event_id -> record timestamp (ms)
    commands: list[dict] = field(default_factory=list)  # command + "_record_ms"
    lease_states: list[dict] = field(default_factory=list)  # lease state + "_record_ms"
    episodes: list[dict] = field(default_factory=list)  # one summary row per trajectory
    versions: list[dict] = field(default_factory=list)  # one row per published weight version
    trainer: dict = field(default_factory=dict)
    coserve: dict = field(default_factory=dict)
    workers: dict[str, Heartbeat] = field(default_factory=dict)  # worker id -> its last heartbeat
    started: dict[str, float] = field(default_factory=dict)  # task_id -> when a worker first took it
    bad_messages: int = 0

    # ---- Kafka ----------------------------------------------------------------------------
    def ingest(self, topic_kind: str, value: bytes | None, record_ms: int) -> None:
        if value is None:
            return
        try:
            d = orjson.loads(value)
        except orjson.JSONDecodeError:
            self.bad_messages += 1
            return
        if not isinstance(d, dict):
            self.bad_messages += 1
            return
        try:
            if topic_kind == "telemetry":
                lat, slo = d["latency_ms"], d["slo_ms"]
                self.telemetry.setdefault(d["gpu"], []).append(
                    (
                        float(d["ts"]),
                        float(lat["ttft_p99"]),
                        float(lat["tpot_p99"]),
                        float(slo["ttft_p99"]),
                        float(slo["tpot_p99"]),
                        float(d["gpu_util"]),
                        int(d["mem_used_bytes"]),
                        int(d["mem_total_bytes"]),
                        int(d["rollout_mem_bytes"]),
                        record_ms,
                    )
                )
                self.event_ms[d["event_id"]] = record_ms
            elif topic_kind == "commands":
                self.commands.append({**d, "_record_ms": record_ms})
            elif topic_kind == "lease-state":
                self.lease_states.append({**d, "_record_ms": record_ms})
        except (KeyError, TypeError, ValueError):
            self.bad_messages += 1

    # ---- Redis ----------------------------------------------------------------------------
    def ingest_trajectory(self, traj: dict, reward_fn) -> None:
        vs = [v for v in traj.get("versions", []) if v is not None]
        self.episodes.append(
            {
                "task_id": traj.get("task_id"),
                "finished_at": float(traj.get("finished_at", 0.0)),
                "dedicated": bool(traj.get("dedicated")),
                "gpu": traj.get("gpu", ""),
                "worker": traj.get("worker", ""),
                "v_min": min(vs) if vs else None,
                "v_max": max(vs) if vs else None,
                "moves": traj.get("moves", 0),
                "reward": reward_fn(traj),
            }
        )


ENDED = ("revoking", "revoked", "expired", "rejected")


def lease_intervals(lease_states: list[dict], t_end: float) -> dict[str, list[tuple[float, float]]]:
    """Per GPU, the [start, end) wall-clock intervals in which a lease was `active`."""
    out: dict[str, list[tuple[float, float]]] = {}
    open_: dict[str, tuple[str, float]] = {}
    for s in sorted(lease_states, key=lambda s: (s["ts"], s["_record_ms"])):
        gpu, lid = s["gpu"], s["lease_id"]
        cur = open_.get(gpu)
        if s["state"] == "active":
            if cur is not None and cur[0] != lid:
                out.setdefault(gpu, []).append((cur[1], s["ts"]))
                cur = None
            if cur is None:
                open_[gpu] = (lid, s["ts"])
        elif s["state"] in ENDED and cur is not None and cur[0] == lid:
            out.setdefault(gpu, []).append((cur[1], s["ts"]))
            del open_[gpu]
    for gpu, (_lid, start) in open_.items():
        out.setdefault(gpu, []).append((start, t_end))
    return out


TOPICS = ("telemetry", "commands", "lease-state")


def quiet_logger():
    """librdkafka's own log lines go here: a broker restart must not spill reconnect errors over
    the live view (the view and the report show what was missed instead)."""
    import logging

    log = logging.getLogger("rose.demo.librdkafka")
    log.propagate = False
    if not log.handlers:
        log.addHandler(logging.NullHandler())
    return log


def _kind(kcfg, topic: str | None) -> str:
    for k in TOPICS:
        if topic == kcfg.topic(k):
            return k
    return ""


class RedisReader:
    """Incremental reads of the demo's Redis keys into an Observed."""

    def __init__(self, r, rcfg, job: str):
        self.r, self.rcfg = r, rcfg
        self.results = rcfg.key("results", job)
        self.last_id = "0-0"
        self.n_versions = 0

    def poll(self, obs: Observed) -> None:
        from rose.demo.trainer import reward

        key = self.rcfg.key
        while True:
            got = self.r.xread({self.results: self.last_id}, count=1000)
            if not got:
                break
            entries = got[0][1]
            for eid, fields in entries:
                self.last_id = eid.decode() if isinstance(eid, bytes) else eid
                try:
                    obs.ingest_trajectory(Trajectory.from_fields(fields).body, reward)
                except (KeyError, ValueError):
                    obs.bad_messages += 1
            if len(entries) < 1000:
                break
        for raw in self.r.lrange(key("demo:versions"), self.n_versions, -1):
            obs.versions.append(json.loads(raw))
            self.n_versions += 1
        obs.trainer = _str_hash(self.r.hgetall(key("demo:trainer")))
        obs.coserve = _str_hash(self.r.hgetall(key("demo:coserve")))
        obs.workers.update(WorkerRegistry(self.r, key).scan())


def _str_hash(h: dict) -> dict:
    return {as_text(k): as_text(v) for k, v in h.items()}


def _entry_id(v) -> tuple[int, int]:
    ms, _, seq = as_text(v).partition("-")
    return int(ms), int(seq or 0)


class ClaimClock:
    """When each task was first taken by a rollout worker, seen from outside the workers: a new
    task is appended to the job's shared task stream, and the workers' consumer group hands the
    stream out in entry order, so an entry has been taken once the group's last-delivered id has
    reached it. Each `poll` learns the entries appended since the last one (entry id -> task_id)
    and stamps those now delivered with the time of the poll: a task's start is known to within
    one poll period (later, never earlier). A continuation of a preempted episode keeps the
    task_id of its first start."""

    def __init__(self, r, rcfg, job: str):
        from rose.rollout.tasks import GROUP

        self.r, self.group = r, GROUP
        self.stream = rcfg.key("tasks", job)
        self.after = "-"
        self.waiting: deque[tuple[tuple[int, int], str]] = deque()  # appended, not yet delivered, in order

    def poll(self, obs: Observed, now: float) -> None:
        import redis

        while True:
            entries = self.r.xrange(self.stream, min=self.after, count=1000)
            for eid, fields in entries:
                self.after = f"({as_text(eid)}"
                self.waiting.append((_entry_id(eid), as_text(fields.get(b"task_id", b""))))
            if len(entries) < 1000:
                break
        try:
            groups = self.r.xinfo_groups(self.stream)
        except redis.ResponseError:  # the stream or its group is not created yet
            return
        last = next((g["last-delivered-id"] for g in groups if as_text(g["name"]) == self.group), None)
        if last is None:
            return
        delivered = _entry_id(last)
        while self.waiting and self.waiting[0][0] <= delivered:
            _, task_id = self.waiting.popleft()
            obs.started.setdefault(task_id, now)


class Collector:
    """Follows the topics from their beginning and polls Redis, on a daemon thread: the task
    stream every `claim_period_s` (when tasks start), everything else every second."""

    claim_period_s = 0.25

    def __init__(self, cfg, job: str):
        import redis

        self.cfg = cfg
        self.obs = Observed()
        self.r = redis.Redis.from_url(cfg.redis.url)
        self.reader = RedisReader(self.r, cfg.redis, job)
        self.claims = ClaimClock(self.r, cfg.redis, job)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    def start(self) -> Collector:
        self._thread = threading.Thread(target=self._run, name="demo-collector", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        from rose.kafka.admin import partitions_of
        from rose.kafka.consumer import OFFSET_BEGINNING, TopicPartition, make_consumer

        k = self.cfg.kafka
        consumer = make_consumer(k, f"{k.topic_prefix}demo-view", **{"fetch.wait.max.ms": 50, "logger": quiet_logger()})
        consumer.assign(
            [TopicPartition(k.topic(t), p, OFFSET_BEGINNING) for t in TOPICS for p in partitions_of(k, k.topic(t))]
        )
        next_redis = next_claims = 0.0
        try:
            while not self._stop.is_set():
                for m in consumer.consume(500, timeout=0.1):
                    if m.error() is None:
                        self.obs.ingest(_kind(k, m.topic()), m.value(), m.timestamp()[1])
                if time.monotonic() >= next_claims:
                    next_claims = time.monotonic() + self.claim_period_s
                    try:
                        self.claims.poll(self.obs, time.time())
                    except Exception as e:  # noqa: BLE001 - the view keeps going; starts not seen fall back
                        self.error = f"redis: {e}"
                if time.monotonic() >= next_redis:
                    next_redis = time.monotonic() + 1.0
                    try:
                        self.reader.poll(self.obs)
                    except Exception as e:  # noqa: BLE001 - the view keeps going; the report re-reads
                        self.error = f"redis: {e}"
        finally:
            consumer.close()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.r.close()


def read_final(cfg, job: str) -> Observed:
    """Everything the run left in Kafka and Redis, read to the end (for the report)."""
    import redis

    from rose.kafka.consumer import read_all

    obs = Observed()
    k = cfg.kafka
    for m in read_all(k, [k.topic(t) for t in TOPICS], timeout_s=30, logger=quiet_logger()):
        if m.error() is None:
            obs.ingest(_kind(k, m.topic()), m.value(), m.timestamp()[1])
    r = redis.Redis.from_url(cfg.redis.url)
    try:
        RedisReader(r, cfg.redis, job).poll(obs)
    finally:
        r.close()
    return obs
