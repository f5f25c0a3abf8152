"""`rose bench replica` in a quick run on the real stack: two vLLM servers on the tiny checkpoint
behind vllm-router, the local Kafka and Redis, an executor lending one replica per cycle. The
figures are the bench's to report; what must hold in any run is checked here."""

from __future__ import annotations

import math

import orjson
import pytest

from rose.bench import replica
from tests.test_router import needs_vllm

CYCLES = 2


def _positive(x: object) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.mark.stack
@pytest.mark.slow  # its own two vLLM servers: 7.7 min on the loaded 2-core machine
@needs_vllm
@pytest.mark.timeout(900)  # two vLLM servers' start: 290 s of a 7.7-min run at load average 10 on the 2 cores
def test_a_quick_run_lends_and_reclaims_the_replica_without_a_failed_request(cfg, tiny_checkpoint):
    out = replica.run(cfg, quick=True, model=str(tiny_checkpoint), cycles=CYCLES)
    orjson.dumps(out)  # JSON as it is
    assert out["failed_requests"] == 0, out["failures_first"]
    assert out["cycles"] == CYCLES
    for k in ("drain_s", "reclaim_to_serving_s"):
        assert out[k]["n"] == CYCLES and _positive(out[k]["p50"]) and out[k]["p50"] <= out[k]["p99"], out[k]
    tps = out["rollout_tokens_per_s"]
    assert _positive(tps["lent_replica"]) and _positive(tps["dedicated_same_device"]), tps
    attained = out["serving_slo_attainment"]
    assert all(0.0 <= attained[k] <= 1.0 for k in ("no_lease", "with_replica_leases")), attained
    assert out["serving_requests"]["no_lease"] > 0 and out["serving_requests"]["with_replica_leases"] > 0
    assert out["router"]["name"] == "vllm-router" and out["router"]["version"]
    assert out["engine"]["name"] == cfg.rollout.engine, out["engine"]


def test_bad_options_are_one_line_and_exit_2():
    import os
    import subprocess
    import sys

    for args, says in (
        (["--engine", "tgi"], "--engine 'tgi'"),
        (["--cycles", "-1"], "--cycles -1"),
        (["--turns", "3"], "bench replica does not take them"),
        (["--model", "/nonexistent"], "--model '/nonexistent'"),
    ):
        p = subprocess.run(
            [sys.executable, "-m", "rose", "bench", "replica", "--json", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}"},
        )
        assert p.returncode == 2 and p.stdout == "", (args, p.stderr)
        assert p.stderr.count("\n") == 1 and says in p.stderr, (args, p.stderr)
