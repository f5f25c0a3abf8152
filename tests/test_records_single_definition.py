"""Each Redis record is read and written only through rose.contract.records: no module under
rose/ other than it builds a heartbeat key (`key("workers", ...)`), calls a hash command on a
heartbeat, or takes the `trajectory` field out of a results entry. Pure AST reading, in the
manner of tests/test_layers.py: nothing under rose/ is imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECORDS = REPO / "rose" / "contract" / "records.py"
HASH_COMMANDS = frozenset({"hset", "hsetnx", "hget", "hgetall", "hmget", "hdel", "hincrby", "hincrbyfloat", "hexists"})
HEARTBEAT_KEY = re.compile(r"\bhb\b|hb_key|heartbeat|\"workers\"|'workers'")
TRAJECTORY = frozenset({"trajectory", b"trajectory"})


def _const(node: ast.AST | None) -> object:
    return node.value if isinstance(node, ast.Constant) else None


def violations(source: str) -> list[str]:
    """What in `source` reads or writes a heartbeat or a trajectory entry by hand."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f, args = node.func, node.args
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name.endswith("key") and args and _const(args[0]) == "workers":
                out.append(f"line {node.lineno}: builds a heartbeat key: {ast.unparse(node)}")
            if name in HASH_COMMANDS and args and HEARTBEAT_KEY.search(ast.unparse(args[0])):
                out.append(f"line {node.lineno}: {name} on a heartbeat: {ast.unparse(node)}")
            if name == "get" and args and _const(args[0]) in TRAJECTORY:
                out.append(f"line {node.lineno}: reads a trajectory field: {ast.unparse(node)}")
        if isinstance(node, ast.Subscript) and _const(node.slice) in TRAJECTORY:
            out.append(f"line {node.lineno}: reads a trajectory field: {ast.unparse(node)}")
    return out


def test_redis_records_are_read_and_written_only_through_rose_contract_records() -> None:
    found = {
        str(p.relative_to(REPO)): v
        for p in sorted((REPO / "rose").rglob("*.py"))
        if p != RECORDS and (v := violations(p.read_text()))
    }
    assert not found, "use rose.contract.records (Heartbeat, WorkerRegistry, Trajectory):\n" + "\n".join(
        f"{path}: {line}" for path, lines in found.items() for line in lines
    )


def test_the_scan_finds_each_way_of_reading_a_record_by_hand() -> None:
    hand_made = """
r.hgetall(cfg.redis.key("workers", w))
p.hset(self.hb_key, mapping={"state": "running"})
ts = r.hmget(heartbeat_key, "ts")
body = orjson.loads(fields[b"trajectory"])
raw = entry.get("trajectory")
"""
    assert len(violations(hand_made)) == 6  # the first line both builds the key and reads it
    assert violations('q = rcfg.key("tasks", job, "workers")\nr.hget(meta, "version")\nfield = "trajectory"') == []
