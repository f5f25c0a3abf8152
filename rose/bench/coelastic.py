"""Co-elasticity: grant → first token from the warm pool vs a cold start, throttle → paused, resume → first token, tokens wasted per revoke, and the leased time that made progress."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from rose.bench._stack import engine_lease_bytes, engine_report, lease_state, step_report, wait_for
from rose.contract.records import Heartbeat, WorkerRegistry

GOAL_WARM_FIRST_TOKEN_P99_MS = 1000.0
GOAL_RESUME_FIRST_TOKEN_P99_MS = 100.0
GOAL_WASTED_TOKENS_PER_IN_FLIGHT_EPISODE = 1.0  # at most one decode step per in-flight episode
GiB = 1 << 30
GPU = "sim/0"
SHARE = 0.5  # the lease's compute share while it runs
SAMPLE_S = 0.1  # the progress sampler's window: longer than a decode step and its duty-cycle idle


def run(cfg, quick: bool, cycles: int = 0) -> dict:
    from rose.bench._stack import lease_io, leased_workers, percentiles_ms, private_stack
    from rose.obs.logs import setup_logging

    setup_logging("WARNING")
    cold_cycles, warm_cycles, throttles = (2, 2, 2) if quick else (5, 10, 5)
    if cycles:  # warm grants asked for; resumes follow at five throttles per lease
        warm_cycles, cold_cycles = cycles, max(2, cycles // 4)
    with private_stack(cfg, "coelastic") as c:
        # the Kafka path is measured here; the guard has its own bench (revoke)
        c = leased_workers(c, "bench-coelastic", 400 if quick else 4000, guard_period_s=0.0, revoke_deadline_s=5.0)
        producer, states = lease_io(c)
        b = _Bench(c, producer, states)
        try:
            cold = b.phase(warm_workers=0, cycles=cold_cycles, throttles=throttles)
            warm = b.phase(warm_workers=1, cycles=warm_cycles, throttles=throttles)
        finally:
            states.close()
        engine_fields = engine_report(c, cold["heartbeats"] + warm["heartbeats"])
    out: dict[str, Any] = {
        **engine_fields,
        "path": "command→executor",
        "path_note": "commands are produced to the commands topic directly (the scheduler's decision time is "
        "measured by its own bench); t0 is just before produce(); the executor runs in this process, its "
        "workers are real processes",
        "cycles": {"cold": cold_cycles, "warm": warm_cycles, "throttles_per_lease": throttles},
    }
    wf, cf = percentiles_ms(warm["first_token"]), percentiles_ms(cold["first_token"])
    out["grant_to_first_token_ms"] = {"warm": wf, "cold": cf}
    out["warm_leases_on_warm_workers_fraction"] = _frac(warm["warm_started"])
    out["cold_leases_on_warm_workers_fraction"] = _frac(cold["warm_started"])
    out["warm_over_cold_first_token_p50_ratio"] = (
        round(wf["p50_ms"] / cf["p50_ms"], 4) if wf["n"] and cf["n"] and cf["p50_ms"] else None
    )
    out["goal_warm_first_token_p99_ms"] = GOAL_WARM_FIRST_TOKEN_P99_MS
    out["warm_first_token_p99_over_goal"] = round(wf["p99_ms"] / GOAL_WARM_FIRST_TOKEN_P99_MS, 4) if wf["n"] else None
    paused = percentiles_ms(cold["paused"] + warm["paused"])
    out["throttle_to_paused_ms"] = paused
    out["throttle_flag_to_paused_ms"] = percentiles_ms(cold["paused_flag"] + warm["paused_flag"])
    out["decode_steps_while_paused"] = sum(cold["steps_while_paused"] + warm["steps_while_paused"])
    resume = percentiles_ms(cold["resume"] + warm["resume"])
    out["resume_to_first_token_ms"] = resume
    out["goal_resume_to_first_token_p99_ms"] = GOAL_RESUME_FIRST_TOKEN_P99_MS
    out["resume_first_token_p99_over_goal"] = (
        round(resume["p99_ms"] / GOAL_RESUME_FIRST_TOKEN_P99_MS, 4) if resume["n"] else None
    )
    # where a resume's time goes: the command's way to the flag (Kafka, the executor), then the
    # worker's first decode step; a step's own time bounds the second part from below
    out["resume_flag_to_first_token_ms"] = percentiles_ms(cold["resume_flag"] + warm["resume_flag"])
    out["decode_step_ms"] = step_report(cold["heartbeats"] + warm["heartbeats"])
    revokes = cold["revokes"] + warm["revokes"]
    in_flight = sum(r["in_flight_episodes"] for r in revokes)
    wasted = sum(r["wasted_tokens"] for r in revokes)
    per_episode = round(wasted / in_flight, 4) if in_flight else None
    out["wasted_tokens_per_revoke"] = {
        "n": len(revokes),
        "mean_tokens": round(wasted / len(revokes), 3) if revokes else None,
        "max_tokens": max((r["wasted_tokens"] for r in revokes), default=None),
        "in_flight_episodes_mean": round(in_flight / len(revokes), 3) if revokes else None,
        "not_carried_tokens": sum(r["not_carried_tokens"] for r in revokes),
        "interrupted_decode_tokens": sum(r["interrupted_tokens"] for r in revokes),
        "decoded_tokens": sum(r["decoded_tokens"] for r in revokes),
    }
    out["wasted_tokens_per_in_flight_episode"] = per_episode
    out["goal_wasted_tokens_per_in_flight_episode"] = GOAL_WASTED_TOKENS_PER_IN_FLIGHT_EPISODE
    out["wasted_tokens_per_in_flight_episode_over_goal"] = (
        round(per_episode / GOAL_WASTED_TOKENS_PER_IN_FLIGHT_EPISODE, 4) if per_episode is not None else None
    )
    out["progress_fraction_of_leased_time"] = _frac_of(warm["progress"])
    out["progress_fraction_of_leased_time_cold"] = _frac_of(cold["progress"])
    out["leased_s"] = {
        "warm": round(sum(t for _a, t in warm["progress"]), 3),
        "cold": round(sum(t for _a, t in cold["progress"]), 3),
    }
    out["note"] = (
        "first token: the worker records in its pause flag when it produced its first token after starting or "
        "after a pause; paused: when it saw share 0 (both CLOCK_MONOTONIC). Wasted tokens: tokens a worker "
        "decoded that no trajectory or continuation carries, plus the tokens of a decode step a pause cut short, "
        "over the episodes it handed back at the revoke. Progress: the part of the lease's wall time (grant "
        f"produced → revoke produced, sampled every {SAMPLE_S * 1000:.0f} ms, paused periods included) in which "
        "the worker's decode-step counter advanced. `warm`: an executor with executor.warm_workers = 1 (each "
        "grant waits for the pool to be ready again); `cold`: warm_workers = 0."
    )
    return out


class _Bench:
    def __init__(self, cfg, producer, states):
        self.cfg, self.producer, self.states = cfg, producer, states
        self.epoch = 0

    def command(self, kind: str, epoch: int, cid: str, share: float) -> None:
        from rose.contract.events import Command
        from rose.contract.wire import encode
        from rose.kafka.producer import produce

        now = time.time()
        end = kind == "revoke"
        cmd = Command(
            command_id=cid,
            kind=kind,
            gpu=GPU,
            lease_id=f"{GPU}#{epoch}",
            epoch=epoch,
            mem_bytes=0 if end else engine_lease_bytes(self.cfg),
            compute_share=0.0 if end else share,
            ts=now,
            expires_at=now if end else now + 300,
            reason="bench",
            cause_event_id=f"bench-{cid}",
        )
        produce(self.producer, self.cfg.kafka.commands_topic, encode(cmd), GPU)
        self.producer.poll(0)

    def phase(self, warm_workers: int, cycles: int, throttles: int) -> dict:
        import dataclasses

        import redis

        from rose.executor.service import Executor

        c = dataclasses.replace(self.cfg, executor=dataclasses.replace(self.cfg.executor, warm_workers=warm_workers))
        res: dict[str, list] = {
            "first_token": [],
            "warm_started": [],
            "paused": [],
            "paused_flag": [],
            "resume": [],
            "resume_flag": [],
            "steps_while_paused": [],
            "revokes": [],
            "progress": [],
            "heartbeats": [],
        }
        ex = Executor(c, [GPU], guard=False).start()
        stop = threading.Event()
        loop = threading.Thread(target=ex.run, args=(stop,), daemon=True)
        loop.start()
        r = redis.Redis.from_url(c.redis.url)
        workers = WorkerRegistry(r, c.redis.key)
        try:
            for _ in range(cycles):
                if warm_workers:
                    wait_for(lambda: _pool_ready(ex), 600)
                self.epoch += 1
                epoch = self.epoch
                sampler = _Progress(ex, epoch)
                t0 = time.monotonic_ns()
                sampler.start()
                self.command("grant", epoch, f"g{epoch}", SHARE)
                h = wait_for(lambda: _handle(ex, epoch), 120)
                flag = h.flag
                wait_for(lambda: flag.first_token_ns > t0, 600)  # a cold engine imports and starts
                res["first_token"].append(flag.first_token_ns - t0)
                res["warm_started"].append(h.warm)
                for i in range(throttles):
                    s0 = flag.steps
                    wait_for(lambda: flag.steps > s0 + 5, 30)  # decoding again
                    t1 = time.monotonic_ns()
                    self.command("throttle", epoch, f"p{epoch}-{i}", 0.0)
                    wait_for(lambda: flag.paused_seen_ns > t1, 10)
                    res["paused"].append(flag.paused_seen_ns - t1)
                    res["paused_flag"].append(flag.paused_seen_ns - flag.set_ns)
                    s1 = flag.steps
                    time.sleep(0.1)
                    res["steps_while_paused"].append(flag.steps - s1)
                    t2 = time.monotonic_ns()
                    self.command("throttle", epoch, f"u{epoch}-{i}", SHARE)
                    wait_for(lambda: flag.first_token_ns > t2, 10)
                    res["resume"].append(flag.first_token_ns - t2)
                    res["resume_flag"].append(flag.first_token_ns - flag.set_ns)
                s0 = flag.steps
                wait_for(lambda: flag.steps > s0 + 5, 30)
                # the decode steps the throttles cut short are not the revoke's: count from here
                worker = f"{socket.gethostname()}:{GPU}:{epoch}"
                since = time.time()
                before = wait_for(lambda: _heartbeat_since(workers, worker, since), 10)
                res["progress"].append(sampler.stop())
                self.command("revoke", epoch, f"r{epoch}", 0.0)
                wait_for(lambda: lease_state(self.states, "revoked", epoch), 30)
                w = _wasted(workers, worker, before.tokens_interrupted)
                res["heartbeats"].append(workers.read(worker))
                if w is not None:
                    res["revokes"].append(w)
        finally:
            stop.set()
            loop.join(30)
            r.close()
        return res


def _pool_ready(ex) -> bool:
    try:
        return any(w.ready for w in list(ex.pool.workers))
    except TypeError:  # a warm worker was reaped this instant (its flag is closed)
        return False


def _handle(ex, epoch: int):
    h = ex.workers.get(GPU)
    return h if h is not None and h.epoch == epoch and h.flag is not None else None


class _Progress:
    """Samples the lease's decode-step counter every SAMPLE_S from the grant: the part of the
    samples in which it advanced (before the worker exists, none does)."""

    def __init__(self, ex, epoch: int):
        self.ex, self.epoch = ex, epoch
        self.samples = self.advanced = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.t0 = time.monotonic()
        self._t.start()

    def _run(self) -> None:
        last = None
        while not self._stop.wait(SAMPLE_S):
            h = _handle(self.ex, self.epoch)
            try:
                steps = h.flag.steps if h is not None else None
            except (TypeError, AttributeError):  # the flag was closed this instant
                steps = None
            self.samples += 1
            if steps is not None and last is not None and steps > last:
                self.advanced += 1
            last = steps if steps is not None else last

    def stop(self) -> tuple[float, float]:
        """(fraction of samples with progress, leased seconds sampled)."""
        self._stop.set()
        self._t.join(5)
        return (self.advanced / self.samples if self.samples else 0.0), time.monotonic() - self.t0


def _heartbeat_since(workers: WorkerRegistry, worker: str, since: float) -> Heartbeat | None:
    hb = workers.read(worker)
    return hb if hb is not None and hb.ts > since else None


def _wasted(workers: WorkerRegistry, worker: str, interrupted_before: int) -> dict | None:
    """The drained worker's own counters (its last heartbeat, written after the drain); None
    when it did not drain (killed at the revoke deadline)."""
    try:
        hb = wait_for(lambda: _stopped(workers, worker), 15)
    except TimeoutError:
        return None
    decoded, carried = hb.tokens, hb.tokens_carried
    interrupted = hb.tokens_interrupted - interrupted_before
    in_flight = hb.requeued
    return {
        "decoded_tokens": decoded,
        "not_carried_tokens": decoded - carried,
        "interrupted_tokens": interrupted,
        "wasted_tokens": decoded - carried + interrupted,
        "in_flight_episodes": in_flight,
    }


def _stopped(workers: WorkerRegistry, worker: str) -> Heartbeat | None:
    hb = workers.read(worker)
    return hb if hb is not None and hb.state == "stopped" else None


def _frac(flags: list[bool]) -> float | None:
    return round(sum(flags) / len(flags), 4) if flags else None


def _frac_of(progress: list[tuple[float, float]]) -> float | None:
    """Leased-time-weighted fraction with progress."""
    total = sum(t for _f, t in progress)
    return round(sum(f * t for f, t in progress) / total, 4) if total > 0 else None
