"""Bytes <-> events. One JSON object per Kafka value, encoded with orjson."""

from __future__ import annotations

from typing import Any, TypeVar, overload

import orjson

from rose.contract.events import EVENT_TYPES, Event, InvalidEvent

_E = TypeVar("_E", bound=Event)

MAX_VALUE_BYTES = 1 << 20  # 1 MiB: a telemetry or command value is < 1 KiB; more is hostile


def encode(event: Event) -> bytes:
    return orjson.dumps(event.to_dict())


@overload
def decode(value: bytes | None, expect: type[_E]) -> _E: ...
@overload
def decode(value: bytes | None, expect: None = None) -> Event: ...
def decode(value: bytes | None, expect: type[_E] | None = None) -> Event:
    """Decode one message value; raises InvalidEvent naming what is wrong.

    `expect` pins the type (a topic carries one schema); without it the `schema`
    field chooses.
    """
    if value is None:
        raise InvalidEvent("$", "empty value (tombstone)")
    d = load_object(value)
    if expect is None:
        schema = d.get("schema")
        found = EVENT_TYPES.get(schema) if isinstance(schema, str) else None
        if found is None:
            raise InvalidEvent("schema", f"unknown schema {schema!r}")
        return found.from_dict(d)
    return expect.from_dict(d)


def load_object(value: bytes) -> dict[str, Any]:
    """One JSON object from bytes (a message value, a log line); InvalidEvent otherwise."""
    if len(value) > MAX_VALUE_BYTES:
        raise InvalidEvent("$", f"value of {len(value)} bytes exceeds {MAX_VALUE_BYTES}")
    try:
        d = orjson.loads(value)
    except orjson.JSONDecodeError as e:
        raise InvalidEvent("$", f"invalid JSON: {e}") from None
    if not isinstance(d, dict):
        raise InvalidEvent("$", f"expected JSON object, got {type(d).__name__}")
    return d
