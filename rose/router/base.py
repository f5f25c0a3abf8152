"""The small interface the executor's replica path drives, whatever the router is."""

from __future__ import annotations

from typing import Protocol


class RouterError(RuntimeError):
    """The router did not do what was asked; the message names the router and what to check."""


class Router(Protocol):
    def remove(self, replica: str) -> None:
        """New requests stop going to `replica`; its requests in flight run to their end.
        Removing a replica already out is a no-op."""

    def readmit(self, replica: str) -> None:
        """`replica` takes new requests again; readmitting one already serving is a no-op."""

    def serving(self) -> frozenset[str]:
        """The replicas the router sends new requests to now."""

    def in_flight(self, replica: str) -> int | None:
        """Requests the router has in flight on `replica` (also once removed); None where the
        router cannot tell, and the caller reads the engine's own count instead."""


def replica_url(url: str) -> str:
    """The one spelling of a replica's URL: vllm-router 0.1.17 joins `/health` to what it is
    given, so `http://h:p/` would be health-checked at `//health` (a 404) and never admitted."""
    return url.strip().rstrip("/")
