"""What every Kafka client ROSE builds shares: its configuration, and librdkafka's own log
and errors routed into ROSE's log.

librdkafka properties from the config (`[kafka.librdkafka]`) pass through untouched, so
`security.protocol`, `sasl.*` and `ssl.*` reach every client ROSE builds.

librdkafka logs every failed connection attempt of every client (hundreds of lines a minute
while the broker is down). Each client gets a `logger` that turns those lines into ROSE log
lines, at most one per (facility, level) per `LOG_EVERY_S`, with the count it left out, and an
`error_cb` that says once per `LOG_EVERY_S`, in one line, that the cluster cannot be reached
and what to do. A config that sets librdkafka's `debug` keeps librdkafka's own output whole.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, cast

from confluent_kafka import KafkaError, KafkaException, Message

from rose.config import KafkaConfig
from rose.obs.logs import get_logger

__all__ = [
    "CONNECTION_ERRORS",
    "Headers",
    "KafkaError",
    "KafkaException",
    "MAX_RECORD_BYTES",
    "UNREACHABLE_HINT",
    "client_conf",
    "error_callback",
    "message_headers",
    "report_unreachable",
]

Headers = list[tuple[str, bytes]]


def message_headers(msg: Message) -> list[tuple[str, bytes | None]]:
    """A consumed message's headers, [] when it has none. librdkafka gives a list of (name,
    bytes or None); the stubs' type also allows the dict form that produce() accepts."""
    return cast("list[tuple[str, bytes | None]]", msg.headers() or [])


MAX_RECORD_BYTES = 16 << 20  # max.message.bytes of ROSE's topics (rose.kafka.topics) and the local broker

LOG_EVERY_S = 30.0  # the longest silence between two lines about the same trouble

UNREACHABLE_HINT = (
    "start a local stack with `rose stack up`, or point ROSE_KAFKA_BOOTSTRAP (kafka.bootstrap) at your cluster"
)

# errors that mean no broker of the cluster answers (a single refused connection, _TRANSPORT,
# is already in librdkafka's own log line and is no news while one broker of several answers)
_UNREACHABLE = frozenset({KafkaError._ALL_BROKERS_DOWN, KafkaError._RESOLVE})
_QUIET = frozenset({KafkaError._TRANSPORT})
CONNECTION_ERRORS = _UNREACHABLE | _QUIET  # what `error_callback` reports itself, without repeating it

# confluent-kafka's Python-side settings, whose names keep their underscores
_PY_CALLBACKS = frozenset({"on_delivery", "error_cb", "stats_cb", "throttle_cb", "oauth_cb", "logger"})


def _log() -> Any:
    # looked up when used: a logger bound at import would keep the logging set-up of that moment
    return get_logger("rose.kafka")


class _Every:
    """Lets one event per key through every `period_s`; counts what it held back."""

    def __init__(self, period_s: float):
        self.period_s = period_s
        self._lock = threading.Lock()
        self._last: dict[Hashable, float] = {}
        self._held: dict[Hashable, int] = {}

    def allow(self, key: Hashable) -> int | None:
        """None: hold this one back; else how many were held back since the last let through."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.period_s:
                self._held[key] = self._held.get(key, 0) + 1
                return None
            self._last[key] = now
            return self._held.pop(key, 0)


_unreachable_every = _Every(LOG_EVERY_S)
_errors_every = _Every(LOG_EVERY_S)
_lines_every = _Every(LOG_EVERY_S)


def report_unreachable(bootstrap: str, error: object = "") -> bool:
    """Log `kafka.unreachable` for `bootstrap`, naming what to do, at most once per
    `LOG_EVERY_S` per process whichever client noticed; True when a line was written."""
    held = _unreachable_every.allow(bootstrap)
    if held is None:
        return False
    _log().warning(
        "kafka.unreachable", bootstrap=bootstrap, fix=UNREACHABLE_HINT, error=str(error) or None, retrying=True
    )
    return True


def error_callback(bootstrap: str) -> Callable[[KafkaError], None]:
    """The `error_cb` every client gets (served inside poll/consume/flush)."""

    def on_error(err: KafkaError) -> None:
        code = err.code()
        if code in _UNREACHABLE:
            report_unreachable(bootstrap, err.str())
        elif code in _QUIET and not err.fatal():
            return
        elif err.fatal():
            _log().error("kafka.error", bootstrap=bootstrap, code=err.name(), error=err.str(), fatal=True)
        elif (held := _errors_every.allow(code)) is not None:
            _log().warning("kafka.error", bootstrap=bootstrap, code=err.name(), error=err.str(), left_out=held)

    return on_error


class LibrdkafkaLog:
    """librdkafka's log lines as ROSE log lines (`kafka.client_log`), at most one per facility
    and level per `LOG_EVERY_S`, each with the number of like lines left out before it."""

    def log(self, level: int, fmt: str, *args: object) -> None:
        # confluent-kafka calls log(level, "%s [%s] %s", facility, client name, text)
        fac = args[0] if args else ""
        held = _lines_every.allow((fac, level))
        if held is None:
            return
        log = _log()
        emit = log.error if level >= logging.ERROR else log.warning if level >= logging.WARNING else log.info
        try:
            text = fmt % args if args else fmt
        except (TypeError, ValueError):
            text = " ".join(map(str, (fmt, *args)))
        emit("kafka.client_log", facility=fac, message=text, left_out=held)


_LIBRDKAFKA_LOG = LibrdkafkaLog()


def client_conf(kcfg: KafkaConfig, **overrides: Any) -> dict[str, Any]:
    """bootstrap + the user's librdkafka pass-through + the caller's overrides, with ROSE's
    `logger` and `error_cb` unless the caller or the config sets its own."""
    conf: dict[str, Any] = {"bootstrap.servers": kcfg.bootstrap, **kcfg.librdkafka}
    conf.update({k if k in _PY_CALLBACKS else k.replace("_", "."): v for k, v in overrides.items()})
    if "debug" not in conf:
        conf.setdefault("logger", _LIBRDKAFKA_LOG)
    conf.setdefault("error_cb", error_callback(conf["bootstrap.servers"]))
    return conf
