"""Gateway overhead: streamed turns through the gateway beside vLLM's own OpenAI server on the same engine; a revoke mid-turn.

Both sides get the same load from the `openai` client in this process: `turns` streamed completions
of `max_tokens` tokens (token-id prompts of `PROMPT_TOKENS` ids, seeded; `ignore_eos`), `concurrency`
at a time, after one unmeasured warm-up round. Time to first token is request sent → first chunk
carrying a token id; turns/s is turns over the wall time from the first send to the last answer.
Both sides' processes run from the first round to the last, and the load alternates between them
in `rounds` rounds (the side that goes first alternates too; a round's turns are new prompts and
seeds, the same on both sides), so a drift of the machine falls on both sides alike; one side's
load never runs with the other's:

- direct: vLLM's OpenAI server (`rose.vllm_server`) on the checkpoint;
- gateway: the gateway (uvicorn, in this process) over two vLLM rollout workers on the same checkpoint,
  each leased with a pause flag; the second is held at PAUSE while the load runs, so one engine
  serves it, as on the direct side. Both sides: one OMP thread per engine, unbound (vLLM's CPU
  build binds its OMP threads to cores unless told `nobind`, and the workers are told so), the
  same KV space (1 GiB), max_model_len, batch slots (`concurrency`) and niceness 0.

The headline ratio is the pooled one (all rounds' turns over all rounds' wall time, per side),
beside each round's ratio and their range; the pooled ratio lies within that range.

Beside them, per side: time per output token, last token to the stream's end, the CPU seconds each
process used during the measured load and the machine's load average; and the gateway workers' own
engine-step times (their heartbeats).

The revoke, after the rounds, with vLLM's server stopped: the load's first turn, `max(max_tokens, REVOKE_MIN_TOKENS)` tokens long, streamed
`UNREVOKED_RUNS` times on the first worker alone, then once more with that worker set to STOP when
the client has a quarter of its tokens, the second worker let run at that moment: the first hands
its tokens on and the second finishes the turn. The streamed ids are compared with the turn's final
ids (from the job's results) and with the un-revoked run's ids (vLLM's seeded sampling repeats, so
the tokens handed on must be the same): `tokens_lost` are answer tokens the client did not get as
they are in the answer, `tokens_repeated` tokens streamed more than once per index.
`added_latency_ms` is the revoked turn's time minus the median un-revoked one's;
`stop_to_next_worker_token_ms` the STOP to the client's first token made by the second worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rose.bench._stack import (
    ENGINE_LEASE_BYTES,
    ServedGateway,
    checkpoint_or_tiny,
    engine_report,
    last_heartbeat,
    private_stack,
    progress,
    rollout_workers,
    step_report,
)
from rose.bench.gateway_figures import PROMPT_TOKENS, THREADS, Side, load, report, revoke_accounting
from rose.contract.records import Heartbeat, Trajectory, WorkerRegistry

TURNS, MAX_TOKENS, CONCURRENCY, ROUNDS = 64, 64, 8, 6
QUICK_TURNS, QUICK_MAX_TOKENS, QUICK_ROUNDS = 16, 16, 2
MAX_MODEL_LEN = 512
REVOKE_MIN_TOKENS = 64  # the revoked turn is at least this long, so the stop lands mid-turn
UNREVOKED_RUNS = 3  # the un-revoked turn's time is the median of this many runs
JOB, MODEL = "bench-gateway", "bench-gateway"
ENGINE_START_S = 900.0  # a vLLM engine's import and start on a busy 2-core machine
UNBOUND = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # as the workers run (rose.rollout.engines.vllm_engine)


# -- the shell: the two sides and the revoke ------------------------------------------------


def _turn(client: Any, model: str, prompt: list[int], seed: int, max_tokens: int) -> tuple[int, int, int, int]:
    """One streamed completion: (ns to the first token id, token ids received, mean ns between
    token ids after the first (0 for fewer than two), ns from the last token id to the stream's end)."""
    t0 = time.monotonic_ns()
    first, last, n = 0, 0, 0
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        seed=seed,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    for chunk in stream:
        for ch in chunk.choices:
            k = len(getattr(ch, "token_ids", None) or ())
            if k:
                last = time.monotonic_ns() - t0
                first = first or last
            n += k
    return first, n, (last - first) // (n - 1) if n > 1 else 0, time.monotonic_ns() - t0 - last


def drive(
    client: Any, model: str, work: list[tuple[list[int], int]], max_tokens: int, concurrency: int, pids: dict
) -> Side:
    """`work` as streamed turns, `concurrency` at a time; with the CPU time each of `pids` (name:
    pid; its children count too) used meanwhile."""
    import os

    pids = {"bench_process": os.getpid(), **pids}
    cpu0 = _cpu(pids)
    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        got = list(pool.map(lambda w: _turn(client, model, w[0], w[1], max_tokens), work))
    wall = time.monotonic() - t0
    cpu = {k: v - cpu0.get(k, 0.0) for k, v in _cpu(pids).items()}
    return Side(
        ttft_ns=[g[0] for g in got],
        tokens=[g[1] for g in got],
        wall_s=wall,
        tpot_ns=[g[2] for g in got if g[1] > 1],
        tail_ns=[g[3] for g in got],
        cpu_s=cpu,
        load_average_1m=round(os.getloadavg()[0], 2),
    )


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    """User and system CPU seconds so far of each process and its children."""
    import psutil

    out = {}
    for name, pid in pids.items():
        try:
            p = psutil.Process(pid)
            out[name] = sum(sum(x.cpu_times()[:2]) for x in (p, *p.children(recursive=True)))
        except psutil.Error:
            out[name] = 0.0
    return out


def _client(url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


@dataclasses.dataclass
class _Pool:
    """The gateway side's workers: their pause flags, processes and heartbeats."""

    cfg: Any
    flags: dict
    procs: dict
    r: Any

    def hb(self, w: str) -> Heartbeat:
        """`w`'s heartbeat; none yet reads as one with no state and no counts."""
        return WorkerRegistry(self.r, self.cfg.redis.key).read(w) or Heartbeat(w, "", 0.0)

    def wait_states(self, want: dict[str, str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(self.hb(w).state != s for w, s in want.items()):
            dead = [w for w, p in self.procs.items() if p.poll() is not None and want.get(w) != "stopped"]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"bench gateway: workers {dead or sorted(want)} not {want} in time (their logs: worker-*.log)"
                )
            time.sleep(0.05)

    def only(self, w: str) -> None:
        """`w` runs, the others are held at PAUSE."""
        from rose.rollout.pause_flag import PAUSE, RUN

        for k, f in self.flags.items():
            f.set(RUN if k == w else PAUSE)
        self.wait_states({k: "running" if k == w else "paused" for k in self.flags}, 60)


@dataclasses.dataclass
class _Streamed:
    pairs: list[tuple[int, int]]
    elapsed_s: float
    task_id: str
    worker: str
    at: list[float]  # each pair's arrival (time.monotonic())

    def largest_gap_ms(self) -> float:
        return round(max((b - a for a, b in zip(self.at, self.at[1:])), default=0.0) * 1e3, 3)


def stream_turn(url: str, body: dict, on_token: Callable[[int], None] = lambda k: None) -> _Streamed:
    """A streamed gateway turn read as raw server-sent events: its (index, id) pairs in arrival
    order (the index from each chunk's version span), its time, task and finishing worker."""
    import httpx
    import orjson

    t0 = time.monotonic()
    pairs: list[tuple[int, int]] = []
    at: list[float] = []
    task_id, worker = "", ""
    with httpx.Client(timeout=300) as h, h.stream("POST", url + "/v1/completions", json=body) as sr:
        sr.raise_for_status()
        for line in sr.iter_lines():
            if not line.startswith("data: {"):
                continue
            e = orjson.loads(line[6:])
            task_id = e.get("id", "").removeprefix("cmpl-")
            ch = e["choices"][0]
            if ch.get("finish_reason") is not None:
                worker = ch.get("worker", "")
                continue
            idx = [i for sp in ch.get("weight_versions") or () for i in range(sp["start"], sp["end"])]
            for i, t in zip(idx, ch.get("token_ids") or ()):
                pairs.append((i, t))
                at.append(time.monotonic())
                on_token(len(pairs))
    return _Streamed(pairs, time.monotonic() - t0, task_id, worker, at)


def final_ids(pool: _Pool, task_id: str) -> list[int]:
    for _i, f in pool.r.xrange(pool.cfg.redis.key("results", JOB)):
        t = Trajectory.from_fields(f)
        if t.task_id == task_id:
            return list(t.body["turns"][0]["action"])
    return []


def run_revoke(pool: _Pool, url: str, prompt: list[int], seed: int, max_tokens: int) -> dict:
    """The turn un-revoked on w0 `UNREVOKED_RUNS` times, then again with w0 stopped once the client
    has `max_tokens // 4` of its tokens (w1 let run at that moment)."""
    from rose.rollout.pause_flag import RUN, STOP
    from rose.rollout.worker import Worker

    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "seed": seed, "stream": True}
    pool.only("w0")
    base = [stream_turn(url, body) for _ in range(UNREVOKED_RUNS)]
    base_ids = [final_ids(pool, b.task_id) for b in base]
    base_ms = sorted(round(b.elapsed_s * 1e3, 3) for b in base)
    time.sleep(3 * Worker.HEARTBEAT_S)  # a heartbeat that counts the last un-revoked turn
    before = pool.hb("w0")
    at = max(1, max_tokens // 4)
    stop_t: list[float] = []

    def revoke_at(k: int) -> None:
        if k == at:
            stop_t.append(time.monotonic())
            pool.flags["w1"].set(RUN)
            pool.flags["w0"].set(STOP)

    rev = stream_turn(url, body, revoke_at)
    pool.wait_states({"w0": "stopped"}, 60)
    after = pool.hb("w0")
    carried = after.tokens_carried - before.tokens_carried
    acc = revoke_accounting(rev.pairs, final_ids(pool, rev.task_id), base_ids[0], max_tokens, carried)
    turn_ms, median = round(rev.elapsed_s * 1e3, 3), base_ms[len(base_ms) // 2]
    handoff = carried if 0 < carried <= max_tokens else acc["same_as_unrevoked_tokens"]
    resumed = next((t for (i, _), t in zip(rev.pairs, rev.at) if i >= handoff), None)
    return {
        **acc,
        "revoked_mid_turn": rev.worker == "w1" and after.requeued > before.requeued,
        "unrevoked_runs_identical": all(b == base_ids[0] for b in base_ids),
        "stop_after_streamed_tokens": at,
        "finished_by": rev.worker,
        "turn_ms": turn_ms,
        "unrevoked_turn_ms": median,
        "unrevoked_turns_ms": base_ms,
        "added_latency_ms": round(turn_ms - median, 3),
        "stop_to_next_worker_token_ms": round((resumed - stop_t[0]) * 1e3, 3) if resumed and stop_t else None,
        "largest_token_gap_ms": rev.largest_gap_ms(),
        "largest_token_gap_ms_unrevoked": max(b.largest_gap_ms() for b in base),
    }


@dataclasses.dataclass
class _Figures:
    direct: list[Side]
    gateway: list[Side]
    first: list[str]
    revoke: dict
    beats: list


@dataclasses.dataclass(frozen=True)
class Plan:
    """The load: `rounds` rounds of `turns` turns of `max_tokens` tokens, `concurrency` at once."""

    vocab: int
    turns: int
    max_tokens: int
    concurrency: int
    rounds: int


def run_rounds(
    plan: Plan, direct: tuple[Any, str], gateway: tuple[Any, str], pids: dict, say: Callable[[str], None]
) -> tuple[list[Side], list[Side], list[str]]:
    """The load on both sides, round by round; `direct`/`gateway`: (client, model name). Round k
    runs the turns seeded from k × turns on each side, the first side alternating."""
    sides: dict[str, list[Side]] = {"direct": [], "gateway": []}
    clients = {"direct": direct, "gateway": gateway}
    first = []
    for k in range(plan.rounds):
        work = load(plan.vocab, plan.turns, seed0=k * plan.turns)
        order = ("direct", "gateway") if k % 2 == 0 else ("gateway", "direct")
        first.append(order[0])
        for name in order:
            client, model = clients[name]
            sides[name].append(drive(client, model, work, plan.max_tokens, plan.concurrency, pids))
        say(
            f"round {k + 1}/{plan.rounds}: direct {sides['direct'][-1].turns_per_s} turns/s, "
            f"gateway {sides['gateway'][-1].turns_per_s} turns/s"
        )
    return sides["direct"], sides["gateway"], first


def run_sides(cfg: Any, model: str, logs: Path, plan: Plan, say: Callable[[str], None]) -> _Figures:
    """Both sides up together (vLLM's server; the gateway over two workers), warmed, the rounds
    run; then the server stopped and the revoke run on the gateway side."""
    import redis

    from rose.vllm_server import start_server, stop_server

    warm = load(plan.vocab, plan.concurrency, seed0=1_000_000)
    with private_stack(cfg, "gateway", kafka=False) as c:
        c = _gateway_cfg(c)
        r = redis.Redis.from_url(c.redis.url)
        try:
            with _workers(c, r, model, logs, plan.concurrency) as pool:
                srv = start_server(
                    model,
                    logs / "vllm-server.log",
                    max_model_len=MAX_MODEL_LEN,
                    threads=THREADS,
                    python=cfg.rollout.python,
                    timeout_s=ENGINE_START_S,
                    env=UNBOUND,
                )
                try:
                    pool.wait_states({"w0": "running", "w1": "paused"}, ENGINE_START_S)
                    gw = ServedGateway(c)
                    try:
                        direct, gateway = (_client(srv.url), srv.model), (_client(gw.url), MODEL)
                        say("both sides up; warming each engine (unmeasured)")
                        drive(*direct, warm, plan.max_tokens, plan.concurrency, {})
                        for w in ("w1", "w0"):  # each worker engine's first steps
                            pool.only(w)
                            drive(*gateway, warm, plan.max_tokens, plan.concurrency, {})
                        pids = {"vllm_server": srv.proc.pid} if srv.proc is not None else {}
                        pids |= {
                            f"worker_{w}" + (" (paused)" if w == "w1" else ""): p.pid for w, p in pool.procs.items()
                        }
                        d_rounds, g_rounds, first = run_rounds(plan, direct, gateway, pids, say)
                        stop_server(srv)
                        first_turn = load(plan.vocab, 1)[0]
                        revoke_tokens = max(plan.max_tokens, REVOKE_MIN_TOKENS)
                        revoke = run_revoke(pool, gw.url, first_turn[0], first_turn[1], revoke_tokens)
                        beats = [last_heartbeat(r, c, w) for w in ("w0", "w1")]
                    finally:
                        gw.stop()
                finally:
                    stop_server(srv)
        finally:
            r.close()
    return _Figures(d_rounds, g_rounds, first, revoke, beats)


def _gateway_cfg(c: Any) -> Any:
    from rose.config import GatewayConfig

    return dataclasses.replace(
        c,
        executor=dataclasses.replace(c.executor, job=JOB, model=MODEL),
        gateway=GatewayConfig(request_timeout_s=600.0, pause_patience_s=600.0),
    )


@contextlib.contextmanager
def _workers(c: Any, r: Any, model: str, logs: Path, concurrency: int) -> Iterator[_Pool]:
    """Two vLLM rollout workers on `model`, each leased with a pause flag (w1 starts at PAUSE)."""
    fields = {"engine": "vllm", "checkpoint": model, "nice": 0, "max_batch": concurrency}
    fields |= {"max_model_len": MAX_MODEL_LEN, "threads": THREADS, "mem_bytes": ENGINE_LEASE_BYTES}
    with rollout_workers(c, "gw", logs, fields, paused=("w1",)) as (flags, procs):
        yield _Pool(c, flags, procs, r)


def run(
    cfg: Any,
    quick: bool,
    *,
    model: str = "",
    turns: int = 0,
    max_tokens: int = 0,
    concurrency: int = CONCURRENCY,
    rounds: int = 0,
) -> dict:
    import tempfile

    import redis

    with contextlib.closing(redis.Redis.from_url(cfg.redis.url)) as r:
        r.ping()  # Redis away: say so before making a checkpoint or starting an engine
    t0 = time.monotonic()
    turns = turns or (QUICK_TURNS if quick else TURNS)
    max_tokens = max_tokens or (QUICK_MAX_TOKENS if quick else MAX_TOKENS)
    rounds = rounds or (QUICK_ROUNDS if quick else ROUNDS)
    logs = Path(tempfile.mkdtemp(prefix="rose-bench-gateway-"))  # the engines' logs, kept should the run fail
    progress("gateway", t0, f"engine logs in {logs} (removed when the run succeeds)")
    with tempfile.TemporaryDirectory(prefix="rose-bench-gateway-model-") as tmp:
        model = checkpoint_or_tiny(model, Path(tmp))
        progress("gateway", t0, f"checkpoint {model}")
        vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
        plan = Plan(vocab, turns, max_tokens, concurrency, rounds)
        progress(
            "gateway",
            t0,
            f"starting vLLM's OpenAI server and two vLLM rollout workers; then {rounds} rounds of "
            f"{turns} turns of {max_tokens} tokens, {concurrency} at once, on each side",
        )
        g = run_sides(cfg, model, logs, plan, lambda m: progress("gateway", t0, m))
        progress("gateway", t0, f"revoke added {g.revoke['added_latency_ms']} ms")
    shutil.rmtree(logs, ignore_errors=True)
    engine = engine_report(dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine="vllm")), g.beats)
    params = {"turns": turns, "max_tokens": max_tokens, "concurrency": concurrency, "prompt_tokens": PROMPT_TOKENS}
    params["max_model_len"] = MAX_MODEL_LEN
    return report(engine["engine"], g.direct, g.gateway, g.revoke, params, step_report(g.beats), g.first)
