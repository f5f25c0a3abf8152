"""`@immutable` value types: frozen to the type checker, equal and hashable by value."""

from __future__ import annotations

import dataclasses

from rose.contract.events import Latency
from rose.policy.lease_policy import GpuView


def test_values_compare_and_hash_by_their_fields():
    a, b = GpuView(gpu="g/0", epoch=3), GpuView(gpu="g/0", epoch=3)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    c = dataclasses.replace(a, epoch=4)
    assert c != a and c.epoch == 4 and a.epoch == 3
    assert Latency(1.0, 2.0) == Latency(1.0, 2.0) and hash(Latency(1.0, 2.0)) == hash(Latency(1.0, 2.0))


def test_the_type_checker_rejects_assigning_a_field(tmp_path):
    from mypy import api

    src = tmp_path / "assign.py"
    src.write_text(
        "from rose.policy.lease_policy import GpuView\n"
        "from rose.contract.events import Latency\n"
        "v = GpuView(gpu='g/0')\n"
        "v.epoch = 2\n"
        "lat = Latency(1.0, 2.0)\n"
        "lat.ttft_p99 = 3.0\n"
    )
    out, _, status = api.run([str(src), "--no-incremental", "--follow-imports=silent"])
    assert status == 1, out
    assert 'Property "epoch" defined in "GpuView" is read-only' in out, out
    assert 'Property "ttft_p99" defined in "Latency" is read-only' in out, out
