"""Log lines: one JSON object each, carrying the current trace ids, whatever the values."""

import orjson

from rose.obs.logs import _dumps, get_logger, setup_logging
from rose.obs.tracing import ensure_provider, tracer


def test_a_log_line_is_json_with_the_trace_ids_of_the_current_span():
    import io

    import numpy as np

    buf = io.StringIO()
    setup_logging(stream=buf)
    try:
        ensure_provider()
        with tracer("t").start_as_current_span("s") as span:
            get_logger("rose.test", instance="i").info(
                "lease.decision", gpu="g/0", share=np.float32(0.5), by_epoch={1: "a"}, obj=object()
            )
    finally:
        setup_logging()  # back to standard error for every later logger
    line = orjson.loads(buf.getvalue().strip().splitlines()[-1])
    assert line["event"] == "lease.decision" and line["instance"] == "i" and line["share"] == 0.5
    assert line["by_epoch"] == {"1": "a"} and line["obj"].startswith("<object")
    assert line["trace_id"] == format(span.get_span_context().trace_id, "032x")


def test_a_log_line_and_its_newline_are_one_write():
    """Workers share the executor's standard error: a line written in two parts (text, then
    newline) can have a worker's output land between them when that stream is unbuffered."""

    class Writes:
        def __init__(self):
            self.calls: list[str] = []

        def write(self, s: str) -> int:
            self.calls.append(s)
            return len(s)

        def flush(self) -> None:
            pass

    out = Writes()
    setup_logging(stream=out)
    try:
        for i in range(3):
            get_logger("rose.test").info("worker.started", gpu=f"sim/{i}")
    finally:
        setup_logging()
    assert len(out.calls) == 3 and all(c.endswith("\n") and c.count("\n") == 1 for c in out.calls)
    assert [orjson.loads(c)["gpu"] for c in out.calls] == ["sim/0", "sim/1", "sim/2"]


def test_what_orjson_refuses_still_encodes():
    """An integer beyond 64 bits: the stdlib encoder takes over rather than the log call raising."""
    assert orjson.loads(_dumps({"n": 2**70, "m": [1.5]})) == {"n": 2**70, "m": [1.5]}
