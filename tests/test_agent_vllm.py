"""The agent's reading of a real vLLM server: the p99s that `rose agent` would publish are the
server's own histograms read right, and the KV-cache usage is a fraction.

A session fixture starts vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`, the
CPU build) on the tiny random-init checkpoint, without a tokenizer: prompts are token ids and the
stream returns token ids. Concurrent streaming completions are timed on the client (TTFT, every
inter-token gap); /metrics is scraped before and after (and during a second load); the agent's
own code (`scrape`, `prometheus.parse` with the agent's `keep` set, `prometheus.window`,
`telemetry_records`) reads the scrapes, and the test reads the same scrapes with
prometheus_client's parser as the reference. No Kafka: the published records are checked by the
decoder and the schema."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import pytest

from rose.contract.events import Telemetry
from rose.node import prometheus as prom
from rose.node.agent import scrape
from rose.node.telemetry import telemetry_records
from rose.vllm_server import VllmServer as Server

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM installed")

# Waves of CONCURRENCY requests: a wave's prompts (8 x 224 tokens) fit one prefill step of the CPU
# server's 2048-token budget, so its requests then decode together, step after step, and the
# inter-token figures are of decode steps, not of prefills of later arrivals.
CONCURRENCY = 8
WAVES = 6
REQUESTS = WAVES * CONCURRENCY
MAX_TOKENS = 32
PROMPT_LEN = 224
SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "rose.telemetry.v1.json"


@dataclass
class Timings:
    """What the client measured, in seconds."""

    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)  # one per token after the first
    tokens: int = 0
    merged_chunks: int = 0  # chunks that carried more than one token (their gap split evenly)


def stream_completion(server: Server, prompt: list[int], max_tokens: int, out: Timings, lock: threading.Lock) -> None:
    """One streaming completion with token ids as the prompt; TTFT and every inter-token gap
    timed on arrival of each server-sent event."""
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,  # a random model may draw its EOS: every request produces max_tokens
        "return_token_ids": True,  # no tokenizer: the events carry ids, the text stays empty
    }
    req = urllib.request.Request(
        server.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    ttft, gaps, merged, n = None, [], 0, 0
    t0 = time.perf_counter()
    last = t0
    with urllib.request.urlopen(req, timeout=120) as r:  # noqa: S310 - local server
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            now = time.perf_counter()
            k = sum(len(c.get("token_ids") or ()) for c in json.loads(line[5:])["choices"])
            if k == 0:
                continue
            if ttft is None:
                ttft = now - t0
                k -= 1  # the first token; any others of the same event follow it
                last = now
            if k > 0:
                merged += k > 1
                gaps += [(now - last) / k] * k
                last = now
            n += k
    assert ttft is not None, "the stream carried no token"
    with lock:
        out.ttft.append(ttft)
        out.gaps += gaps
        out.tokens += n + 1
        out.merged_chunks += merged


_SALT = random.Random().randrange(1 << 30)  # one per process: no prompt hits another run's prefix cache


def prompt(i: int, n: int) -> list[int]:
    """Request `i`'s prompt: `n` token ids of the 1024-token vocabulary, sharing no prefix with another's."""
    rng = random.Random(_SALT + i)
    return [rng.randrange(1, 1024) for _ in range(n)]


def run_load(server: Server, waves: int, size: int, max_tokens: int, prompt_len: int, during=None) -> Timings:
    """`waves` waves of `size` concurrent completions, each wave sent once the previous one has
    finished (all of a wave decode together: steps of one batch size); `during()` runs meanwhile."""
    out, lock = Timings(), threading.Lock()
    done = threading.Event()

    def send():
        try:
            with ThreadPoolExecutor(size) as pool:
                for w in range(waves):
                    futs = [
                        pool.submit(stream_completion, server, prompt(w * size + i, prompt_len), max_tokens, out, lock)
                        for i in range(size)
                    ]
                    for f in futs:
                        f.result()
        finally:
            done.set()

    with ThreadPoolExecutor(1) as driver:
        fut = driver.submit(send)
        if during is not None:
            during(done)
        fut.result()
    return out


def server_buckets(text: str, name: str) -> dict[float, float]:
    """The cumulative bucket counts of histogram `name` in one /metrics page by upper bound, summed
    over label sets, read with prometheus_client's parser (the reference: not the agent's)."""
    from prometheus_client.parser import text_string_to_metric_families  # vLLM's dependency, as vLLM is

    out: dict[float, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == name + "_bucket":
                le = float(smp.labels["le"])
                out[le] = out.get(le, 0.0) + smp.value
    return out


@dataclass
class Measured:
    """One window: what the client timed, the agent's reading, and the two /metrics pages."""

    client: Timings
    window: prom.ServingWindow
    before: prom.Scrape
    after: prom.Scrape
    pages: tuple[str, str]  # /metrics before and after, as the server rendered them

    def buckets(self, name: str) -> tuple[list[float], list[float]]:
        """(upper bounds, cumulative counts) of histogram `name` over the window: the later page's
        counts less the earlier page's."""
        now, prev = (server_buckets(p, name) for p in reversed(self.pages))
        bounds = sorted(now)
        return bounds, [now[b] - prev.get(b, 0.0) for b in bounds]

    def server_quantile(self, name: str, q: float) -> tuple[float, float, float]:
        """(lower, upper, value): the bucket of the window's histogram holding the sample of rank
        q·n, and Prometheus' histogram_quantile in it (linear within the bucket)."""
        bounds, cum = self.buckets(name)
        rank = q * cum[-1]
        k = next(i for i, c in enumerate(cum) if c >= rank)
        lo, below = (bounds[k - 1], cum[k - 1]) if k else (0.0, 0.0)
        assert not math.isinf(bounds[k]), f"the {q} rank of {name} is in the +Inf bucket: {self.figures()}"
        return lo, bounds[k], lo + (bounds[k] - lo) * (rank - below) / (cum[k] - below)

    def figures(self) -> str:
        w, c = self.window, self.client
        return (
            f"reader: TTFT p99 {w.ttft_p99_ms} ms, inter-token p99 {w.tpot_p99_ms} ms; server window: TTFT "
            f"buckets {self.buckets(TTFT)}, inter-token buckets {self.buckets(ITL)}; client: {len(c.ttft)} requests, "
            f"TTFT max {max(c.ttft, default=0) * 1000:.1f} ms, {len(c.gaps)} gaps ({c.merged_chunks} events of 2+ "
            f"tokens); rps {w.rps}; kv_cache_usage after {w.kv_cache_usage}"
        )


TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"


def measure(server: Server, names, keep) -> Measured:
    """One window: scrape, the load, scrape again once the server has counted every request. No
    scrape runs while the requests do: vLLM renders /metrics on the event loop that streams the
    tokens, so a scrape under load delays a wave's first tokens by its rendering time, and the
    TTFT figure (the slowest of REQUESTS) would time the scrape, not the serving."""
    metrics = server.url + "/metrics"
    first = scrape(metrics, 5.0)
    before = prom.parse(first, keep)
    t0 = time.monotonic()
    client = run_load(server, WAVES, CONCURRENCY, MAX_TOKENS, PROMPT_LEN)
    for _ in range(50):  # the server records a request's figures as it streams its last event
        last = scrape(metrics, 5.0)
        after = prom.parse(last, keep)
        if after.histograms[TTFT].count - before.histograms[TTFT].count >= REQUESTS:
            break
        time.sleep(0.1)
    return Measured(client, prom.window(after, before, time.monotonic() - t0, names), before, after, (first, last))


def busy_windows(server: Server, names, keep) -> list[prom.ServingWindow]:
    """The agent's reading of scrapes taken while a load runs (a load of its own, not measured:
    as many waves as a measured window, scraped every 0.1 s until three scrapes saw requests
    running; a wave takes a few tenths of a second)."""
    metrics = server.url + "/metrics"
    busy: list[prom.ServingWindow] = []

    def while_running(done: threading.Event):
        while not done.wait(0.1) and len(busy) < 3:
            w = prom.window(prom.parse(scrape(metrics, 5.0), keep), None, 0.0, names)
            if w.running:
                busy.append(w)

    run_load(server, WAVES, CONCURRENCY, MAX_TOKENS, PROMPT_LEN, during=while_running)
    return busy


@pytest.mark.timeout(600)  # the server's start (tests/conftest.py: vllm_server) counts here
def test_agent_reads_the_server_s_own_histograms(vllm_server):
    """The agent's p99s of one window are the server's own: each lies in the bucket of the
    window's histogram (the later scrape's counts less the earlier's, read with
    prometheus_client) that holds the sample of rank 0.99·n, and equals Prometheus'
    histogram_quantile there. Of REQUESTS requests the rank of the TTFT p99 is the last one, so
    that figure is the slowest request's bucket (the max, not a tail percentile); the
    inter-token p99 ranks among REQUESTS·(MAX_TOKENS-1) gaps. The client is compared like with
    like: the window counts exactly the requests and gaps it saw, and since vLLM times a first
    token from the request's arrival to its output, inside the client's span, every TTFT bucket
    of the server holds at least as many requests as the client's TTFTs put there. Fails if the
    reader does not subtract the earlier scrape (the warm-up's requests join the window)."""
    names = prom.metric_names("auto")  # the agent's default: `telemetry.engine = "auto"`
    keep = prom.all_names(names)
    run_load(vllm_server, 1, 2, 4, 16)  # warm-up: first-request costs stay out of the window

    m = measure(vllm_server, names, keep)
    print(m.figures())
    w, c = m.window, m.client
    assert len(c.ttft) == REQUESTS and len(c.gaps) == REQUESTS * (MAX_TOKENS - 1), m.figures()
    # the window holds exactly the measured requests, read through the names vLLM 0.32 reports
    assert w.missing == ()
    assert m.after.histograms[TTFT].count - m.before.histograms[TTFT].count == REQUESTS
    assert m.after.histograms[ITL].count - m.before.histograms[ITL].count == REQUESTS * (MAX_TOKENS - 1)
    assert m.buckets(TTFT)[1][-1] == REQUESTS and m.buckets(ITL)[1][-1] == REQUESTS * (MAX_TOKENS - 1)
    assert w.rps is not None and w.rps > 0 and (w.queue_depth, w.running) == (0, 0)
    # KV-cache usage: a number in [0, 1]
    assert w.kv_cache_usage is not None and 0.0 <= w.kv_cache_usage <= 1.0
    for name, read in ((TTFT, w.ttft_p99_ms), (ITL, w.tpot_p99_ms)):
        lo, hi, value = m.server_quantile(name, 0.99)
        assert read is not None and lo * 1000 <= read <= hi * 1000, (name, lo, hi, m.figures())
        assert read == pytest.approx(value * 1000, rel=1e-9), (name, value, m.figures())
    bounds, server = m.buckets(TTFT)
    client = [sum(t <= b for t in c.ttft) for b in bounds]
    assert all(s >= n for s, n in zip(server, client)), (bounds, server, client)

    # KV-cache usage read while requests hold blocks: above 0
    busy = busy_windows(vllm_server, names, keep)
    assert busy and all(b.kv_cache_usage is not None and 0.0 < b.kv_cache_usage <= 1.0 for b in busy), busy

    # what the agent publishes for the window decodes and satisfies the schema
    recs = telemetry_records(
        ts=time.time(),
        node="n",
        gpus=["n/0"],
        pool="serving",
        slo=(1000.0, 100.0),
        run_id="r",
        seq=0,
        util=[0.5],
        mem_total=1 << 30,
        mem_used=[1 << 29],
        rollout_mem=[0],
        ttft_ms=[w.ttft_p99_ms],
        tpot_ms=[w.tpot_p99_ms],
        rps=[w.rps],
        queue=[w.queue_depth],
        kv_cache_usage=[busy[0].kv_cache_usage],
    )
    raw = json.loads(recs[0][0])
    jsonschema.validate(raw, json.loads(SCHEMA.read_text()))
    ev = Telemetry.from_dict(raw)
    assert ev.kv_cache_usage == busy[0].kv_cache_usage and ev.latency_ms.tpot_p99 == w.tpot_p99_ms
