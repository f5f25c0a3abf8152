"""Admission: at most `max_inflight` turns on the task queue at once, at most `max_queue`
requests waiting for one of those places; the next request is refused at once (`Overloaded`,
429 with `Retry-After`), never left to time out. Places are handed to waiters first come,
first served. Runs on the gateway's event loop (not thread-safe)."""

from __future__ import annotations

import asyncio
import math
from collections import deque


class Overloaded(Exception):
    def __init__(self, retry_after_s: int, reason: str):
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class Admission:
    EWMA = 0.2  # weight of each finished turn in the mean turn time behind Retry-After

    def __init__(self, max_inflight: int, max_queue: int):
        self.max_inflight, self.max_queue = max_inflight, max_queue
        self.inflight = 0
        self._waiting: deque[asyncio.Future] = deque()
        self._turn_s = 1.0

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def retry_after_s(self) -> int:
        """Whole seconds until a place is likely free: the mean turn time, at least 1."""
        return max(1, math.ceil(self._turn_s))

    def observe(self, turn_s: float) -> None:
        self._turn_s += self.EWMA * (turn_s - self._turn_s)

    async def acquire(self, timeout_s: float) -> None:
        """A place for one turn; Overloaded when none is free and the queue is full, or none
        came within `timeout_s`. Every successful acquire is paired with one `release`."""
        if self.inflight < self.max_inflight and not self._waiting:
            self.inflight += 1
            return
        if len(self._waiting) >= self.max_queue:
            raise Overloaded(self.retry_after_s(), f"{self.inflight} turns in flight and {self.waiting} waiting")
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        try:
            await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            self._drop(fut)
            raise Overloaded(self.retry_after_s(), f"no place for the turn within {timeout_s:g}s") from None
        except BaseException:
            self._drop(fut)
            raise

    def _drop(self, fut: asyncio.Future) -> None:
        if fut.done() and not fut.cancelled():
            self.release()  # a place was handed over just as the waiter gave up: pass it on
        elif fut in self._waiting:
            self._waiting.remove(fut)

    def release(self) -> None:
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_result(None)  # the place goes to the waiter: inflight stays
                return
        self.inflight -= 1
