"""Started while no broker answers, every ROSE process says so in one line that names the
bootstrap and what to do, keeps librdkafka's own log to a trickle, and keeps retrying."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from rose.stack import free_port
from tests.conftest import TRACES
from tests.processes import terminate_all

WITHIN_S = 15.0


def _librdkafka_lines(lines: list[str]) -> list[str]:
    """librdkafka's own lines: its stderr format (`%3|…|FAIL|…`) or routed through ROSE's log."""
    return [ln for ln in lines if ln.startswith("%") or '"kafka.client_log"' in ln]


def _events(lines: list[str], name: str) -> list[dict]:
    out = []
    for ln in lines:
        if ln.startswith("{"):
            try:
                d = json.loads(ln)
            except ValueError:
                continue
            if d.get("event") == name:
                out.append(d)
    return out


def test_every_process_says_once_that_kafka_is_unreachable_and_keeps_retrying(tmp_path):
    trace = TRACES / "azure_llm2023_conv.csv"
    if not trace.is_file():
        pytest.fail(f"trace not found at {trace}; set ROSE_TRACES to the shared traces folder")
    bootstrap = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "ROSE_KAFKA_BOOTSTRAP": bootstrap}
    for k in [k for k in env if k.startswith("ROSE_LIBRDKAFKA__")]:
        del env[k]  # librdkafka's log as it comes by default
    argvs = {
        "scheduler": ["scheduler", "--instance", "unreachable"],
        "executor": ["executor", "--simulate", "2", "--no-guard"],
        "agent": ["agent", "--simulate", str(trace), "--gpus", "2"],
    }
    procs: dict[str, subprocess.Popen] = {}
    errs = {name: tmp_path / f"{name}.err" for name in argvs}
    try:
        t0 = time.monotonic()
        for name, argv in argvs.items():
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "rose", *argv], env=env, stdout=subprocess.DEVNULL, stderr=open(errs[name], "wb")
            )
        lines: dict[str, list[str]] = {}
        while time.monotonic() - t0 < WITHIN_S:
            lines = {n: e.read_text(errors="replace").splitlines() for n, e in errs.items()}
            if all(_events(ls, "kafka.unreachable") for ls in lines.values()):
                break
            time.sleep(0.5)
        said_s = time.monotonic() - t0
        time.sleep(max(0.0, WITHIN_S - said_s))  # the rest of the window: no second line, no flood
        lines = {n: e.read_text(errors="replace").splitlines() for n, e in errs.items()}
        for name, p in procs.items():
            ls = lines[name]
            said = _events(ls, "kafka.unreachable")
            assert len(said) == 1, (name, ls[-20:])
            assert said[0]["bootstrap"] == bootstrap, said[0]
            assert "rose stack up" in said[0]["fix"] and "ROSE_KAFKA_BOOTSTRAP" in said[0]["fix"], said[0]
            noise = _librdkafka_lines(ls)
            assert len(noise) < 20, (name, len(noise), noise[:5])
            assert p.poll() is None, f"{name} exited ({p.returncode}) instead of retrying: {ls[-10:]}"
            print(
                f"\n[unreachable] {name}: said so once within {said_s:.1f}s; librdkafka lines {len(noise)}; "
                f"stderr lines {len(ls)}"
            )
    finally:
        terminate_all(procs, wait_s=15)


def test_each_trouble_is_one_line_per_period_with_what_was_left_out(monkeypatch):
    import time as _time

    from rose.kafka import base
    from rose.kafka.base import KafkaError

    got: list[tuple[str, str, dict]] = []

    class Rec:
        def __getattr__(self, level):
            return lambda event, **kw: got.append((level, event, kw))

    monkeypatch.setattr(base, "_log", Rec)
    for name in ("_unreachable_every", "_errors_every", "_lines_every"):
        monkeypatch.setattr(base, name, base._Every(0.2))
    on_error = base.error_callback("10.0.0.1:9092")
    for _ in range(5):
        on_error(KafkaError(KafkaError._TRANSPORT, "10.0.0.1:9092/bootstrap: Connection refused"))
        on_error(KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))
        on_error(KafkaError(KafkaError._MSG_TIMED_OUT, "timed out"))
    log = base.LibrdkafkaLog()
    for i in range(100):
        log.log(40, "%s [%s] %s", "FAIL", "rdkafka#producer-1", f"Connect failed (after {i}ms)")
    log.log(30, "%s [%s] %s", "REQTMOUT", "rdkafka#consumer-2", "timed out")
    events = [(lv, ev) for lv, ev, _ in got]
    assert events == [
        ("warning", "kafka.unreachable"),
        ("warning", "kafka.error"),
        ("error", "kafka.client_log"),
        ("warning", "kafka.client_log"),
    ], events
    assert got[0][2]["bootstrap"] == "10.0.0.1:9092" and "rose stack up" in got[0][2]["fix"]
    assert got[2][2]["facility"] == "FAIL" and "Connect failed (after 0ms)" in got[2][2]["message"]
    _time.sleep(0.25)  # the period is over: the next line says how many like it were left out
    log.log(40, "%s [%s] %s", "FAIL", "rdkafka#producer-1", "Connect failed")
    assert got[-1][1] == "kafka.client_log" and got[-1][2]["left_out"] == 99
    assert base.report_unreachable("10.0.0.1:9092") is True and got[-1][1] == "kafka.unreachable"
    on_error(KafkaError(KafkaError._FENCED, "fenced", fatal=True))  # fatal: always said
    on_error(KafkaError(KafkaError._FENCED, "fenced", fatal=True))
    assert [ev for lv, ev, kw in got if kw.get("fatal")] == ["kafka.error", "kafka.error"]


def test_every_client_gets_the_log_router_and_error_callback_unless_it_brings_its_own(base_cfg):
    import dataclasses

    from rose.kafka.base import LibrdkafkaLog, client_conf

    conf = client_conf(base_cfg.kafka)
    assert isinstance(conf["logger"], LibrdkafkaLog) and callable(conf["error_cb"])
    own = client_conf(base_cfg.kafka, error_cb=print, logger="mine")
    assert own["error_cb"] is print and own["logger"] == "mine"
    debug = dataclasses.replace(base_cfg.kafka, librdkafka={**base_cfg.kafka.librdkafka, "debug": "broker"})
    assert "logger" not in client_conf(debug)  # librdkafka's debug output stays whole, on stderr


def test_wait_for_broker_waits_until_stopped_or_its_timeout(base_cfg):
    import dataclasses
    import threading

    from rose.kafka.admin import wait_for_broker

    dead = dataclasses.replace(base_cfg.kafka, bootstrap=f"127.0.0.1:{free_port()}")
    # one round: a metadata request (2 s timeout) and the 0.2 s wait; slack for a loaded machine
    one_round_s, slack_s = 2.0 + 0.2, 2.0
    stop = threading.Event()
    stopped_at: list[float] = []
    returned: list = []  # the result, whether the stop was set then, and when

    def set_stop() -> None:
        stopped_at.append(time.monotonic())
        stop.set()

    def call() -> None:
        result = wait_for_broker(dead, timeout_s=None, stop=stop)
        returned.extend([result, stop.is_set(), time.monotonic()])

    waiter = threading.Thread(target=call, daemon=True)
    waiter.start()
    threading.Timer(1.0, set_stop).start()
    assert stop.wait(30)
    waiter.join(one_round_s + slack_s)
    assert not waiter.is_alive(), f"still waiting {one_round_s + slack_s}s after its stop was set"
    result, was_stopped, returned_at = returned
    assert result is False and was_stopped, "returned before its stop was set"
    assert stopped_at[0] <= returned_at < stopped_at[0] + one_round_s + slack_s, (
        f"returned {returned_at - stopped_at[0]:.2f}s after its stop was set"
    )
    with pytest.raises(TimeoutError, match=dead.bootstrap):
        wait_for_broker(dead, timeout_s=1.0)
