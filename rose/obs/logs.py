"""Structured JSON logs (structlog) that carry the current trace_id/span_id."""

from __future__ import annotations

import json as stdlib_json
import logging
import sys

import orjson
import structlog

from rose.obs.tracing import trace_ids


def _add_trace_ids(_logger, _name, event_dict):
    event_dict.update(trace_ids())
    return event_dict


def _dumps(obj, default=str, **_kw) -> str:
    """orjson for log lines: the stdlib encoder cost more than a decision on the scheduler's
    hot path. Anything it cannot encode falls back to structlog's `default` (a repr); what
    orjson refuses outright (an integer beyond 64 bits) goes through the stdlib encoder, so a
    log call never raises."""
    try:
        return orjson.dumps(obj, default=default, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY).decode()
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return stdlib_json.dumps(obj, default=default)


def setup_logging(level: str = "INFO", json: bool = True, stream=None) -> None:
    """Lines go to `stream` (default: standard error), each in one write with its newline. An
    executor's workers and their engines share its standard error; under PYTHONUNBUFFERED (as in
    most containers) a line written as text and then newline, as `print` does, lets a worker's
    output land between the two, and the line no longer parses."""
    logging.basicConfig(level=level, stream=sys.stderr, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_trace_ids,
            structlog.processors.JSONRenderer(serializer=_dumps) if json else structlog.dev.ConsoleRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.WriteLoggerFactory(file=stream or sys.stderr),
        cache_logger_on_first_use=True,
    )


def get_logger(name: str = "rose", **bind):
    return structlog.get_logger(name).bind(**bind)
