"""`rose bench gateway`'s pure part: each side's samples (time to first token, per output token,
last token to the stream's end) to its figures, the pooled and per-round ratios of gateway over
direct, the revoke's token accounting, the report, and the seeded load both sides get. The bench
itself (rose.bench.gateway) runs the two sides and the revoke.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics

from rose.bench._stack import percentiles_ms

GOAL_RATIO = 0.9  # turns/s through the gateway over turns/s direct
PROMPT_TOKENS = 16
THREADS = 1  # OMP threads per engine, both sides


@dataclasses.dataclass
class Side:
    """One side's measured load: each turn's time to first token and token count, and the wall time."""

    ttft_ns: list[int]
    tokens: list[int]
    wall_s: float
    tpot_ns: list[int] = dataclasses.field(default_factory=list)  # each turn's mean time between tokens
    tail_ns: list[int] = dataclasses.field(default_factory=list)  # each turn's last token id to the response's end
    cpu_s: dict[str, float] = dataclasses.field(default_factory=dict)  # CPU seconds of each process while it ran
    load_average_1m: float | None = None  # the machine's, when the load ended (others' jobs count too)

    @property
    def turns_per_s(self) -> float | None:
        return round(len(self.ttft_ns) / self.wall_s, 3) if self.wall_s > 0 and self.ttft_ns else None

    def report(self, max_tokens: int) -> dict:
        p, tp, tl = percentiles_ms(self.ttft_ns), percentiles_ms(self.tpot_ns), percentiles_ms(self.tail_ns)
        return {
            "turns_per_s": self.turns_per_s,
            "n": len(self.ttft_ns),
            "wall_s": round(self.wall_s, 3),
            "turns_short": sum(1 for k in self.tokens if k != max_tokens),
            "ttft_ms": {"p50_ms": p["p50_ms"], "p99_ms": p["p99_ms"], "n": p["n"]},
            "tpot_ms": {"p50_ms": tp["p50_ms"], "p99_ms": tp["p99_ms"], "n": tp["n"]},
            "last_token_to_end_ms": {"p50_ms": tl["p50_ms"], "p99_ms": tl["p99_ms"], "n": tl["n"]},
            "cpu_s": {k: round(v, 3) for k, v in self.cpu_s.items()},
            "load_average_1m": self.load_average_1m,
        }


def ratio(num: float | None, den: float | None) -> float | None:
    """num/den rounded to 3 digits; None unless both are positive finite numbers."""
    if num is None or den is None or not (math.isfinite(num) and math.isfinite(den)) or num <= 0 or den <= 0:
        return None
    return round(num / den, 3)


def revoke_accounting(
    streamed: list[tuple[int, int]], final: list[int], unrevoked: list[int], max_tokens: int, carried: int = 0
) -> dict:
    """A revoked turn's tokens as the client saw them. `streamed`: (index, id) in arrival order;
    `final`: the answer's ids; `unrevoked`: the same turn's ids without a revoke; `carried`: tokens
    the revoked worker handed on (they must equal the un-revoked run's). Lost: an answer index the
    client never got, got with another id, or a carried token that differs from the un-revoked run;
    repeated: a second token at an index, or a token at an index past the answer."""
    got: dict[int, int] = {}
    order: list[int] = []
    repeated = 0
    for i, t in streamed:
        if i in got or i >= len(final) or i < 0:
            repeated += 1
            continue
        got[i] = t
        order.append(i)
    lost = sum(1 for i, t in enumerate(final) if got.get(i) != t)
    lost += sum(1 for i in range(min(carried, len(final), len(unrevoked))) if final[i] != unrevoked[i])
    lost += max(0, carried - len(final))
    kept = next((i for i, (a, b) in enumerate(zip(final, unrevoked)) if a != b), min(len(final), len(unrevoked)))
    return {
        "complete": len(final) == max_tokens and order == list(range(max_tokens)) and lost == 0 and repeated == 0,
        "tokens_lost": lost,
        "tokens_repeated": repeated,
        "tokens_carried": carried,
        "same_as_unrevoked_tokens": kept,
        "max_tokens": max_tokens,
    }


def pooled(sides: list[Side]) -> Side:
    """Rounds of one side as one: their samples together, wall times and CPU seconds summed, the
    highest load average."""
    cpu: dict[str, float] = {}
    for s in sides:
        for k, v in s.cpu_s.items():
            cpu[k] = cpu.get(k, 0.0) + v
    loads = [s.load_average_1m for s in sides if s.load_average_1m is not None]
    return Side(
        ttft_ns=[x for s in sides for x in s.ttft_ns],
        tokens=[x for s in sides for x in s.tokens],
        wall_s=sum(s.wall_s for s in sides),
        tpot_ns=[x for s in sides for x in s.tpot_ns],
        tail_ns=[x for s in sides for x in s.tail_ns],
        cpu_s=cpu,
        load_average_1m=max(loads) if loads else None,
    )


def round_ratios(direct: list[Side], gateway: list[Side]) -> dict:
    """Each round's turns/s ratio (gateway over direct) and their min, median and max."""
    rs = [ratio(g.turns_per_s, d.turns_per_s) for d, g in zip(direct, gateway)]
    known = [r for r in rs if r is not None]
    return {
        "by_round": rs,
        "min": min(known, default=None),
        "median": round(statistics.median(known), 3) if known else None,
        "max": max(known, default=None),
        "direct_turns_per_s_by_round": [d.turns_per_s for d in direct],
        "gateway_turns_per_s_by_round": [g.turns_per_s for g in gateway],
    }


def report(
    engine: dict,
    direct: list[Side],
    gateway: list[Side],
    revoke: dict,
    params: dict,
    steps: dict | None = None,
    first: list[str] | None = None,
) -> dict:
    """The bench's JSON (CONTRACT §6): `engine`, the pooled ratio beside each round's, `ttft_ms`
    of both sides, `revoke_mid_turn`; `direct`/`gateway`: each side's rounds in order; `first`:
    the side that went first in each round; `steps`: the gateway side's workers' engine-step
    times (`rose.bench._stack.step_report`)."""
    mt = params["max_tokens"]
    d, g = pooled(direct).report(mt), pooled(gateway).report(mt)
    r = ratio(g["turns_per_s"], d["turns_per_s"])
    return {
        "engine": engine,
        **params,
        "rounds": len(direct),
        "first_in_round": first or [],
        "threads_per_engine": THREADS,
        "engines_serving_load": {"direct": 1, "gateway": 1},
        "direct": d,
        "gateway": g,
        "turns_per_s_ratio_gateway_over_direct": r,
        "turns_per_s_ratio_rounds": round_ratios(direct, gateway),
        "goal_turns_per_s_ratio": GOAL_RATIO,
        "ratio_over_goal": round(r / GOAL_RATIO, 3) if r is not None else None,
        "ttft_ms": {"gateway": g["ttft_ms"], "direct": d["ttft_ms"]},
        "ttft_p50_ratio_gateway_over_direct": ratio(g["ttft_ms"]["p50_ms"], d["ttft_ms"]["p50_ms"]),
        "ttft_p99_ratio_gateway_over_direct": ratio(g["ttft_ms"]["p99_ms"], d["ttft_ms"]["p99_ms"]),
        "tpot_p50_ratio_gateway_over_direct": ratio(g["tpot_ms"]["p50_ms"], d["tpot_ms"]["p50_ms"]),
        "gateway_worker_engine_step_ms": steps or {},
        "revoke_mid_turn": revoke,
        "note": "same load on both sides, in alternating rounds (never together; both sides' processes up "
        "throughout, the side going first alternating): streamed completions from the openai client in the "
        "bench's process; direct = vLLM's own OpenAI server, gateway = the gateway in the bench's process over "
        "vLLM rollout workers (one serving the load); the headline ratio and each side's figures pool every "
        "round (turns over summed wall time), turns_per_s_ratio_rounds gives each round's; ttft = request "
        "sent to the first chunk carrying a token id, tpot = a turn's mean time between token ids after the "
        "first, last_token_to_end = the last token id to the stream's end; cpu_s = CPU seconds each process "
        "(both sides') used during that side's load; "
        "gateway_worker_engine_step_ms = the workers' own timing of their engine steps (heartbeats)",
    }


def load(vocab: int, turns: int, seed0: int = 0) -> list[tuple[list[int], int]]:
    """`turns` (prompt, seed) pairs: `PROMPT_TOKENS` ids below `vocab`, seeded by the turn's number."""
    out = []
    for i in range(seed0, seed0 + turns):
        g = random.Random(i)
        out.append(([g.randrange(1, vocab) for _ in range(PROMPT_TOKENS)], i))
    return out
