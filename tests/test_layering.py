"""The packages' import graph, read statically: layers hold and no module imports itself back.

Every ``.py`` under ``tierstore/``, ``trainer/`` and ``tools/`` is parsed with ``ast`` (nothing is
imported), and every ``import``/``from ... import`` in it becomes an edge, wherever it stands:

- **Layers**: ``tools`` -> ``trainer`` -> ``tierstore``. ``tierstore`` imports nothing from
  ``trainer`` or ``tools``, and ``trainer`` nothing from ``tools``. Every import counts here,
  module-level, inside a function or under ``if TYPE_CHECKING:``: a lazy import still makes the
  lower package unusable without the upper one.
- **Cycles**: no module may reach itself through imports. Imports inside functions count too:
  deferring an import hides a circle from the interpreter, not from the reader, and two modules
  that need each other can be neither understood nor tested alone (move the shared piece into a
  module below both). Only imports under ``if TYPE_CHECKING:`` are left out of the cycle check:
  they never run, and annotations naming a caller's type are how a lower module documents what
  it is handed.

An edge goes to the module named (``from a.b import c`` goes to ``a.b.c`` when that is a module,
else to ``a.b``), not to the packages above it, whose ``__init__`` runs first: counting those
would make every package a circle with its own submodules. Imports by string
(``importlib.import_module``) are not seen.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("tierstore", "trainer", "tools")
#: package -> the packages it must never import from
FORBIDDEN = {"tierstore": ("trainer", "tools"), "trainer": ("tools",)}


@dataclass(frozen=True, slots=True)
class Edge:
    """One import statement: who imports what, where, and how."""

    source: str
    target: str
    line: int
    kind: str  # "module", "function" or "type-checking"


def module_files() -> dict[str, str]:
    """Dotted module name -> file path, for every .py in the packages."""
    mods: dict[str, str] = {}
    for pkg in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(ROOT, pkg)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    mods[name.removesuffix(".__init__")] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, kind: str = "module") -> list[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement under ``tree`` with where it stands (recursing into every body)."""
    found: list[tuple[ast.Import | ast.ImportFrom, str]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append((node, kind))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            found += _imports(node, "function" if kind == "module" else kind)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                found += _imports(ast.Module(body=[child], type_ignores=[]), "type-checking")
            for child in node.orelse:
                found += _imports(ast.Module(body=[child], type_ignores=[]), kind)
        else:  # class bodies, try/with/if blocks run with their enclosing scope
            found += _imports(node, kind)
    return found


def _resolve(name: str, node: ast.Import | ast.ImportFrom, mods: dict[str, str]) -> list[str]:
    """The modules of the packages that ``node`` (in module ``name``) imports."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] in PACKAGES]
    if node.level:  # relative: from the package holding this module
        is_pkg = mods[name].endswith("__init__.py")
        parts = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
        base = ".".join(parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if base.split(".")[0] not in PACKAGES:
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]


def import_edges() -> list[Edge]:
    """Every import among the packages' modules."""
    mods = module_files()
    edges = []
    for name, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node, kind in _imports(tree):
            for target in _resolve(name, node, mods):
                if target != name:
                    edges.append(Edge(name, target, node.lineno, kind))
    return edges


def cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(comp: list[str], edges: list[Edge]) -> str:
    inside = [e for e in edges if e.source in comp and e.target in comp]
    return "; ".join(f"{e.source} -> {e.target} (line {e.line}, {e.kind})" for e in inside)


def test_every_module_is_found_and_parsed() -> None:
    mods = module_files()
    assert {"tierstore", "tierstore.tiers.disk", "trainer.args", "tools.cli"} <= set(mods)
    assert any(e.kind == "function" for e in import_edges())


def test_lower_packages_import_nothing_above_them() -> None:
    bad = [f"{e.source} imports {e.target} (line {e.line}, {e.kind})" for e in import_edges()
           if e.target.split(".")[0] in FORBIDDEN.get(e.source.split(".")[0], ())]
    assert not bad, "layering is tools -> trainer -> tierstore:\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    edges = [e for e in import_edges() if e.kind != "type-checking"]
    found = cycles(edges)
    assert not found, "import cycles (move the shared piece into a module below both):\n" + "\n".join(
        _describe(c, edges) for c in found)


def test_the_checks_see_what_they_look_for() -> None:
    # a circle through a function-level import, and a layering violation inside a function
    edges = [Edge("tierstore.a", "tierstore.b", 1, "module"), Edge("tierstore.b", "tierstore.a", 9, "function")]
    assert cycles(edges) == [["tierstore.a", "tierstore.b"]]
    tree = ast.parse("import os\nif TYPE_CHECKING:\n    from trainer import x\n"
                     "def f():\n    from tools import cli\nclass C:\n    import tierstore.keys\n")
    assert [(type(n).__name__, k) for n, k in _imports(tree)] == [
        ("Import", "module"), ("ImportFrom", "type-checking"), ("ImportFrom", "function"), ("Import", "module")]
