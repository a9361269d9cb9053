"""The package's import graph has no circle, function-level imports included."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "deepspec"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its source (module top or inside a
    function). ``from deepspec.x import y`` counts as importing ``deepspec.x.y`` when that is a module,
    else ``deepspec.x``; relative imports are resolved against the importing module."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    edges.add(full if full in modules else base)
        graph[name] = {e for e in edges if e in modules and e != name and e != "deepspec"}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert len(graph) > 40 and "deepspec.decoding.engine" in graph["deepspec.stages"] | graph["deepspec.eval.run"]
    assert cycles(graph) == []


def test_the_circle_finder_finds_a_function_level_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_the_protocol_and_the_shared_draft_pieces_sit_below_the_algorithms():
    """An algorithm folder, the trainer and the engine all import ``deepspec.algorithms.protocol``;
    it, and the shared pieces in ``deepspec.models``, import nothing above ``target`` / ``models``."""
    graph = import_graph()
    below = ("deepspec.target", "deepspec.models", "deepspec.utils")
    reached = _reachable(graph, "deepspec.algorithms.protocol")
    assert "deepspec.target.decoding" in reached
    assert sorted(m for m in reached if not m.startswith(below)) == []
    shared = [m for m in graph if m.startswith("deepspec.models")]
    assert "deepspec.models.draft_common" in shared
    assert sorted((m, e) for m in shared for e in graph[m] if not e.startswith(below)) == []


def test_an_algorithm_folder_imports_no_other_folder_nor_the_trainer_or_the_evaluation():
    graph = import_graph()
    folders = {m.split(".")[2] for m in graph if m.count(".") >= 3 and m.startswith("deepspec.algorithms.")}
    assert {"dspark", "eagle3", "ngram"} <= folders
    for name in folders:
        own = f"deepspec.algorithms.{name}"
        allowed = (own, "deepspec.algorithms.protocol", "deepspec.target", "deepspec.models", "deepspec.utils")
        modules = [m for m in graph if m == own or m.startswith(own + ".")]
        assert sorted((m, e) for m in modules for e in graph[m] if not e.startswith(allowed)) == []
