"""A pause flag in shared memory: the executor (or its local fast guard) raises it and the
rollout worker sees it at its next decode step, with no network hop.

Layout (72 bytes, little endian, each field naturally aligned so a store is one machine
write): state u8 @0 | assignment u32 @4 | heartbeat u64 @8 | paused_seen_ns i64 @16 |
set_ns i64 @24 | steps u64 @32 | yield_ppm u32 @40 | version i64 @48 | ready_ns i64 @56 |
first_token_ns i64 @64.
`yield_ppm` is the lease's compute share as the part of the time the worker must leave idle,
in millionths (0: the whole share, a fresh flag; 1,000,000: share 0, paused): the executor
sets it on `throttle`, the worker keeps the duty cycle between its decode steps.
`set_ns` is when the flag last changed, `paused_seen_ns` when the worker last observed
PAUSE or STOP (both CLOCK_MONOTONIC, which is one clock for every process on the host),
so `paused_seen_ns - set_ns` is the flag-raised → worker-paused latency.
The heartbeat counts the worker's loop iterations (paused or not): a stalled worker stops
counting. `steps` counts decode steps only: rollout progress, zero while paused.
`first_token_ns` is when the worker last produced its first token after starting or after a
pause (so `first_token_ns - set_ns` of a resume is resume → first token); `version` is the
policy version it has applied.

A warm worker (the executor's pool, rose.executor.warm_pool) waits, started and paused, for a
lease: it sets `ready_ns` once its model is built and its weights loaded, and polls `assignment`;
the executor writes the lease (`rose.rollout.launcher.LeaseRecord`) next to the flag, then bumps
the counter.
"""

from __future__ import annotations

import struct
import time
from multiprocessing import resource_tracker, shared_memory

RUN = 0
PAUSE = 1
STOP = 2
STATES = (RUN, PAUSE, STOP)

SIZE = 72
_STATE, _BEAT, _SEEN, _SET, _STEPS, _YIELD = 0, 8, 16, 24, 32, 40
_ASSIGN, _VERSION, _READY, _TOKEN = 4, 48, 56, 64
_PPM = 1_000_000


class PauseFlag:
    """`PauseFlag(name, create=True)` by the owner (executor); `PauseFlag(name)` by the worker."""

    def __init__(self, name: str, create: bool = False):
        self.name = name
        self.created = create
        if create:
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=SIZE)
            buf = self._shm.buf
            assert buf is not None  # a fresh segment is open
            buf[:SIZE] = bytes(SIZE)
        else:
            self._shm = shared_memory.SharedMemory(name=name, create=False)
            # An attaching process must not unlink the segment at exit: the owner does.
            try:
                # _name (with its leading "/") is what the tracker registered; typeshed leaves it out
                resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
            except Exception:  # pragma: no cover - tracker absent or already gone
                pass
        self._buf: memoryview | None = self._shm.buf

    def _mem(self) -> memoryview:
        """The flag's bytes; TypeError once closed (what using the released buffer raised)."""
        buf = self._buf
        if buf is None:
            raise TypeError(f"pause flag {self.name} is closed")
        return buf

    def set(self, state: int) -> None:
        if state not in STATES:
            raise ValueError(f"state: expected one of {STATES}, got {state!r}")
        buf = self._mem()
        struct.pack_into("<q", buf, _SET, time.monotonic_ns())
        buf[_STATE] = state

    def get(self) -> int:
        return self._mem()[_STATE]

    def set_share(self, share: float) -> None:
        """The compute share the worker may use, 0..1; 0 pauses it like PAUSE does."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"share: expected 0..1, got {share!r}")
        buf = self._mem()
        struct.pack_into("<q", buf, _SET, time.monotonic_ns())
        struct.pack_into("<I", buf, _YIELD, round((1.0 - share) * _PPM))

    @property
    def share(self) -> float:
        return 1.0 - struct.unpack_from("<I", self._mem(), _YIELD)[0] / _PPM

    def effective(self) -> int:
        """The state the worker obeys: PAUSE also while the share is 0."""
        buf = self._mem()
        st = buf[_STATE]
        if st == RUN and struct.unpack_from("<I", buf, _YIELD)[0] >= _PPM:
            return PAUSE
        return st

    # worker side -----------------------------------------------------------------------
    def beat(self) -> int:
        """Count one worker loop iteration; returns the effective state read in the same call."""
        buf = self._mem()
        n = struct.unpack_from("<Q", buf, _BEAT)[0] + 1
        struct.pack_into("<Q", buf, _BEAT, n & 0xFFFFFFFFFFFFFFFF)
        return self.effective()

    def count_steps(self, n: int = 1) -> None:
        """Count decode steps launched (the worker is the only writer)."""
        buf = self._mem()
        v = struct.unpack_from("<Q", buf, _STEPS)[0] + n
        struct.pack_into("<Q", buf, _STEPS, v & 0xFFFFFFFFFFFFFFFF)

    def mark_paused(self) -> None:
        """Record that the worker has observed PAUSE/STOP and launches no more work."""
        struct.pack_into("<q", self._mem(), _SEEN, time.monotonic_ns())

    def mark_first_token(self) -> None:
        """Record the first token produced since the worker started or was last paused."""
        struct.pack_into("<q", self._mem(), _TOKEN, time.monotonic_ns())

    def set_version(self, version: int) -> None:
        """The policy version the worker has applied."""
        struct.pack_into("<q", self._mem(), _VERSION, version)

    def mark_ready(self) -> None:
        """A warm worker is ready for a lease: imports done, model built, weights loaded."""
        struct.pack_into("<q", self._mem(), _READY, time.monotonic_ns())

    # owner side ------------------------------------------------------------------------
    def assign(self) -> int:
        """Tell a warm worker that its lease record is written; the new assignment number (the
        record carries it too, so the worker never acts on an older record)."""
        buf = self._mem()
        n = (struct.unpack_from("<I", buf, _ASSIGN)[0] + 1) & 0xFFFFFFFF
        struct.pack_into("<I", buf, _ASSIGN, n)
        return n

    # readers ---------------------------------------------------------------------------
    @property
    def heartbeat(self) -> int:
        return struct.unpack_from("<Q", self._mem(), _BEAT)[0]

    @property
    def steps(self) -> int:
        return struct.unpack_from("<Q", self._mem(), _STEPS)[0]

    @property
    def paused_seen_ns(self) -> int:
        return struct.unpack_from("<q", self._mem(), _SEEN)[0]

    @property
    def set_ns(self) -> int:
        return struct.unpack_from("<q", self._mem(), _SET)[0]

    @property
    def assignment(self) -> int:
        return struct.unpack_from("<I", self._mem(), _ASSIGN)[0]

    @property
    def version(self) -> int:
        return struct.unpack_from("<q", self._mem(), _VERSION)[0]

    @property
    def ready_ns(self) -> int:
        return struct.unpack_from("<q", self._mem(), _READY)[0]

    @property
    def first_token_ns(self) -> int:
        return struct.unpack_from("<q", self._mem(), _TOKEN)[0]

    def close(self) -> None:
        self._buf = None
        self._shm.close()

    def unlink(self) -> None:
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass

    def __enter__(self) -> PauseFlag:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
