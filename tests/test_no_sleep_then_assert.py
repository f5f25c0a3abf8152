"""No test sleeps a fixed time and then asserts: a `time.sleep(...)` or `await asyncio.sleep(...)`
statement directly followed, in the same block, by an `assert`. Such a test guesses how long
the system takes: on a loaded machine it fails, and with a sleep long enough never to fail it
is slow. A test waits on the event it needs instead (a bounded wait); one that checks that
nothing happens during a while waits first on a later event that proves the while has passed
(a newer heartbeat, a later offset), then asserts the absence."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# "path:function" -> why its sleep before an assert stays for now (keep this empty, or nearly)
EXCEPTIONS: dict[str, str] = {
    "tests/test_agent_outage.py:test_agent_survives_broker_outage": (
        "the sleep is the fault itself (the broker stays down 5 s) and the assert that the agent is still "
        "there is the check of that fault; delivery of what it buffered is asserted after the broker is back"
    ),
}


def is_sleep(stmt: ast.stmt) -> bool:
    """`sleep(...)`, `<anything>.sleep(...)`, either awaited, as a statement of its own."""
    if not isinstance(stmt, ast.Expr):
        return False
    call = stmt.value.value if isinstance(stmt.value, ast.Await) else stmt.value
    if not isinstance(call, ast.Call):
        return False
    f = call.func
    return (isinstance(f, ast.Attribute) and f.attr == "sleep") or (isinstance(f, ast.Name) and f.id == "sleep")


def sleeps_then_asserts(tree: ast.AST) -> list[tuple[str, int]]:
    """(innermost enclosing function, line of the sleep) for each sleep followed by an assert."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = node.name
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                for stmt, following in zip(block, block[1:]):
                    if is_sleep(stmt) and isinstance(following, ast.Assert):
                        found.append((func, stmt.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(tree, "<module>")
    return found


def offenders() -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS.parent).as_posix()
        for func, line in sleeps_then_asserts(ast.parse(path.read_text(), str(path))):
            out.setdefault(f"{rel}:{func}", []).append(line)
    return out


def test_no_test_sleeps_then_asserts():
    over = {name: lines for name, lines in offenders().items() if name not in EXCEPTIONS}
    assert not over, f"a fixed sleep directly followed by an assert (wait on the event instead): {over}"


def test_every_exception_is_still_needed():
    stale = [name for name in EXCEPTIONS if name not in offenders()]
    assert not stale, f"no longer sleeping before an assert, drop them from EXCEPTIONS: {stale}"


def test_the_check_sees_a_sleep_then_an_assert_and_nothing_else():
    src = (
        "import asyncio, time\n"
        "def test_a():\n    time.sleep(1)\n    assert x\n"
        "async def test_b():\n    if y:\n        await asyncio.sleep(1)\n        assert x\n"
        "def test_c():\n    time.sleep(1)\n    v = f()\n    assert v\n"
        "def test_d():\n    wait_for(f)\n    assert x\n"
    )
    assert sleeps_then_asserts(ast.parse(src)) == [("test_a", 3), ("test_b", 7)]
