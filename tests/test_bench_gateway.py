"""`rose bench gateway`: the pure part (percentiles, the ratio, the revoke's token accounting) on
crafted and generated samples, the command line's refusals, and one small run of the whole bench
on vLLM (both sides, the revoke) on the local stack (slow: vLLM starts three times)."""

from __future__ import annotations

import contextlib
import math
import os
import socket
import subprocess
import sys

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rose.bench import gateway as gb
from rose.bench import gateway_figures as gf

# -- percentiles and the ratio -------------------------------------------------------------


def test_a_side_reports_nearest_rank_percentiles_and_turns_per_s():
    side = gb.Side(ttft_ns=[i * 1_000_000 for i in range(1, 101)], tokens=[16] * 99 + [15], wall_s=4.0)
    r = side.report(max_tokens=16)
    assert r["ttft_ms"] == {"p50_ms": 50.0, "p99_ms": 99.0, "n": 100}
    assert r["turns_per_s"] == 25.0 and r["n"] == 100 and r["turns_short"] == 1


def test_an_empty_side_has_no_figures():
    r = gb.Side([], [], 0.0).report(16)
    assert r["turns_per_s"] is None and r["ttft_ms"] == {"p50_ms": None, "p99_ms": None, "n": 0}


@given(st.lists(st.integers(1, 10**10), min_size=1, max_size=200))
def test_p50_is_at_most_p99_and_both_are_samples(ns):
    t = gb.Side(ns, [1] * len(ns), 1.0).report(1)["ttft_ms"]
    ms = {round(x / 1e6, 3) for x in ns}
    assert t["p50_ms"] <= t["p99_ms"] and t["p50_ms"] in ms and t["p99_ms"] in ms and t["n"] == len(ns)


@given(st.floats(1e-6, 1e6), st.floats(1e-6, 1e6))
def test_the_ratio_is_positive_and_finite(a, b):
    r = gf.ratio(a, b)
    assert r is not None and math.isfinite(r) and r >= 0
    assert r == round(a / b, 3)


@pytest.mark.parametrize("a,b", [(None, 1.0), (1.0, None), (0.0, 1.0), (1.0, 0.0), (math.inf, 1.0), (1.0, math.nan)])
def test_no_ratio_without_two_positive_finite_numbers(a, b):
    assert gf.ratio(a, b) is None


def test_the_report_keeps_the_contract_fields():
    d = gb.Side([10_000_000] * 8, [16] * 8, 2.0)
    g = gb.Side([20_000_000] * 8, [16] * 8, 4.0)
    revoke = gb.revoke_accounting([(i, i) for i in range(4)], [0, 1, 2, 3], [0, 1, 2, 3], 4)
    out = gb.report({"name": "vllm", "version": "x", "device": "cpu"}, [d], [g], revoke, {"max_tokens": 16})
    assert out["engine"] == {"name": "vllm", "version": "x", "device": "cpu"}
    assert out["turns_per_s_ratio_gateway_over_direct"] == 0.5 and out["ratio_over_goal"] == round(0.5 / 0.9, 3)
    assert out["ttft_ms"] == {
        "gateway": {"p50_ms": 20.0, "p99_ms": 20.0, "n": 8},
        "direct": {"p50_ms": 10.0, "p99_ms": 10.0, "n": 8},
    }
    assert out["direct"]["turns_per_s"] == 4.0 and out["gateway"]["turns_per_s"] == 2.0
    assert {"complete", "tokens_lost", "tokens_repeated"} <= set(out["revoke_mid_turn"])


def test_rounds_pool_into_one_side_per_side_and_each_round_keeps_its_ratio():
    d = [gb.Side([10_000_000] * 8, [16] * 8, 2.0, cpu_s={"p": 1.0}), gb.Side([30_000_000] * 8, [16] * 8, 4.0)]
    g = [gb.Side([20_000_000] * 8, [16] * 8, 2.0, cpu_s={"p": 2.0}), gb.Side([20_000_000] * 8, [16] * 8, 2.0)]
    out = gb.report({}, d, g, {}, {"max_tokens": 16}, first=["direct", "gateway"])
    assert out["rounds"] == 2 and out["first_in_round"] == ["direct", "gateway"]
    assert out["direct"]["n"] == 16 and out["direct"]["turns_per_s"] == round(16 / 6.0, 3)
    assert out["gateway"]["turns_per_s"] == 4.0 and out["gateway"]["cpu_s"] == {"p": 2.0}
    assert out["turns_per_s_ratio_gateway_over_direct"] == 1.5  # 6 s of direct against 4 s of gateway
    rr = out["turns_per_s_ratio_rounds"]
    assert rr["by_round"] == [1.0, 2.0] and (rr["min"], rr["median"], rr["max"]) == (1.0, 1.5, 2.0)
    assert out["ttft_ms"]["direct"]["p99_ms"] == 30.0


@given(st.lists(st.tuples(st.floats(0.01, 100.0), st.floats(0.01, 100.0)), min_size=1, max_size=12))
def test_the_pooled_ratio_lies_within_the_rounds_ratios(walls):
    """Equal turns per round on both sides: the pooled ratio (a mediant of the rounds') is within their range."""
    d = [gb.Side([1] * 8, [1] * 8, wd) for wd, _ in walls]
    g = [gb.Side([1] * 8, [1] * 8, wg) for _, wg in walls]
    out = gb.report({}, d, g, {}, {"max_tokens": 1})
    rr, r = out["turns_per_s_ratio_rounds"], out["turns_per_s_ratio_gateway_over_direct"]
    assert len(rr["by_round"]) == len(walls) and rr["min"] <= rr["median"] <= rr["max"]
    assert rr["min"] - 0.002 <= r <= rr["max"] + 0.002  # each figure rounded to 3 digits


def test_the_load_is_the_same_for_the_same_turns_and_below_the_vocabulary():
    a, b = gb.load(1024, 8), gb.load(1024, 8)
    assert a == b and [s for _p, s in a] == list(range(8))
    assert all(len(p) == gb.PROMPT_TOKENS and all(0 < t < 1024 for t in p) for p, _s in a)


# -- the revoke's accounting ------------------------------------------------------------------


FINAL = [5, 9, 2, 7, 7, 1, 3, 8]


def test_a_whole_answer_streamed_once_in_order_is_complete():
    unrevoked = FINAL[:3] + [0] * 5  # the continuation draws anew after the hand-off at 3
    acc = gb.revoke_accounting(list(enumerate(FINAL)), FINAL, unrevoked, 8, carried=3)
    assert acc["complete"] and acc["tokens_lost"] == 0 and acc["tokens_repeated"] == 0
    assert acc["same_as_unrevoked_tokens"] == 3 and acc["tokens_carried"] == 3


def test_a_token_never_streamed_is_lost():
    streamed = [(i, t) for i, t in enumerate(FINAL) if i != 4]
    acc = gb.revoke_accounting(streamed, FINAL, FINAL, 8)
    assert not acc["complete"] and acc["tokens_lost"] == 1 and acc["tokens_repeated"] == 0


def test_a_token_streamed_other_than_the_answer_is_lost():
    streamed = list(enumerate(FINAL))
    streamed[2] = (2, 99)  # the client was told 99, the answer says 2
    acc = gb.revoke_accounting(streamed, FINAL, FINAL, 8)
    assert not acc["complete"] and acc["tokens_lost"] == 1


def test_an_index_streamed_twice_is_repeated():
    streamed = list(enumerate(FINAL[:5])) + [(3, FINAL[3]), (4, FINAL[4])] + list(enumerate(FINAL))[5:]
    acc = gb.revoke_accounting(streamed, FINAL, FINAL, 8)
    assert not acc["complete"] and acc["tokens_repeated"] == 2 and acc["tokens_lost"] == 0


def test_a_token_past_the_answer_is_repeated_and_a_short_answer_is_not_complete():
    acc = gb.revoke_accounting([*enumerate(FINAL), (8, 4)], FINAL, FINAL, 8)
    assert acc["tokens_repeated"] == 1 and not acc["complete"]
    short = gb.revoke_accounting(list(enumerate(FINAL[:6])), FINAL[:6], FINAL, 8)
    assert short["tokens_lost"] == 0 and not short["complete"]


def test_tokens_out_of_order_are_not_complete():
    streamed = list(enumerate(FINAL))
    streamed[1], streamed[2] = streamed[2], streamed[1]
    acc = gb.revoke_accounting(streamed, FINAL, FINAL, 8)
    assert acc["tokens_lost"] == 0 and acc["tokens_repeated"] == 0 and not acc["complete"]


def test_carried_tokens_unlike_the_unrevoked_run_are_lost():
    unrevoked = [5, 9, 0, 7, 7, 1, 3, 8]  # the answer's token 2 is not what the revoked worker made
    acc = gb.revoke_accounting(list(enumerate(FINAL)), FINAL, unrevoked, 8, carried=4)
    assert acc["tokens_lost"] == 1 and not acc["complete"] and acc["same_as_unrevoked_tokens"] == 2


@given(
    st.lists(st.integers(0, 1023), min_size=1, max_size=40),
    st.lists(st.integers(0, 39), max_size=10),
    st.lists(st.integers(0, 39), max_size=10),
)
def test_dropped_and_doubled_indexes_are_counted(final, drop, double):
    n = len(final)
    drop_set = {i for i in drop if i < n}
    doubled = [i for i in double if i < n and i not in drop_set]
    streamed = [(i, final[i]) for i in range(n) if i not in drop_set] + [(i, final[i]) for i in doubled]
    acc = gb.revoke_accounting(streamed, final, final, n, carried=n)
    assert acc["tokens_lost"] == len(drop_set) and acc["tokens_repeated"] == len(doubled)
    assert acc["complete"] == (not drop_set and not doubled) and acc["same_as_unrevoked_tokens"] == n


# -- the command line -------------------------------------------------------------------------


@contextlib.contextmanager
def socket_on_free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.mark.parametrize(
    "args,says",
    [
        (["--turns", "-1"], "--turns -1"),
        (["--max-tokens", "100000"], "--max-tokens 100000"),
        (["--concurrency", "0"], "--concurrency 0"),
        (["--rounds", "-2"], "--rounds -2"),
        (["--model", "/nowhere"], "--model '/nowhere'"),
        (["--engine", "hf"], "--engine 'hf'"),
    ],
)
def test_bad_arguments_get_one_line_and_exit_2(args, says):
    p = subprocess.run(
        [sys.executable, "-m", "rose", "bench", "gateway", "--json", *args], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and says in p.stderr


def test_redis_away_gets_one_line_naming_it_and_exit_2(tmp_path):
    pytest.importorskip("vllm", reason="the bench refuses to start without vLLM first")
    with socket_on_free_port() as port:  # bound, never listening: refused
        p = subprocess.run(
            [sys.executable, "-m", "rose", "bench", "gateway", "--json", "--quick"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "ROSE_REDIS_URL": f"redis://127.0.0.1:{port}/0"},
        )
    assert p.returncode == 2 and p.stdout == "", p.stderr
    assert p.stderr.count("\n") == 1 and f"Redis at redis://127.0.0.1:{port}/0 is unreachable" in p.stderr


def test_other_benches_refuse_the_gateway_options():
    p = subprocess.run(
        [sys.executable, "-m", "rose", "bench", "revoke", "--turns", "3"], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2 and "--turns" in p.stderr


# -- a small run of the whole bench -----------------------------------------------------------


@pytest.mark.stack
@pytest.mark.slow  # 2.5 min on an idle 2-core machine, over 5 min on a busy one
@pytest.mark.timeout(900)
def test_a_small_run_reports_the_ratio_ttft_and_a_complete_revoke(cfg, tiny_checkpoint):
    pytest.importorskip("vllm", reason="the vLLM environment is installed by `make test` (docs/engines.md)")
    out = gb.run(cfg, quick=True, model=str(tiny_checkpoint), turns=16, max_tokens=16, rounds=2)
    orjson.dumps(out)  # JSON as it is
    assert out["engine"]["name"] == "vllm" and out["engine"]["device"] == "cpu" and out["engine"]["version"]
    r = out["turns_per_s_ratio_gateway_over_direct"]
    assert isinstance(r, float) and math.isfinite(r) and r > 0
    assert out["rounds"] == 2 and out["first_in_round"] == ["direct", "gateway"]
    assert all(x is not None and x > 0 for x in out["turns_per_s_ratio_rounds"]["by_round"])
    for side in ("gateway", "direct"):
        t = out["ttft_ms"][side]
        assert t["n"] == 32 and 0 < t["p50_ms"] <= t["p99_ms"]
        assert out[side]["n"] == 32 and out[side]["turns_per_s"] > 0 and out[side]["turns_short"] == 0
    rv = out["revoke_mid_turn"]
    assert rv["complete"] is True and rv["tokens_lost"] == 0 and rv["tokens_repeated"] == 0, rv
    assert rv["revoked_mid_turn"] is True and isinstance(rv["added_latency_ms"], float), rv
