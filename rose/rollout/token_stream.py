"""Tokens of a streaming task published as they are made: the worker appends chunks
`{turn, index, tokens, versions, logprobs, worker}` (index: the first token's position in the
turn's action; tokens, versions and the sampled tokens' log-probabilities JSON lists, logprobs
empty when the engine did not give one for every token of the chunk) to the task's token stream (`TaskQueue.token_stream`),
a reader (the gateway) follows it with XREAD.

Batched: a sequence's tokens are buffered and flushed, for all sequences in one pipeline, when
the oldest buffered token has waited `flush_ms` or `flush_steps` decode steps have passed, and
at once for a sequence's first buffered chunk on this worker (so the first token is not held
back) and before the episode leaves the worker (finished, moved or requeued). A continuation
keeps the task id, so the next worker appends to the same stream from the next index. Each
stream is capped (`MAXLEN ~`) and expires `ttl_s` after its last append, so an abandoned one
goes away. The gateway ends a stream with an entry holding only `end` when the task's result is
in (rose.gateway.dispatch), which is no chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson

MAX_CHUNKS = 4096  # entries a token stream keeps (approximately); a reader that fell behind fills in from the result
TTL_S = 300


@dataclass
class _Pending:
    key: str
    turn: int
    index: int
    tokens: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    since: float = 0.0


class TokenStreamer:
    """Buffers streaming sequences' tokens and appends them in batches (see the module doc)."""

    def __init__(self, r, worker: str, flush_ms: float = 50.0, flush_steps: int = 8, ttl_s: int = TTL_S):
        self.r, self.worker = r, worker
        self.flush_s, self.flush_steps, self.ttl_s = flush_ms / 1000, flush_steps, ttl_s
        self._pending: dict[str, _Pending] = {}  # sequence id -> its unsent tokens
        self._started: set[str] = set()  # sequences that have sent a chunk from this worker
        self._steps = 0
        self.flushes = 0  # Redis round trips made
        self.chunks = 0  # chunks appended

    def add(
        self,
        seq: str,
        key: str,
        turn: int,
        index: int,
        tokens: list[int],
        versions: list[int],
        now: float,
        logprob: float | None = None,
    ) -> None:
        """Tokens `index`.. of turn `turn` of sequence `seq`, to go to stream `key`; `logprob`:
        the log-probability of a single token (None: not known)."""
        if not tokens:
            return
        p = self._pending.get(seq)
        if p is not None and (p.turn != turn or p.index + len(p.tokens) != index):
            self.flush()
            p = None
        if p is None:
            p = self._pending[seq] = _Pending(key, turn, index, since=now)
        p.tokens += tokens
        p.versions += versions
        p.logprobs += [logprob] if len(tokens) == 1 else [None] * len(tokens)

    def step(self, now: float) -> None:
        """A decode step ended: flush what is due."""
        self._steps += 1
        due = self._steps >= self.flush_steps or any(
            now - p.since >= self.flush_s or seq not in self._started for seq, p in self._pending.items()
        )
        if due:
            self.flush()

    def finish(self, seq: str) -> None:
        """The sequence leaves this worker: send what it has left."""
        if seq in self._pending:
            self.flush()
        self._started.discard(seq)

    def flush(self) -> None:
        """Append every buffered chunk: one pipeline, one round trip."""
        if not self._pending:
            return
        pipe = self.r.pipeline(transaction=False)
        for p in self._pending.values():
            pipe.xadd(
                p.key,
                {
                    "turn": p.turn,
                    "index": p.index,
                    "tokens": orjson.dumps(p.tokens),
                    "versions": orjson.dumps(p.versions),
                    "logprobs": orjson.dumps(p.logprobs if None not in p.logprobs else []),
                    "worker": self.worker,
                },
                maxlen=MAX_CHUNKS,
                approximate=True,
            )
            pipe.expire(p.key, self.ttl_s)
        pipe.execute()
        self._started.update(self._pending)
        self.chunks += len(self._pending)
        self.flushes += 1
        self._pending.clear()
        self._steps = 0
