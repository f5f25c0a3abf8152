"""A TCP relay between the router and a vLLM server that can hold long replies.

The router counts a request in flight until the upstream reply ends, and it reads that reply
whether or not its own client does; so without a hold, "a stream still in flight on the worker"
lasts only as long as the engine takes to decode it, which differs from machine to machine, and
a test that drains a worker races the engine.
Put between them, the relay passes each reply's first bytes, then holds the rest until the test
releases it: the stream stays in flight at the router for exactly as long as the test needs, and
every byte still arrives, in order, afterwards."""

from __future__ import annotations

import json
import socket
import threading
import urllib.request


class Relay:
    """Listens on 127.0.0.1:`port` and relays each connection to `target`. Replies pass freely
    until `hold_replies_after(n)`: from then on each connection's reply passes `n` more bytes,
    then waits for `release()` (so small replies, such as health checks, still pass)."""

    def __init__(self, target: tuple[str, int]):
        self._target = target
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._cond = threading.Condition()
        self._limit: int | None = None
        self._generation = 0
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name=f"relay-{self.port}").start()

    def hold_replies_after(self, nbytes: int) -> None:
        with self._cond:
            self._limit, self._generation = nbytes, self._generation + 1
            self._cond.notify_all()

    def release(self) -> None:
        with self._cond:
            self._limit, self._generation = None, self._generation + 1
            self._cond.notify_all()

    def close(self) -> None:
        self.release()
        self._server.close()
        for s in list(self._sockets):
            s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
                upstream = socket.create_connection(self._target)
            except OSError:
                return
            self._sockets += [client, upstream]
            ends = threading.Barrier(2, action=lambda c=client, u=upstream: self._forget(c, u))
            threading.Thread(target=_then, args=(_pump, (client, upstream), ends), daemon=True).start()
            threading.Thread(target=_then, args=(self._pump_reply, (upstream, client), ends), daemon=True).start()

    def _forget(self, *conn: socket.socket) -> None:
        """Both directions of a connection ended: close it, so a long test holds no dead sockets."""
        for s in conn:
            s.close()
            if s in self._sockets:
                self._sockets.remove(s)

    def _room(self, generation: int, passed: int) -> tuple[int, int | None]:
        """Wait until this reply may pass bytes; (the generation counted from, bytes it may pass,
        None for any number)."""
        with self._cond:
            self._cond.wait_for(lambda: self._limit is None or self._generation != generation or passed < self._limit)
            if self._generation != generation:
                return self._generation, self._limit
            return generation, None if self._limit is None else self._limit - passed

    def _pump_reply(self, src: socket.socket, dst: socket.socket) -> None:
        generation, passed = self._generation, 0
        try:
            while data := src.recv(65536):
                view = memoryview(data)
                while view:
                    now, room = self._room(generation, passed)
                    if now != generation:
                        generation, passed = now, 0
                        continue
                    n = len(view) if room is None else min(room, len(view))
                    dst.sendall(view[:n])
                    passed, view = passed + n, view[n:]
        except OSError:
            pass
        _shut(dst)


def _then(pump, args: tuple, ends: threading.Barrier) -> None:
    pump(*args)
    try:
        ends.wait()
    except threading.BrokenBarrierError:
        pass


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    _shut(dst)


def _shut(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def stream_completion(url: str, model: str, max_tokens: int, first_tokens: threading.Event, out: dict) -> None:
    """A streaming completion through the router at `url`: sets `first_tokens` once 3 tokens came
    (or it ended), and leaves in `out` the tokens received, whether `[DONE]` came, and any error."""
    body = {
        "model": model,
        "prompt": [5, 6, 7],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    n, done = 0, False
    try:
        with urllib.request.urlopen(req, timeout=300) as r:  # noqa: S310 - local router
            for raw in r:
                line = raw.strip()
                if line == b"data: [DONE]":
                    done = True
                elif line.startswith(b"data:"):
                    n += sum(len(c.get("token_ids") or ()) for c in json.loads(line[5:])["choices"])
                    if n >= 3:
                        first_tokens.set()
    except OSError as e:
        out["error"] = repr(e)
    out.update(tokens=n, done=done)
    first_tokens.set()
