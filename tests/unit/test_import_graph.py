"""The import graph of shared/, services/, hetsched/ and migrations/ has no cycle, and the layers point
one way: no service imports another service, and nothing in shared/ or services/ imports the command
line. Read from the source (AST), so imports under ``TYPE_CHECKING`` and inside functions count too."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("shared", "services", "hetsched", "migrations")
AGGREGATORS = {"services.registry"}  # lists every service for the launcher and the tests


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(roots: Iterable[str] = ROOTS) -> dict[str, Path]:
    return {_module_name(p): p for root in roots for p in sorted((REPO / root).rglob("*.py"))}


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute name ``from <module> import ...`` refers to (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(module: str, path: Path, known: Mapping[str, Path]) -> set[str]:
    """The modules of ``known`` that ``module`` imports: ``from a import b`` is ``a.b`` when that is a
    module, else ``a``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path, node)
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target)
    return {name for name in found if name in known and name != module}


def import_graph(known: Mapping[str, Path]) -> dict[str, set[str]]:
    return {module: imports_of(module, path, known) for module, path in known.items()}


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """One cycle (a path back to its start) per strongly connected component with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(start: str) -> None:
        # Tarjan's algorithm, iterative: the graph is deep enough to matter for recursion.
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)

    for module in sorted(graph):
        if module not in index:
            connect(module)
    return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph: Mapping[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"not a cycle: {sorted(component)}")


def test_no_import_cycle() -> None:
    found = cycles(import_graph(_modules()))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_service_imports_another_service() -> None:
    graph = import_graph(_modules())
    offenders = [
        f"{module} imports {target}"
        for module, targets in graph.items()
        if module.startswith("services.") and module not in AGGREGATORS
        for target in targets
        if target.startswith("services.") and target.split(".")[1] != module.split(".")[1]
    ]
    assert not offenders, offenders


def test_the_layers_point_one_way() -> None:
    """shared/ imports no service, and neither shared/ nor services/ imports the command line."""
    graph = import_graph(_modules())
    offenders = [
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if (module.startswith("shared.") and target.split(".")[0] in ("services", "hetsched"))
        or (module.startswith("services.") and target.split(".")[0] in ("hetsched", "migrations"))
    ]
    assert not offenders, offenders


def test_the_check_sees_a_cycle_and_a_type_checking_import(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text("from pkg import b\n")
    b.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import thing\n")
    c.write_text("def f():\n    from pkg import a\n")
    known = {"pkg.a": a, "pkg.b": b, "pkg.c": c}
    graph = {m: imports_of(m, p, known) for m, p in known.items()}
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    assert cycles({"pkg.a": {"pkg.b"}, "pkg.b": set()}) == []


def test_relative_imports_resolve(tmp_path: Path) -> None:
    init, mod = tmp_path / "__init__.py", tmp_path / "mod.py"
    init.write_text("from . import mod\nfrom .mod import x\n")
    mod.write_text("from .. import other\n")
    known = {"pkg.sub": init, "pkg.sub.mod": mod, "pkg.other": tmp_path / "other.py"}
    assert imports_of("pkg.sub", init, known) == {"pkg.sub.mod"}
    assert imports_of("pkg.sub.mod", mod, known) == {"pkg.other"}
