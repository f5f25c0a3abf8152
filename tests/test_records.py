"""rose.contract.records: a heartbeat and a trajectory survive their Redis field dicts (as
redis-py returns them, bytes or str), a malformed field dict raises one ValueError naming the
field, and the registry reads a real Redis as the readers need it (an unreadable heartbeat is
no heartbeat)."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rose.contract.records import (
    HEARTBEAT_FRESH_S,
    NO_VERSION,
    Heartbeat,
    Trajectory,
    WorkerRegistry,
)

text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
counts = st.integers(0, 2**53)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)

heartbeats = st.builds(
    Heartbeat,
    worker_id=text,
    state=st.sampled_from(["running", "paused", "draining", "stopped"]),
    ts=finite,
    version=st.integers(-1, 2**31),
    gpu=text,
    job=text,
    dedicated=st.booleans(),
    pid=counts,
    active=counts,
    free_slots=counts,
    tokens=counts,
    tokens_interrupted=counts,
    engine=text,
    engine_library=text,
    step_ms_p50=st.none() | finite,
    step_ms_p99=st.none() | finite,
    step_ms_n=counts,
)


def as_redis(fields: dict, decoded: bool) -> dict:
    """The hash as HGETALL returns it: every value as redis-py encodes it (repr of a float, str
    of an int), as bytes unless the client decodes replies."""

    def enc(v) -> str:
        return repr(v) if isinstance(v, float) else str(v)

    if decoded:
        return {k: enc(v) for k, v in fields.items()}
    return {k.encode(): enc(v).encode() for k, v in fields.items()}


@given(heartbeats, st.booleans())
def test_a_heartbeat_survives_its_hash(hb: Heartbeat, decoded: bool) -> None:
    assert Heartbeat.from_fields(as_redis(hb.to_fields(), decoded)) == hb


@given(st.dictionaries(text | st.binary(max_size=10), text | st.binary(max_size=10) | counts, max_size=8))
def test_any_hash_reads_as_a_heartbeat_or_a_value_error_naming_a_field(f: dict) -> None:
    try:
        hb = Heartbeat.from_fields(f)
    except ValueError as e:
        assert str(e).split(":")[0] in {"heartbeat"} | {k for k in Heartbeat.__dataclass_fields__}
    else:
        assert isinstance(hb.state, str) and isinstance(hb.ts, float) and isinstance(hb.version, int)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({b"ts": b"1"}, "heartbeat: missing field 'state'"),
        ({b"state": b"running"}, "heartbeat: missing field 'ts'"),
        ({b"state": b"running", b"ts": b"soon"}, "ts: 'soon' is not a number"),
        ({b"state": b"running", b"ts": b"1", b"version": b"inf"}, "version: 'inf' is not a whole number"),
    ],
)
def test_a_malformed_heartbeat_names_its_field(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        Heartbeat.from_fields(fields)


def test_a_missing_version_is_no_version_and_never_fresh_past_the_bound() -> None:
    hb = Heartbeat.from_fields({"state": "paused", "ts": "100"})
    assert hb.version == NO_VERSION and hb.step_ms_p50 is None and not hb.dedicated
    assert hb.live(100 + HEARTBEAT_FRESH_S - 0.01) and not hb.running(100)
    assert not hb.live(100 + HEARTBEAT_FRESH_S)
    assert replace(hb, state="running").running(100) and not replace(hb, state="stopped").live(100)


json_ints = st.integers(-(2**63), 2**64 - 1)  # orjson's range (token ids, counts)


@given(text, st.dictionaries(text, json_ints | text | st.lists(json_ints, max_size=3), max_size=5), st.booleans())
def test_a_trajectory_survives_its_stream_entry(task_id: str, body: dict, decoded: bool) -> None:
    f = Trajectory(task_id, body).to_fields()
    raw = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.items()}
    if not decoded:
        raw = {k.encode(): v.encode() for k, v in raw.items()}
    assert Trajectory.from_fields(raw) == Trajectory(task_id, body)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({b"task_id": b"t"}, "trajectory: missing field 'trajectory'"),
        ({b"task_id": b"t", b"trajectory": b"{not json"}, "trajectory: not JSON"),
        ({b"task_id": b"t", b"trajectory": b"[1, 2]"}, "trajectory: a JSON list, not an object"),
    ],
)
def test_a_malformed_trajectory_names_what_is_wrong(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}"):
        Trajectory.from_fields(fields)


@given(st.dictionaries(st.binary(max_size=12), st.binary(max_size=12), max_size=4))
def test_any_stream_entry_reads_as_a_trajectory_or_a_value_error(f: dict) -> None:
    try:
        t = Trajectory.from_fields(f)
    except ValueError as e:
        assert str(e).startswith("trajectory: ")
    else:
        assert isinstance(t.body, dict) and isinstance(t.task_id, str)


# -- the registry, on the real Redis -----------------------------------------------------------


@pytest.fixture
def registry(redis_client, cfg):
    """A job's registry under the test's own key prefix (redis_client deletes its keys)."""
    return WorkerRegistry(redis_client, cfg.redis.key, cfg.redis.key("tasks", "records", "workers"))


def test_the_registry_reads_what_a_worker_beats_and_skips_what_it_cannot_read(registry, redis_client) -> None:
    now = time.time()
    tag = uuid.uuid4().hex[:8]
    ids = [f"rec-{tag}-{i}" for i in range(4)]
    redis_client.sadd(registry.members, *ids)
    registry.beat(Heartbeat(ids[0], "running", now, version=3, gpu="g0", dedicated=True))
    registry.beat(Heartbeat(ids[1], "paused", now, version=5))
    registry.beat(Heartbeat(ids[2], "running", now - 2 * HEARTBEAT_FRESH_S, version=9))  # gone
    redis_client.hset(registry.key(ids[3]), mapping={"state": "running", "ts": "later"})  # unreadable
    assert registry.read(ids[0]) == Heartbeat(ids[0], "running", now, version=3, gpu="g0", dedicated=True)
    assert registry.read(ids[3]) is None and registry.read("never-beat") is None
    assert sorted(registry.heartbeats()) == ids[:3]
    assert registry.running() == [ids[0]]
    assert registry.running(min_version=4) == []
    assert 0 < redis_client.ttl(registry.key(ids[0])) <= 60
