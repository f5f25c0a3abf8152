"""`rose paper-check`: `rose simulate` on the public traces beside the paper's claim, with
the evidence behind each figure: every headline figure as a mean with its 95 % interval over
seeds, ROSE beside share-all (gain, SLO attainment, their throughput ratio with its interval and
where ROSE harvests less), the targets met or missed, and the sweeps that say which constant
holds a missed one back: the interference profile (each mechanism measured on the device, and
the former linear model's alphas as labelled rows), the fleet ratio G/M through the harvest
identity, the elastic baseline's cost cap and provisioning delay. What it runs and why:
docs/paper-check.md.

`check()` runs it whole: rose.sim.paper_plan lists the runs and runs them, rose.sim.paper_results
holds them and checks the targets (rose.sim.paper_kinds the lease kinds' R1 and R2),
rose.sim.paper_tables writes the markdown that docs/paper-check.md carries between its
generated-block markers (`replace_block`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from rose.sim.paper_kinds import all_targets
from rose.sim.paper_plan import CheckConfig, Job, plan, run_all
from rose.sim.paper_results import Results
from rose.sim.paper_tables import BEGIN, END, tables
from rose.sim.sim_config import SimConfig


def replace_block(doc: str, block: str) -> str:
    """`doc` with the text between BEGIN and END (inclusive) replaced by `block`; ValueError when
    the markers are missing."""
    i, j = doc.find(BEGIN), doc.find(END)
    if i < 0 or j < i:
        raise ValueError("the paper-check markers are missing")
    return doc[:i] + block.rstrip("\n") + doc[j + len(END) :]


def check(folder: Path, cc: CheckConfig, command: str, workers: int = 1, progress=None) -> tuple[str, dict]:
    """Run the whole check: the generated markdown and a JSON-ready record of every run."""
    t0 = time.perf_counter()
    jobs = plan(cc)
    results = run_all(folder, jobs, workers, progress)
    res = Results(cc, jobs, results)
    wall = time.perf_counter() - t0
    md = tables(res, command, wall)
    record = {
        "command": command,
        "wall_s": round(wall, 1),
        "check_config": {k: v for k, v in asdict(cc).items() if k != "policy"},
        "targets": all_targets(res),
        "runs": [
            {"kind": j.kind, "trace": j.trace, "model": j.model, "value": j.value, "seed": j.seed, "result": r}
            for j, r in zip(jobs, results)
        ],
    }
    return md, record


def from_record(record: dict, cc: CheckConfig | None = None) -> str:
    """The generated markdown again, from a record `check` wrote (`rose paper-check --json`),
    without running anything: for a change of wording, not of numbers."""
    if cc is None:
        known = {f.name for f in fields(CheckConfig)}
        kw: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in record.get("check_config", {}).items() if k in known
        }
        cc = CheckConfig(**kw)
    jobs = [Job(r["kind"], r["trace"], r["model"], r["value"], r["seed"], SimConfig()) for r in record["runs"]]
    return tables(Results(cc, jobs, [r["result"] for r in record["runs"]]), record["command"], record["wall_s"])
