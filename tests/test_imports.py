"""The project's import graph, read with `ast` (nothing is imported): no module imports itself back through a
chain of imports (a failure lists each cycle, hop by hop with the importing line), the Pallas kernels import nothing
of the model or the sharding plans, and no library module imports a benchmark.

An edge A -> B is any import of project module B in A: at the top level or inside a function, `import B`,
`from B import name` and `from P import B` (B a module of package P), relative imports resolved. Imports under
`if TYPE_CHECKING:` are left out (they never run). Importing a.b.c counts as an edge to a.b.c only, not to the
packages a and a.b whose __init__ runs on the way.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hcfjax", "pallas_kernels", "sharding", "train_mtp")
KERNEL_BENCHMARKS = "pallas_kernels.bench"


def _modules(root: Path) -> dict[str, Path]:
    """{dotted module name: file} for every .py file under the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path.relative_to(root)
    return out


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    """Collects (base module, names imported from it, line) per import statement, skipping `if TYPE_CHECKING:`
    bodies; import_graph() resolves them to modules."""

    def __init__(self, module: str, is_package: bool):
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[tuple[str, list[str], int]] = []

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((alias.name, [], node.lineno))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")
            anchor = ".".join(parts[: len(parts) - (node.level - 1)])
            base = f"{anchor}.{base}" if base else anchor
        self.found.append((base, [a.name for a in node.names], node.lineno))


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is a project module, or None (not the project's)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in modules:
            return candidate
    return None


def import_graph(root: Path = ROOT) -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    """({module: {imported module: first line}}, {module: file relative to root})."""
    modules = _modules(root)
    graph: dict[str, dict[str, int]] = {}
    for mod, path in modules.items():
        visitor = _Imports(mod, path.name == "__init__.py")
        visitor.visit(ast.parse((root / path).read_text(), str(path)))
        edges: dict[str, int] = {}
        for base, names, line in visitor.found:
            targets = [f"{base}.{n}" for n in names if f"{base}.{n}" in modules]
            if len(targets) < len(names) or not names:  # names that are not modules come from base itself
                targets.append(base)
            for target in filter(None, (_resolve(t, modules) for t in targets)):
                if target != mod:
                    edges.setdefault(target, line)
        graph[mod] = edges
    return graph, modules


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components of more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def shortest_cycle(graph: dict[str, dict[str, int]], start: str, within: set[str]) -> list[str]:
    """The shortest path start -> ... -> start inside a component (breadth first)."""
    parent: dict[str, str] = {}
    queue = collections.deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node]):
            if child not in within:
                continue
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if child not in parent:
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"{start} is on no cycle within {sorted(within)}")


def describe(graph: dict[str, dict[str, int]], modules: dict[str, Path], component: list[str]) -> list[str]:
    """A component as cycles that together pass through all its modules, each hop with the importing line."""
    lines = [f"import cycle among {len(component)} modules: {', '.join(component)}"]
    covered: set[str] = set()
    members = set(component)
    for start in component:
        if start in covered:
            continue
        cycle = shortest_cycle(graph, start, members)
        covered.update(cycle)
        lines.append("  " + " -> ".join(cycle))
        for a, b in zip(cycle, cycle[1:], strict=False):
            lines.append(f"      {modules[a]}:{graph[a][b]} imports {b}")
    return lines


def test_no_import_cycles():
    graph, modules = import_graph()
    components = strongly_connected(graph)
    report = [line for c in components for line in describe(graph, modules, c)]
    assert not components, f"{len(components)} import cycle(s):\n" + "\n".join(report)


def test_kernels_import_nothing_of_the_project_above_them():
    """pallas_kernels is the bottom layer: the model (hcfjax) and the sharding plans build on it, not the reverse.
    Its benchmarks (pallas_kernels.bench) are left out: they time the kernels against the model's own paths, a
    harness on top of both, as hcfjax.bench is."""
    graph, modules = import_graph()
    bad = [
        f"{modules[mod]}:{line} imports {target}"
        for mod in sorted(graph)
        if mod.split(".")[0] == "pallas_kernels" and not _within(mod, KERNEL_BENCHMARKS)
        for target, line in sorted(graph[mod].items())
        if target.split(".")[0] in ("hcfjax", "sharding")
    ]
    assert not bad, "pallas_kernels imports the layers above it:\n" + "\n".join(bad)


def test_library_imports_no_benchmark():
    """Benchmarks (hcfjax.bench, pallas_kernels.bench) build on the library, never the reverse; the command line
    (hcfjax.cli), an entry point, may start one."""
    graph, modules = import_graph()
    benchmarks = ("hcfjax.bench", KERNEL_BENCHMARKS)
    bad = [
        f"{modules[mod]}:{line} imports {target}"
        for mod in sorted(graph)
        if mod != "hcfjax.cli" and not any(_within(mod, b) for b in benchmarks)
        for target, line in sorted(graph[mod].items())
        if any(_within(target, b) for b in benchmarks)
    ]
    assert not bad, "library modules import benchmarks:\n" + "\n".join(bad)


def test_graph_reader_on_a_known_case(tmp_path):
    """The reader itself: function-level and relative imports count, TYPE_CHECKING ones do not, and a two-module
    cycle is reported with its lines."""
    pkg = tmp_path / "hcfjax"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hcfjax import c\n")
    (pkg / "b.py").write_text("def f():\n    from .sub import d\n")
    (pkg / "c.py").write_text("import hcfjax.a\n")
    (pkg / "sub" / "d.py").write_text("from .. import b\nfrom hcfjax.b import f\n")
    graph, modules = import_graph(tmp_path)
    assert graph["hcfjax.a"] == {} and graph["hcfjax.c"] == {"hcfjax.a": 1}
    assert graph["hcfjax.b"] == {"hcfjax.sub.d": 2} and graph["hcfjax.sub.d"] == {"hcfjax.b": 1}
    (component,) = strongly_connected(graph)
    text = "\n".join(describe(graph, modules, component))
    assert "hcfjax.b -> hcfjax.sub.d -> hcfjax.b" in text and "hcfjax/sub/d.py:1 imports hcfjax.b" in text
