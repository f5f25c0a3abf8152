"""schemas/ is the single source of truth: the Python types must agree with it.

Agreement is checked three ways: the field sets match; every instance generated from a
schema decodes (modulo the documented cross-field rules); and for single-field mutations
of a valid event, the decoder rejects exactly when the reference validator does.
"""

import dataclasses
import json
import math
from pathlib import Path

import jsonschema
import orjson
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rose.contract.events import Command, InvalidEvent, LeaseState, Telemetry
from rose.contract.wire import MAX_VALUE_BYTES, decode, encode
from tests.examples import command_example, lease_state_example, telemetry_example

SCHEMAS = Path(__file__).resolve().parent.parent / "schemas"
TYPES = {"rose.telemetry.v1": Telemetry, "rose.command.v1": Command, "rose.lease_state.v1": LeaseState}
EXAMPLES = {Telemetry: telemetry_example, Command: command_example, LeaseState: lease_state_example}


def load(name):
    return json.loads((SCHEMAS / f"{name}.json").read_text())


def from_schema(schema: dict):
    """Instances of the small JSON Schema subset schemas/ uses (object, string, number,
    integer, enum, const, bounds)."""
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    t = schema["type"]
    if t == "object":
        props, required = schema["properties"], set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: from_schema(v) for k, v in props.items() if k in required},
            optional={k: from_schema(v) for k, v in props.items() if k not in required},
        )
    if t == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 20), 20))
    if t == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    lo = schema.get("minimum", schema.get("exclusiveMinimum"))
    return st.floats(
        lo, schema.get("maximum"), exclude_min="exclusiveMinimum" in schema, allow_nan=False, allow_infinity=False
    ) | st.integers(int(lo) + ("exclusiveMinimum" in schema), int(schema.get("maximum", 2**53)))


OPTIONAL = {typ: {f.name for f in dataclasses.fields(typ) if f.default is not dataclasses.MISSING} for typ in EXAMPLES}


def cross_field_ok(d) -> bool:
    if d.get("schema") == "rose.command.v1":
        return ("group_id" in d) == ("group_size" in d)  # the schema's dependentRequired
    if d.get("schema") != "rose.telemetry.v1":
        return True
    return d["mem_used_bytes"] <= d["mem_total_bytes"] and d["rollout_mem_bytes"] <= d["mem_used_bytes"]


@pytest.mark.parametrize("name,typ", TYPES.items())
def test_schema_fields_match_type(name, typ):
    schema = load(name)
    jsonschema.Draft202012Validator.check_schema(schema)
    fields = set(typ.__dataclass_fields__) | {"schema"}
    assert set(schema["required"]) == fields - OPTIONAL[typ]
    assert set(schema["properties"]) == fields
    assert schema["properties"]["schema"]["const"] == typ.schema


@pytest.mark.parametrize("name,typ", TYPES.items())
def test_examples_validate_against_schema_and_round_trip(name, typ):
    ev = EXAMPLES[typ]()
    jsonschema.validate(orjson.loads(encode(ev)), load(name))
    assert decode(encode(ev)) == ev
    assert decode(encode(ev), typ) == ev
    # the hand-written to_dict keeps dataclasses.asdict's keys, order and nesting (bytes on the wire)
    # (optional fields at their defaults stay off the wire)
    plain = {
        k: v for k, v in dataclasses.asdict(ev).items() if k in typ.__dataclass_fields__ and k not in OPTIONAL[typ]
    }
    assert encode(ev) == orjson.dumps({"schema": name, **plain})


def test_gang_fields_travel_only_on_gang_commands():
    plain = orjson.loads(encode(command_example()))
    assert "group_id" not in plain and "group_size" not in plain  # v1 bytes unchanged
    gang = command_example(group_id="node-1#g1", group_size=2)
    d = orjson.loads(encode(gang))
    assert (d["group_id"], d["group_size"]) == ("node-1#g1", 2)
    jsonschema.validate(d, load("rose.command.v1"))
    assert decode(encode(gang)) == gang
    del d["group_size"]
    with pytest.raises(InvalidEvent, match="group_size"):
        decode(orjson.dumps(d), Command)


@pytest.mark.parametrize("name", list(TYPES))
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_schema_instance_decodes(name, data):
    d = data.draw(from_schema(load(name)))
    assume(cross_field_ok(d))
    ev = decode(orjson.dumps(d))
    assert isinstance(ev, TYPES[name])
    # what decodes re-encodes to an instance the schema still accepts
    jsonschema.validate(orjson.loads(encode(ev)), load(name))


BAD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=5),
    st.just(""),
    st.lists(st.integers(-9, 9), max_size=2),
    st.just({}),
)


def _paths(d, prefix=()):
    for k, v in d.items():
        yield prefix + (k,)
        if isinstance(v, dict):
            yield from _paths(v, prefix + (k,))


# every example, plus events carrying the optional fields (so those fields are mutated too)
MUTATED = [(name, typ, EXAMPLES[typ]) for name, typ in TYPES.items()] + [
    ("rose.telemetry.v1", Telemetry, lambda: telemetry_example(kv_cache_usage=0.42)),
    ("rose.telemetry.v1", Telemetry, lambda: telemetry_example(replica="node-1/r0", serving_state="lent")),
    ("rose.command.v1", Command, lambda: command_example(lease_kind="replica", group_id="node-1/r0#2", group_size=2)),
    ("rose.lease_state.v1", LeaseState, lambda: lease_state_example(state="draining")),
]


@pytest.mark.parametrize("name,typ,example", MUTATED)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_decoder_rejects_exactly_what_the_schema_rejects(name, typ, example, data):
    d = orjson.loads(encode(example()))
    path = data.draw(st.sampled_from(sorted(_paths(d))))
    target = d
    for k in path[:-1]:
        target = target[k]
    if data.draw(st.booleans()):
        target[path[-1]] = data.draw(BAD_VALUES)
    else:
        del target[path[-1]]
    mem = ("mem_used_bytes", "mem_total_bytes", "rollout_mem_bytes")
    if all(isinstance(d.get(k), (int, float)) and not isinstance(d.get(k), bool) for k in mem):
        assume(cross_field_ok(d))  # the documented rules beyond JSON Schema
    schema_ok = jsonschema.Draft202012Validator(load(name)).is_valid(d)
    try:
        decode(orjson.dumps(d), typ)
        decoded_ok = True
    except InvalidEvent as e:
        decoded_ok = False
        assert (
            e.field == "$" or e.field.split(".")[0] == path[0] or e.field in ("mem_used_bytes", "rollout_mem_bytes")
        ), (e.field, path)
    assert decoded_ok == schema_ok, (path, d)


EDGES = [
    0,
    0.0,
    -0.0,
    -1,
    1,
    1.0,
    2.0,
    True,
    None,
    "",
    "x",
    "x" * 257,
    {},
    [],
    1e9,
    1e9 + 1,
    1e11 + 1,
    2**31,
    2**31 + 1,
    2**50,
    2**50 + 1,
    float(2**50),
    math.inf,
    -math.inf,
    math.nan,
]


def _fast_agrees_with_full(d: dict) -> None:
    from rose.contract.events import _telemetry_fast

    fast = _telemetry_fast(d)
    try:
        full = Telemetry.checked(d)
    except InvalidEvent:
        assert fast is None, d
    else:
        assert fast is None or (fast == full and repr(fast) == repr(full)), d


def test_the_fast_telemetry_path_accepts_a_subset_and_builds_the_same_value():
    """The scheduler's one-pass decoder (rose.events._telemetry_fast) never accepts what the
    full checks refuse, and what it accepts it builds exactly as they do: every field set
    to every edge value, or removed."""
    for example in (telemetry_example(), telemetry_example(kv_cache_usage=0.42)):
        _fast_paths_agree(orjson.loads(encode(example)))


def _fast_paths_agree(base: dict) -> None:
    _fast_agrees_with_full(base)
    for path in sorted(_paths(base)):
        for value in [*EDGES, "<removed>"]:
            d = orjson.loads(orjson.dumps(base))
            target = d
            for k in path[:-1]:
                target = target[k]
            if value == "<removed>":
                del target[path[-1]]
            else:
                target[path[-1]] = value
            _fast_agrees_with_full(d)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_the_fast_telemetry_path_agrees_on_schema_instances(data):
    _fast_agrees_with_full(data.draw(from_schema(load("rose.telemetry.v1"))))


INVALID = [
    (b"not json", "$"),
    (b"[1,2]", "$"),
    (b'{"schema":"rose.telemetry.v9"}', "schema"),
    (b'{"ts": NaN}', "$"),
    (b'{"ts": Infinity}', "$"),
    (b"", "$"),
]


@pytest.mark.parametrize("raw,field", INVALID)
def test_invalid_bytes_name_the_problem(raw, field):
    with pytest.raises(InvalidEvent) as ei:
        decode(raw)
    assert ei.value.field == field
    assert str(ei.value)


def test_specific_reasons():
    base = orjson.loads(encode(telemetry_example()))
    cases = {
        "mem_used_bytes": ({**base, "mem_used_bytes": base["mem_total_bytes"] + 1}, "exceeds mem_total_bytes"),
        "rollout_mem_bytes": ({**base, "rollout_mem_bytes": base["mem_used_bytes"] + 1}, "exceeds mem_used_bytes"),
        "gpu_util": ({**base, "gpu_util": 1.5}, "outside"),
        "latency_ms.tpot_p99": ({**base, "latency_ms": {"ttft_p99": 1, "tpot_p99": "x"}}, "expected number"),
        "slo_ms.ttft_p99": ({**base, "slo_ms": {"ttft_p99": 0, "tpot_p99": 1}}, "outside"),
        "gpu": ({**base, "gpu": "x" * 10_000}, "longer than"),
        "mem_total_bytes": ({**base, "mem_total_bytes": -1}, "outside"),
    }
    for field, (d, reason) in cases.items():
        with pytest.raises(InvalidEvent) as ei:
            decode(orjson.dumps(d))
        assert ei.value.field == field and reason in ei.value.reason, (field, ei.value)


def test_kv_cache_usage_is_optional_and_round_trips():
    """rose.telemetry.v1's optional kv_cache_usage: an event without it (every event before it
    existed) decodes to None and re-encodes to the same bytes; with it, it round-trips after
    queue_depth, through both decoding paths."""
    from rose.contract.events import _telemetry_fast

    old = encode(telemetry_example())
    assert b"kv_cache_usage" not in old
    ev = decode(old, Telemetry)
    assert ev.kv_cache_usage is None and encode(ev) == old
    for value in (0, 0.0, 0.0039, 0.5, 1, 1.0):
        d = {**orjson.loads(old), "kv_cache_usage": value}
        jsonschema.validate(d, load("rose.telemetry.v1"))
        ev = decode(orjson.dumps(d), Telemetry)
        assert ev.kv_cache_usage == value and type(ev.kv_cache_usage) is float
        assert _telemetry_fast(d) == Telemetry.checked(d) == ev
        assert list(orjson.loads(encode(ev)))[-1] == "kv_cache_usage"
        assert decode(encode(ev)) == ev


def test_replica_fields_are_optional_and_round_trip():
    """v1.3's replica, serving_state (telemetry) and lease_kind (command): at their defaults they
    stay off the wire (a v1.2 event's bytes are unchanged); set, they round-trip through both
    telemetry decoding paths; a bad value is rejected naming the field."""
    from rose.contract.events import _telemetry_fast

    old = encode(telemetry_example())
    assert b"replica" not in old and b"serving_state" not in old
    ev = decode(old, Telemetry)
    assert (ev.replica, ev.serving_state, ev.replica_id) == ("", "serving", ev.gpu)
    for state in ("serving", "draining", "lent", "reclaiming"):
        d = {**orjson.loads(old), "replica": "node-1/r0", "serving_state": state}
        jsonschema.validate(d, load("rose.telemetry.v1"))
        ev = decode(orjson.dumps(d), Telemetry)
        assert (ev.replica_id, ev.serving_state) == ("node-1/r0", state)
        assert _telemetry_fast(d) == Telemetry.checked(d) == ev and decode(encode(ev)) == ev
    with pytest.raises(InvalidEvent, match="serving_state"):
        decode(orjson.dumps({**orjson.loads(old), "serving_state": "asleep"}))
    with pytest.raises(InvalidEvent, match="replica"):
        decode(orjson.dumps({**orjson.loads(old), "replica": ""}))
    plain = encode(command_example())
    assert b"lease_kind" not in plain and decode(plain, Command).lease_kind == "coresident"
    assert encode(command_example(lease_kind="coresident")) == plain
    lent = command_example(lease_kind="replica")
    assert orjson.loads(encode(lent))["lease_kind"] == "replica" and decode(encode(lent)) == lent
    with pytest.raises(InvalidEvent, match="lease_kind"):
        decode(orjson.dumps({**orjson.loads(plain), "lease_kind": "whole"}))
    for state in ("draining", "reclaiming"):
        assert decode(encode(lease_state_example(state=state))).state == state


def test_bad_kv_cache_usage_is_rejected_naming_the_field():
    """A value outside 0..1, not a number, or null is rejected like any bad field: InvalidEvent
    naming `kv_cache_usage` (the scheduler sends it to the dlq with that field)."""
    base = orjson.loads(encode(telemetry_example()))
    for value, reason in (
        (1.5, "outside"),
        (-0.01, "outside"),
        (57, "outside"),  # a percentage is not a fraction
        ("0.5", "expected number"),
        (None, "expected number"),
        (True, "expected number"),
        ([0.5], "expected number"),
    ):
        with pytest.raises(InvalidEvent) as ei:
            decode(orjson.dumps({**base, "kv_cache_usage": value}))
        assert ei.value.field == "kv_cache_usage" and reason in ei.value.reason, (value, ei.value)
        assert not jsonschema.Draft202012Validator(load("rose.telemetry.v1")).is_valid(
            {**base, "kv_cache_usage": value}
        )
    for value in (math.nan, math.inf):  # not JSON, but a dict handed to the decoder directly
        with pytest.raises(InvalidEvent, match="kv_cache_usage: must be finite"):
            Telemetry.from_dict({**base, "kv_cache_usage": value})


@settings(max_examples=300, deadline=None)
@given(value=BAD_VALUES | st.floats(-0.5, 1.5) | st.integers(-2, 2))
def test_kv_cache_usage_accepted_exactly_where_the_schema_accepts_it(value):
    from rose.contract.events import _telemetry_fast

    d = {**orjson.loads(encode(telemetry_example())), "kv_cache_usage": value}
    schema_ok = jsonschema.Draft202012Validator(load("rose.telemetry.v1")).is_valid(d)
    try:
        ev = decode(orjson.dumps(d), Telemetry)
    except InvalidEvent as e:
        assert not schema_ok and e.field == "kv_cache_usage", (value, e)
        assert _telemetry_fast(d) is None
    else:
        assert schema_ok and ev.kv_cache_usage == value and _telemetry_fast(d) == ev


def test_agent_records_carry_kv_cache_usage_when_the_engine_reports_it():
    from rose.config import GiB
    from rose.node.telemetry import telemetry_records

    common = dict(
        ts=1.7e9,
        node="n",
        gpus=["n/0", "n/1"],
        pool="serving",
        slo=(1000.0, 100.0),
        run_id="r",
        seq=1,
        util=[0.5, 0.5],
        mem_total=80 * GiB,
        mem_used=[GiB, GiB],
        rollout_mem=[0, 0],
        ttft_ms=[1.0, 2.0],
        tpot_ms=[3.0, 4.0],
        rps=[0.0, 1.5],
        queue=[0, 2],
    )
    without = telemetry_records(**common)
    assert all(b"kv_cache_usage" not in v for v, _ in without)  # the bytes of an agent before the field
    recs = telemetry_records(**common, kv_cache_usage=[0.25, None])
    assert recs[1] == without[1]  # an engine that does not report it: the field stays off
    d = orjson.loads(recs[0][0])
    jsonschema.validate(d, load("rose.telemetry.v1"))
    assert Telemetry.from_dict(d).kv_cache_usage == 0.25 and list(d)[-1] == "kv_cache_usage"


def test_huge_value_rejected_before_parsing():
    with pytest.raises(InvalidEvent, match="exceeds"):
        decode(b" " * (MAX_VALUE_BYTES + 1))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_decoder_raises_only_invalid_event(raw):
    try:
        decode(raw)
    except InvalidEvent:
        pass


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=8) | st.integers(-(2**63), 2**63 - 1),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=4),
        max_leaves=20,
    )
)
def test_decoder_on_arbitrary_json(obj):
    for typ in (None, Telemetry, Command, LeaseState):
        try:
            ev = decode(orjson.dumps(obj), typ)
            assert all(math.isfinite(v) for v in (ev.ts,))
        except InvalidEvent:
            pass
