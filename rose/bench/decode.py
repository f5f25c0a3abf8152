"""vLLM's decode tokens/s on this CPU for each compute dtype and thread count, beside the dtype `rollout.dtype = "native"` picks from the CPU's flags."""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any

from rose.bench._stack import checkpoint_or_tiny, progress
from rose.rollout.compute_dtype import NATIVE_BF16_FLAGS, native_dtype, this_cpu_flags

DTYPES = ("float32", "bfloat16")
BATCH, PROMPT_TOKENS, MAX_MODEL_LEN = 8, 16, 512
TOKENS, QUICK_TOKENS = 128, 16  # decode steps timed per cell (after one prefill step)
REPEATS, QUICK_REPEATS = 3, 1  # timed runs per cell; the median is reported


def run(cfg: Any, quick: bool, *, model: str = "") -> dict:
    """Each (dtype, threads) cell in a process of its own (one vLLM engine each, started and warmed
    before the timing): BATCH seeded sequences of PROMPT_TOKENS ids, one prefill step, then
    TOKENS decode steps timed, REPEATS times; tokens/s is the median run's. The reference beside
    the picked dtype is the fastest cell measured in the same run."""
    import tempfile
    from pathlib import Path

    t0 = time.monotonic()
    threads = sorted({1, os.cpu_count() or 1})
    tokens, repeats = (QUICK_TOKENS, QUICK_REPEATS) if quick else (TOKENS, REPEATS)
    with tempfile.TemporaryDirectory(prefix="rose-bench-decode-") as tmp:
        model = checkpoint_or_tiny(model, Path(tmp))
        cells = []
        for dtype in DTYPES:
            for n in threads:
                progress("decode", t0, f"{dtype}, {n} thread(s): starting vLLM on {Path(model).name}")
                cell = _cell(model, dtype, n, tokens, repeats)
                progress("decode", t0, f"{dtype}, {n} thread(s): {cell.get('tokens_per_s', cell.get('error'))}")
                cells.append(cell)
    flags = this_cpu_flags()
    picked = native_dtype("cpu", flags)
    ok = [c for c in cells if "tokens_per_s" in c]
    fastest = max(ok, key=lambda c: c["tokens_per_s"]) if ok else None
    best_picked = max((c for c in ok if c["dtype"] == picked), key=lambda c: c["tokens_per_s"], default=None)
    return {
        "engine": _vllm_version(),
        "model": model,
        "batch": BATCH,
        "prompt_tokens": PROMPT_TOKENS,
        "decode_steps_timed": tokens,
        "repeats": repeats,
        "cpu_bf16_flags": sorted(flags & NATIVE_BF16_FLAGS),
        "cpu_avx512f": "avx512f" in flags,
        "picked_dtype": picked,
        "cells": cells,
        "fastest": None if fastest is None else {k: fastest[k] for k in ("dtype", "threads", "tokens_per_s")},
        "picked_dtype_is_fastest": None if fastest is None else fastest["dtype"] == picked,
        "picked_over_fastest_tokens_per_s": (
            round(best_picked["tokens_per_s"] / fastest["tokens_per_s"], 4) if best_picked and fastest else None
        ),
    }


def _cell(model: str, dtype: str, threads: int, tokens: int, repeats: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_measure, args=(q, model, dtype, threads, tokens, repeats), daemon=True)
    p.start()
    p.join(900)
    if p.is_alive():
        p.kill()
        return {"dtype": dtype, "threads": threads, "error": "no result within 900 s"}
    out: dict = q.get() if not q.empty() else {"error": f"the measuring process exited {p.exitcode}"}
    return {"dtype": dtype, "threads": threads, **out}


def _measure(q: Any, model: str, dtype: str, threads: int, tokens: int, repeats: int) -> None:
    """In the cell's own process: the engine the rollout worker runs, timed over decode steps."""
    import statistics

    try:
        from rose.rollout.engine import GenRequest
        from rose.rollout.engines.vllm_engine import VllmEngine

        t = time.monotonic()
        eng = VllmEngine(model, max_batch=BATCH, max_model_len=MAX_MODEL_LEN, dtype=dtype, threads=threads)
        start_s = time.monotonic() - t
        vocab = eng.vocab_size
        rates = []
        for r in range(repeats):
            reqs = [
                GenRequest(f"r{r}-s{i}", [(7 * i + j) % vocab for j in range(PROMPT_TOKENS)], seed=i)
                for i in range(BATCH)
            ]
            eng.generate(reqs, 1)  # the prefill step, not timed
            t = time.monotonic()
            out = eng.generate([GenRequest(x.seq_id) for x in reqs], tokens)
            rates.append(sum(map(len, out)) / (time.monotonic() - t))
            for x in reqs:
                eng.release(x.seq_id)
        q.put(
            {
                "tokens_per_s": round(statistics.median(rates), 1),
                "runs_tokens_per_s": [round(x, 1) for x in rates],
                "engine_start_s": round(start_s, 1),
            }
        )
    except Exception as e:  # noqa: BLE001 - a dtype the engine refuses here is a result, said as such
        q.put({"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]})


def _vllm_version() -> str:
    try:
        import vllm

        return f"vllm {vllm.__version__}"
    except ImportError:
        return "vllm (not installed)"
