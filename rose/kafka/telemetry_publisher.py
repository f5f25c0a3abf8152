"""Publishing telemetry without ever blocking the serving node.

An idempotent producer (rose.kafka.producer.make_producer: enable.idempotence, acks=all,
ordered per partition) with ``linger.ms`` = telemetry.linger_ms (5 ms: a period's batch of a
whole fleet leaves in one request, and an event waits at most 5 ms). Delivery reports come only
for failures (``delivery.report.only.error``), so the hot path pays no callback per event.

Bounded buffering: librdkafka's own queue is capped at `queue_max` messages; beyond it
events wait in a deque of at most `buffer_max` entries. When Kafka is unreachable both fill,
the deque drops its oldest entries (counted in `dropped`), and a warning is logged at most
once per `log_every_s`. `publish` and `tick` never wait on the network: they hand events to
librdkafka with `produce` (which raises BufferError when its queue is full instead of
blocking) and serve callbacks with `poll(0)`. When the broker returns librdkafka reconnects
by itself and the backlog drains, oldest first, so order per GPU is kept. A fatal producer
error (possible for idempotent producers after message timeouts) rebuilds the producer. That
no broker answers is said once (`kafka.unreachable`, rose.kafka.base), not on every error.

Each `publish` is a `send {topic}` span (PRODUCER, a child of the caller's span) whose context
the batch's records carry, unless the caller passes headers of its own.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

from rose.config import Config, KafkaConfig
from rose.kafka.base import CONNECTION_ERRORS, Headers, error_callback
from rose.obs import metrics
from rose.obs.logs import get_logger
from rose.obs.tracing import inject_headers, send_span, tracer

if TYPE_CHECKING:
    from confluent_kafka import KafkaError, Message, Producer

SENT = metrics.gauge("rose_agent_events_sent", "Telemetry events delivered or in flight to Kafka")
DROPPED = metrics.counter("rose_agent_events_dropped_total", "Telemetry events dropped (buffer full, oldest first)")
BUFFERED = metrics.gauge("rose_agent_events_buffered", "Telemetry events waiting for Kafka")


class TelemetryPublisher:
    @classmethod
    def for_config(cls, cfg: Config) -> TelemetryPublisher:
        """An agent's publisher: the telemetry topic of `cfg.kafka`, buffered and lingering as
        `cfg.telemetry` says."""
        tc = cfg.telemetry
        return cls(cfg.kafka, cfg.kafka.telemetry_topic, buffer_max=tc.buffer_max, linger_ms=tc.linger_ms)

    def __init__(
        self,
        kcfg: KafkaConfig,
        topic: str,
        *,
        buffer_max: int = 100_000,
        linger_ms: int = 5,
        queue_max: int = 20_000,
        message_timeout_ms: int = 120_000,
        log_every_s: float = 5.0,
        **overrides: Any,
    ):
        self.kcfg, self.topic = kcfg, topic
        self.buffer: deque[tuple[bytes, bytes, Headers | None, int]] = deque(maxlen=max(1, buffer_max))
        self.log_every_s = log_every_s
        self.log = get_logger("rose.agent.publisher", topic=topic)
        self.sent_to_client = 0  # handed to librdkafka
        self.failed = 0  # delivery failed (expired in librdkafka while the broker was away)
        self.dropped = 0  # evicted from the deque (oldest first)
        self._last_log = 0.0
        self._dropped_logged = 0
        self._fatal = False
        self._report = error_callback(kcfg.bootstrap)
        self._tracer = tracer("rose.agent")
        self._conf = {
            "linger.ms": linger_ms,
            "queue.buffering.max.messages": queue_max,
            "message.timeout.ms": message_timeout_ms,
            "delivery.report.only.error": True,
            "on_delivery": self._on_delivery,
            "error_cb": self._on_error,
            **overrides,
        }
        self.producer = self._make()

    def _make(self) -> Producer:
        from rose.kafka.producer import make_producer

        return make_producer(self.kcfg, **{k: v for k, v in self._conf.items()})

    # librdkafka callbacks (served inside poll/flush)
    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            self.failed += 1

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal():
            self._fatal = True
        if err.code() in CONNECTION_ERRORS and not err.fatal():
            self._report(err)
        else:
            self._maybe_log("kafka error", error=str(err))

    def _maybe_log(self, what: str, **kw: Any) -> None:
        now = time.monotonic()
        if now - self._last_log >= self.log_every_s:
            self._last_log = now
            self.log.warning(what, buffered=self.buffered, dropped=self.dropped, failed=self.failed, **kw)

    # ---- counters ---------------------------------------------------------------------
    @property
    def in_client(self) -> int:
        """Events librdkafka holds (queued or in flight)."""
        return len(self.producer)

    @property
    def buffered(self) -> int:
        return len(self.buffer) + self.in_client

    @property
    def sent(self) -> int:
        """Events the broker acknowledged (handed over, minus failed, minus still held)."""
        return max(0, self.sent_to_client - self.failed - self.in_client)

    def counters(self) -> dict[str, int]:
        return {"sent": self.sent, "dropped": self.dropped + self.failed, "buffered": self.buffered}

    # ---- the hot path -----------------------------------------------------------------
    def publish(self, items: list[tuple[bytes, bytes]], headers: Headers | None = None, ts_ms: int = 0) -> None:
        """Queue (value, key) pairs; never blocks. `ts_ms` (the event time) becomes the Kafka
        record timestamp; 0 lets the producer stamp its clock. Without `headers`, the records
        carry the context of this batch's `send` span."""
        if headers is None:
            with send_span(self._tracer, self.topic, batch=len(items)):
                self._queue(items, inject_headers(), ts_ms)
        else:
            self._queue(items, headers, ts_ms)

    def _queue(self, items: list[tuple[bytes, bytes]], headers: Headers | None, ts_ms: int) -> None:
        buf = self.buffer
        assert buf.maxlen is not None  # bounded in __init__
        room = buf.maxlen - len(buf)
        if len(items) > room:
            self.dropped += len(items) - room
            DROPPED.inc(len(items) - room)
        buf.extend((v, k, headers, ts_ms) for v, k in items)
        self.tick()

    def tick(self) -> None:
        """Move buffered events into librdkafka as far as it takes them; serve callbacks."""
        if self._fatal:
            self._rebuild()
        buf, produce, topic = self.buffer, self.producer.produce, self.topic
        try:
            while buf:
                v, k, h, ts = buf[0]
                # the stubs type headers as an invariant list of (str, str | bytes | None): ours, (str, bytes), fit
                produce(topic, value=v, key=k, headers=h, timestamp=ts)  # type: ignore[arg-type]
                buf.popleft()
                self.sent_to_client += 1
        except BufferError:
            self._maybe_log("kafka unreachable or slow; buffering telemetry")
        self.producer.poll(0)
        BUFFERED.set(len(buf))
        SENT.set(self.sent)
        if self.dropped + self.failed > self._dropped_logged:
            self._dropped_logged = self.dropped + self.failed
            self._maybe_log("telemetry dropped")

    def _rebuild(self) -> None:
        self._fatal = False
        self.log.warning("fatal producer error; rebuilding the producer")
        try:
            self.producer.flush(0)
        except Exception:  # noqa: BLE001 - the old producer is being discarded anyway
            pass
        self.failed += len(self.producer)
        self.producer = self._make()

    def flush(self, timeout_s: float = 5.0) -> int:
        """Deliver what can be delivered within `timeout_s`; returns events left undelivered."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.tick()
            left = self.producer.flush(min(0.2, max(0.0, deadline - time.monotonic())))
            if not self.buffer and left == 0:
                return 0
        return len(self.buffer) + len(self.producer)
