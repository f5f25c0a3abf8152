"""The layers of docs/architecture.md, checked on the code: every import under rose/ (at module
level, inside functions, under TYPE_CHECKING) goes down the floors of the doc's layers table, no
import cycle exists among rose's modules, and every module path and dotted name that
docs/architecture.md and CONTRIBUTING.md give exists. The table is read from the doc, so the
two cannot drift apart. Pure AST reading: nothing under rose/ is imported.

    python tests/test_layers.py      lists every import cycle and every import against the table
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARCHITECTURE = REPO / "docs" / "architecture.md"
NAMED_DOCS = (ARCHITECTURE, REPO / "CONTRIBUTING.md")
# Import cycles still being taken apart, each named with its modules; empty when there is none.
KNOWN_CYCLES: tuple[frozenset[str], ...] = ()


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool


@cache
def modules() -> dict[str, Module]:
    out = {}
    for p in sorted((REPO / "rose").rglob("*.py")):
        parts = list(p.relative_to(REPO).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        out[".".join(parts)] = Module(".".join(parts), p, is_package)
    return out


@cache
def tree(name: str) -> ast.Module:
    return ast.parse(modules()[name].path.read_text(encoding="utf-8"), filename=str(modules()[name].path))


def ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imported(node: ast.AST, mod: Module) -> list[str]:
    """The dotted names one import statement brings in (a module, and for `from X import y` also
    X.y, which is a submodule when one of that name exists)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        return [source, *(f"{source}.{a.name}" for a in node.names)]
    return []


def _loads_own_submodules(node: ast.AST) -> bool:
    """`importlib.import_module(f"{__name__}.{...}")`: a package that loads its submodules by name
    (the command line's and the benchmarks' plugins)."""
    return (
        isinstance(node, ast.Call)
        and ast.unparse(node.func) == "importlib.import_module"
        and bool(node.args)
        and "__name__" in ast.unparse(node.args[0])
    )


@cache
def imports(name: str) -> dict[str, int]:
    """The rose modules `name` imports, each with the line of its first import: a module imported
    also runs its packages' `__init__`s, which count too (except `name`'s own packages, already
    running when it imports)."""
    mod, mods = modules()[name], modules()
    own = set(ancestors(name))
    out: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        for t in (target, *ancestors(target)):
            if t in mods and t != name and t not in own:
                out.setdefault(t, line)

    for node in ast.walk(tree(name)):
        for target in _imported(node, mod):
            add(target, getattr(node, "lineno", 0))
        if mod.is_package and _loads_own_submodules(node):
            for sub in mods:
                if sub.rpartition(".")[0] == name and not sub.endswith(".__main__"):
                    add(sub, getattr(node, "lineno", 0))
    return out


def cycles() -> list[list[str]]:
    """The strongly connected components of more than one module of the import graph (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in imports(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in modules():
        if v not in index:
            visit(v)
    return sorted(found)


def shortest_cycle(component: list[str]) -> list[str]:
    """One shortest import cycle through the first module of a strongly connected component,
    as the modules along it (the first again at the end)."""
    start, inside = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in imports(v):
                if w == start:
                    return [*paths[v], start]
                if w in inside and w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    return component


@dataclass(frozen=True)
class Row:
    floor: int
    index: int  # the row's place in the table
    packages: tuple[str, ...]


@cache
def layers() -> tuple[Row, ...]:
    """The rows of docs/architecture.md's layers table: floor, and the packages and modules it
    names in backticks."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if m:
            names = tuple(re.findall(r"`(rose(?:\.\w+)*)`", m.group(2)))
            rows.append(Row(int(m.group(1)), len(rows), names))
    return tuple(rows)


def row_of(name: str) -> Row | None:
    """The row whose package or module is the longest prefix of `name`."""
    best: tuple[int, Row] | None = None
    for row in layers():
        for p in row.packages:
            if (name == p or name.startswith(p + ".")) and (best is None or len(p) > best[0]):
                best = (len(p), row)
    return best[1] if best else None


def is_bare_package(name: str) -> bool:
    """A package `__init__` that imports nothing: its docstring only, part of no row."""
    mod = modules()[name]
    return mod.is_package and not any(isinstance(n, ast.Import | ast.ImportFrom) for n in ast.walk(tree(name)))


def layer_violations() -> list[str]:
    out = []
    for name in modules():
        src = row_of(name)
        if src is None:
            continue
        for target, line in imports(name).items():
            dst = row_of(target)
            if dst is None or dst is src or dst.floor < src.floor:
                continue
            where = "the same floor, another row" if dst.floor == src.floor else "a higher floor"
            out.append(
                f"{modules()[name].path.relative_to(REPO)}:{line}: {name} (floor {src.floor}) imports "
                f"{target} (floor {dst.floor}): {where}"
            )
    return out


# ---- names the docs give ------------------------------------------------------------------
def _top_level(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names a module or class body defines, assigns or imports, directly or under an `if`/`try`."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        out[n.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for a in node.names:
                out[(a.asname or a.name).split(".")[0]] = node
        elif isinstance(node, ast.If | ast.Try):
            out.update(_top_level(node.body))
            out.update(_top_level(node.orelse))
    return out


def name_exists(dotted: str) -> bool:
    """A module, or a name a module defines, or a member of a class a module defines."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        mod = ".".join(parts[:i])
        if mod in modules():
            rest = parts[i:]
            break
    else:
        return False
    scope: ast.AST = tree(mod)
    for attr in rest:
        defined = _top_level(scope.body) if isinstance(scope, ast.Module | ast.ClassDef) else {}
        if attr not in defined:
            return False
        scope = defined[attr]
    return True


def named_in(doc: Path) -> tuple[set[str], set[str]]:
    """The repository paths (`rose/…`, `tests/…`, `docs/…`) and the dotted `rose.…` names a doc gives."""
    text = doc.read_text(encoding="utf-8")
    paths = set(re.findall(r"(?<![\w./-])((?:rose|tests|docs|consumers|producers|deploy)/[\w./-]*\w/?)", text))
    names = set(re.findall(r"(?<![\w./-])(rose(?:\.[A-Za-z_]\w*)+)", text))
    return paths, names


# ---- tests --------------------------------------------------------------------------------
def test_the_layers_table_is_read():
    rows = layers()
    assert len(rows) >= 10 and rows[0].floor == 1
    assert row_of("rose.policy.lease_policy") is not None and row_of("rose.cli.bench") is not None


def test_every_module_has_a_row():
    missing = [n for n in modules() if row_of(n) is None and not is_bare_package(n)]
    assert not missing, f"modules in no row of the layers table of {ARCHITECTURE.name}: {missing}"


def test_every_row_names_existing_modules():
    ghosts = [p for row in layers() for p in row.packages if p not in modules()]
    assert not ghosts, f"the layers table names modules that do not exist: {ghosts}"


def test_imports_go_down_the_floors():
    bad = layer_violations()
    assert not bad, "imports against the layers table of docs/architecture.md:\n" + "\n".join(bad)


def test_no_import_cycle():
    found = [c for c in cycles() if frozenset(c) not in KNOWN_CYCLES]
    assert not found, "import cycles: " + "; ".join(" -> ".join(shortest_cycle(c)) for c in found)
    stale = [sorted(k) for k in KNOWN_CYCLES if list(sorted(k)) not in cycles()]
    assert not stale, f"KNOWN_CYCLES names cycles that are gone: {stale}"


def test_rose_never_imports_its_entry_points_or_confluent_kafka_outside_rose_kafka():
    bad = []
    for name, mod in modules().items():
        for node in ast.walk(tree(name)):
            for target in _imported(node, mod):
                top = target.split(".")[0]
                if top in ("consumers", "producers") or (
                    top == "confluent_kafka" and not name.startswith("rose.kafka")
                ):
                    bad.append(f"{mod.path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}: {target}")
    assert not bad, bad


def test_no_benchmark_imports_the_demo():
    """The benches measure the system's parts, the demo composes them: what both need (vLLM's
    server, the co-served device's readers) sits below both, so a bench never runs demo code."""
    bad = [
        f"{n} imports {t}"
        for n in modules()
        if n.startswith("rose.bench")
        for t in imports(n)
        if t.startswith("rose.demo")
    ]
    assert not bad, bad


def test_the_import_graph_sees_what_python_imports():
    """Function-level, relative and plugin imports are edges of the graph."""
    assert "rose.bench" in imports("rose.cli.bench")
    assert "rose.cli.bench" in imports("rose.cli")  # the command line loads its modules by name
    assert "rose.bench.weights" in imports("rose.bench")
    assert "rose.kafka.admin" in imports("rose.stack.kafka")  # inside a method


def test_paths_and_names_in_the_docs_exist():
    missing = []
    for doc in NAMED_DOCS:
        paths, names = named_in(doc)
        assert names, f"{doc.name} names no rose module"
        missing += [f"{doc.name}: {p}" for p in sorted(paths) if not (REPO / p).exists()]
        missing += [f"{doc.name}: {n}" for n in sorted(names) if not name_exists(n)]
    assert not missing, "named in the docs but not in the code:\n" + "\n".join(missing)


def main() -> int:
    found = cycles()
    for c in found:
        print("cycle:", " -> ".join(shortest_cycle(c)), f"({len(c)} modules import each other)")
        for a in c:
            for b, line in imports(a).items():
                if b in c:
                    print(f"    {modules()[a].path.relative_to(REPO)}:{line}: {a} -> {b}")
    bad = layer_violations()
    for v in bad:
        print("layers:", v)
    print(f"{len(modules())} modules, {len(found)} cycles, {len(bad)} imports against the layers table")
    return 1 if found or bad else 0


if __name__ == "__main__":
    sys.exit(main())
