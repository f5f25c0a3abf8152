"""No function of the control plane's decision paths (rose/policy, rose/scheduler, rose/executor),
of the node agent (rose/node) or of the demo (rose/demo) is longer than `MAX_LINES` lines, from its `def` (decorators excluded) to its last line: a
function that long does several things, and each deserves a name."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "rose"
PACKAGES = ("policy", "scheduler", "executor", "node", "demo")
MAX_LINES = 80

# "module:qualified.name" -> why it may be longer (keep this short)
EXCEPTIONS: dict[str, str] = {}


def long_functions() -> dict[str, int]:
    found: dict[str, int] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
            tree = ast.parse(path.read_text(), str(path))

            def visit(node: ast.AST, prefix: str) -> None:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        name = prefix + child.name
                        length = (child.end_lineno or child.lineno) - child.lineno + 1
                        if length > MAX_LINES:
                            found[f"{module}:{name}"] = length
                        visit(child, name + ".")
                    elif isinstance(child, ast.ClassDef):
                        visit(child, prefix + child.name + ".")
                    else:
                        visit(child, prefix)

            visit(tree, "")
    return found


def test_no_function_is_longer_than_the_limit():
    found = long_functions()
    over = {name: n for name, n in found.items() if name not in EXCEPTIONS}
    assert not over, f"functions longer than {MAX_LINES} lines: {over}"


def test_every_exception_is_still_needed():
    found = long_functions()
    stale = [name for name in EXCEPTIONS if name not in found]
    assert not stale, f"no longer over {MAX_LINES} lines, drop them from EXCEPTIONS: {stale}"
