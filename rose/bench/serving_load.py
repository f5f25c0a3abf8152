"""A steady load of streamed completions through a serving endpoint (a router, or one engine),
every answer recorded and every failure counted: the serving side of the replica-lease bench
(`rose.bench.replica`) and of the replica lease's end-to-end test (tests/test_replica_e2e.py).

A failure is an error, a status other than 200, fewer tokens than asked, or no end of stream.
`rate_per_s` and `phase` may change while the load runs: the next request is sent at the new
rate, and each request is recorded with the phase it was sent in."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor


@dataclasses.dataclass(frozen=True)
class Answer:
    phase: str
    ok: bool
    ttft_s: float
    tpot_s: float
    error: str = ""


class Load:
    """Streamed completions of `max_tokens` tokens (`ignore_eos`) on `prompt_tokens`-id prompts
    to `url` at `rate_per_s`, each from a thread of a pool of `threads`."""

    def __init__(
        self,
        url: str,
        model: str,
        vocab: int,
        *,
        rate_per_s: float,
        max_tokens: int,
        prompt_tokens: int,
        threads: int,
        timeout_s: float,
    ):
        import httpx

        self.url, self.model, self.vocab = url, model, vocab
        self.rate_per_s, self.max_tokens, self.prompt_tokens = rate_per_s, max_tokens, prompt_tokens
        self.phase = "warm-up"
        self.answers: list[Answer] = []
        self._http = httpx.Client(timeout=timeout_s)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="serving-load")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="serving-load-rate")

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self._pool.shutdown(wait=True)
        self._http.close()

    def _run(self) -> None:
        due, k = time.monotonic(), 0
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            self._pool.submit(self._one, k, self.phase)
            k += 1
            due += 1.0 / self.rate_per_s

    def _one(self, k: int, phase: str) -> None:
        prompt = [1 + (k * 7 + i * 13) % (self.vocab - 1) for i in range(self.prompt_tokens)]
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "stream": True}
        body |= {"ignore_eos": True, "return_token_ids": True}
        t0 = time.monotonic()
        first = last = 0.0
        n, done = 0, False
        try:
            with self._http.stream("POST", self.url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"status {r.status_code}")
                for line in r.iter_lines():
                    if line.strip() == "data: [DONE]":
                        done = True
                    elif line.startswith("data:"):
                        got = sum(len(c.get("token_ids") or ()) for c in json.loads(line[5:])["choices"])
                        if got:
                            last = time.monotonic() - t0
                            first = first or last
                            n += got
            if n != self.max_tokens or not done:
                raise RuntimeError(f"{n} of {self.max_tokens} tokens, end of stream {'seen' if done else 'missing'}")
        except Exception as e:  # every failure counts, whatever it is
            self.answers.append(Answer(phase, False, 0.0, 0.0, f"{type(e).__name__}: {e}"[:200]))
            return
        self.answers.append(Answer(phase, True, first, (last - first) / (n - 1) if n > 1 else 0.0))

    def failed(self) -> list[Answer]:
        return [a for a in list(self.answers) if not a.ok]

    def attainment(self, phase: str, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
        got = [a for a in list(self.answers) if a.phase == phase]
        met = sum(a.ok and a.ttft_s * 1e3 <= slo_ttft_ms and a.tpot_s * 1e3 <= slo_tpot_ms for a in got)
        return {"fraction": round(met / len(got), 4) if got else None, "n": len(got)}


def answers_directly(url: str, model: str, timeout_s: float) -> bool:
    """A one-token completion sent straight to the replica (not through the router) is answered."""
    import httpx

    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 1, "ignore_eos": True}
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=timeout_s)
        return r.status_code == 200 and bool(r.json().get("choices"))
    except Exception:  # not answering yet, whatever the reason
        return False
