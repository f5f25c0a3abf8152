"""Two levels on the real stack (docs/contract.md v1.1): the scheduler (`rose scheduler`) and an
executor (`rose executor`, a real rollout worker) on the local Kafka and Redis, fed live
telemetry. A latency spike pauses the lease on that very event (`throttle` to share 0, lease
state `paused`, same lease id and worker process); calm resumes it (`active`, same lease id and
epoch, same process); memory pressure revokes it."""

from __future__ import annotations

import threading
import time

import psutil
import pytest
import redis

from rose.config import GiB
from rose.contract.events import Latency
from rose.kafka.producer import make_producer, produce_event
from tests.examples import telemetry_example
from tests.kafka_checks import commands
from tests.processes import start_scheduler, terminate_all
from tests.test_executor import GPU, ExecutorProc, LeaseStates, env_for, submit, wait_until

pytestmark = pytest.mark.stack


class Feeder:
    """One telemetry event per GPU of `gpus` (node "sim") every 0.5 s, in the mode the test sets:
    `mode` for every GPU, or `modes[gpu]` for one."""

    MODES = {
        "calm": (Latency(200.0, 20.0), 30 * GiB),
        "spike": (Latency(200.0, 97.0), 30 * GiB),
        "memory": (Latency(200.0, 20.0), 78 * GiB),
    }

    def __init__(self, cfg, gpus: tuple[str, ...] = (GPU,), modes: dict[str, str] | None = None):
        self.cfg, self.gpus, self.mode, self.sent = cfg, gpus, "calm", []  # sent: (event_id, mode)
        self.modes: dict[str, str] = dict(modes or {})  # set before the first event is sent
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        p = make_producer(self.cfg.kafka)
        i = 0
        while not self._stop.is_set():
            for gpu in self.gpus:
                mode = self.modes.get(gpu, self.mode)  # read once: the event and its record must agree
                lat, used = self.MODES[mode]
                ev = telemetry_example(
                    event_id=f"co-{i}" if len(self.gpus) == 1 else f"co-{gpu}-{i}",
                    ts=time.time(),
                    node="sim",
                    gpu=gpu,
                    latency_ms=lat,
                    mem_total_bytes=80 * GiB,
                    mem_used_bytes=used,
                )
                produce_event(p, self.cfg.kafka.telemetry_topic, ev)
                p.flush(5)
                self.sent.append((ev.event_id, mode))
            i += 1
            self._stop.wait(0.5)

    def first_event(self, mode: str, after: int) -> str:
        return next(eid for eid, m in self.sent[after:] if m == mode)

    def stop(self):
        self._stop.set()
        self.thread.join(5)


def test_spike_pauses_calm_resumes_memory_revokes_with_one_worker_process(cfg, tmp_path, redis_client):
    env = env_for(cfg, tmp_path)
    submit(cfg, 60, turns=4)
    states = LeaseStates(cfg)
    sched = start_scheduler(env, "co", tmp_path / "scheduler.log")
    ex = ExecutorProc(env)
    feed = Feeder(cfg)
    r = redis.Redis.from_url(cfg.redis.url)
    try:
        active, _ = states.wait("active", 1, timeout=60)
        pid = ex.wait_log("worker.started", 60, epoch=1)["pid"]
        wait_until(lambda: _tokens(r, cfg) > 0, 90, "the leased worker decoded no token")

        mark = len(feed.sent)
        feed.mode = "spike"
        paused, _ = states.wait("paused", 1, timeout=20)
        spike_id = feed.first_event("spike", mark)
        throttle = next(c for c in commands(cfg) if c["kind"] == "throttle")
        assert throttle["cause_event_id"] == spike_id, "not paused on the very event that showed the spike"
        assert throttle["compute_share"] == 0.0 and throttle["lease_id"] == active.lease_id
        assert paused.lease_id == active.lease_id and paused.epoch == active.epoch
        assert psutil.pid_exists(pid), "the paused worker's process is gone"
        # every worker's heartbeat 1 s, then 2 s more, after the pause: their loops ran all that while
        t_paused = time.time()
        wait_until(lambda: _beat_since(r, cfg, t_paused + 1.0), 20, "no heartbeat of the paused worker")
        tokens_paused = _tokens(r, cfg)
        wait_until(lambda: _beat_since(r, cfg, t_paused + 3.0), 20, "no heartbeat of the paused worker")
        assert _tokens(r, cfg) == tokens_paused, "a paused worker kept decoding"

        feed.mode = "calm"
        wait_until(
            lambda: any(s == ("active", 1) for s in states.states()[states.states().index(("paused", 1)) :]),
            20,
            "calm did not resume the paused lease",
        )
        resumed = next(s for s, _ in reversed(states.seen) if s.state == "active")
        assert resumed.command_id != active.command_id
        assert (resumed.lease_id, resumed.epoch) == (active.lease_id, active.epoch)
        wait_until(lambda: _tokens(r, cfg) > tokens_paused, 30, "the resumed worker decoded no token")
        assert psutil.pid_exists(pid)

        feed.mode = "memory"
        states.wait("revoked", 1, timeout=30)
        revoke = next(c for c in commands(cfg) if c["kind"] == "revoke")
        assert "free memory" in revoke["reason"] or "KV growth" in revoke["reason"]
        starts = [ln for ln in ex.lines if ln.get("event") == "worker.started"]
        assert len(starts) == 1 and starts[0]["pid"] == pid, "the pause or the resume restarted the worker"
        kinds = [c["kind"] for c in commands(cfg)]
        assert kinds.count("grant") == 1 and kinds.count("throttle") >= 2
    finally:
        feed.stop()
        ex.stop()
        terminate_all({"scheduler": sched})
        states.close()
        r.close()


def _beat_since(r, cfg, t: float) -> bool:
    """Whether every paused worker of the run (one at least) has published a heartbeat at or
    after `t` (wall clock)."""
    keys = [k for k in r.scan_iter(match=cfg.redis.key("workers", "*")) if r.type(k) == b"hash"]
    beats = [r.hmget(k, "state", "ts") for k in keys]
    paused = [float(ts or 0) for state, ts in beats if state == b"paused"]
    return bool(paused) and min(paused) >= t


def _tokens(r, cfg) -> int:
    """Tokens decoded by every worker of the run, from their Redis heartbeats."""
    total = 0
    for key in r.scan_iter(match=cfg.redis.key("workers", "*")):
        if r.type(key) == b"hash":
            total += int(r.hget(key, "tokens") or 0)
    return total
