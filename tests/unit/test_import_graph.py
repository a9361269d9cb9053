"""The package's import graph has no circle and its floors only point down, function-level imports
included."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "deepspec"


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its source (module top or inside a
    function). ``from deepspec.x import y`` counts as importing ``deepspec.x.y`` when that is a module,
    else ``deepspec.x``; relative imports are resolved against the importing module."""
    modules = {_module_name(p, package): p for p in package.rglob("*.py")}
    root = package.name
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
        graph[name] = {e for e in edges if e in modules and e != name and e != root}
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


# The floors of the package, from the ground up: a module may import its own floor and the floors
# below it, never one above. Each entry is (floor, module prefixes); a prefix names a module or a
# whole package, and every module of the package sits on exactly one floor. CONTRIBUTING.md's
# floor plan is drawn from this list (test_contributing_draws_the_floor_plan_from_the_list).
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("ground", ("deepspec.config", "deepspec.recipes", "deepspec.device", "deepspec.utils",
                "deepspec.registry_data", "deepspec.checkpoints")),
    ("target", ("deepspec.target",)),
    ("models and data", ("deepspec.models", "deepspec.data")),
    ("algorithms", ("deepspec.algorithms",)),
    ("decoding engine", ("deepspec.decoding",)),
    ("eval and export", ("deepspec.eval", "deepspec.export")),
    ("train and serve", ("deepspec.train", "deepspec.serve")),
    ("stages", ("deepspec.stages",)),
    ("demo", ("deepspec.demo",)),
    ("cli", ("deepspec.cli",)),
]


def floors_of(module: str, floors: list[tuple[str, tuple[str, ...]]]) -> list[int]:
    """The indices of the floors one of whose prefixes is ``module`` or a package above it."""
    return [i for i, (_, prefixes) in enumerate(floors)
            if any(module == p or module.startswith(p + ".") for p in prefixes)]


def upward_imports(graph: dict[str, set[str]], floors: list[tuple[str, tuple[str, ...]]]) -> list[str]:
    """Every import of a module on a higher floor than the importer's, as ``"a (floor) -> b (floor)"``;
    modules on no floor or on several are left to :func:`unplaced`."""
    found = []
    for module in sorted(graph):
        here = floors_of(module, floors)
        for imported in sorted(graph[module]):
            there = floors_of(imported, floors)
            if len(here) == 1 and len(there) == 1 and there[0] > here[0]:
                found.append(f"{module} ({floors[here[0]][0]}) -> {imported} ({floors[there[0]][0]})")
    return found


def unplaced(graph: dict[str, set[str]], floors: list[tuple[str, tuple[str, ...]]], root: str = "deepspec") -> list[str]:
    """The modules (the package's own ``__init__`` aside) on no floor or on more than one."""
    return sorted(m for m in graph if m != root and len(floors_of(m, floors)) != 1)


def floor_plan(floors: list[tuple[str, tuple[str, ...]]] = FLOORS, package: Path = PACKAGE) -> str:
    """The floors as CONTRIBUTING.md draws them: the top floor first, each with its files and folders."""
    lines = []
    for name, prefixes in reversed(floors):
        paths = []
        for prefix in prefixes:
            relative = Path(*prefix.split(".")[1:])
            paths.append(f"{relative}/" if (package / relative).is_dir() else f"{relative}.py")
        lines.append(f" {name:<17}{'  '.join(paths)}".rstrip())
    return "\n".join(lines)


def test_every_module_sits_on_exactly_one_floor():
    graph = import_graph()
    assert {"deepspec.checkpoints", "deepspec.target.few_row_linear", "deepspec.decoding.engine",
            "deepspec.serve.openai_server", "deepspec.algorithms.dspark.compiled"} <= set(graph)
    assert unplaced(graph, FLOORS) == []


def test_no_import_points_up_a_floor():
    """Module top and function-level imports alike: the floors read as a building, each standing
    only on what is below it."""
    assert upward_imports(import_graph(), FLOORS) == []


def test_the_floor_check_finds_an_upward_function_level_import_and_an_unplaced_module(tmp_path):
    package = tmp_path / "deepspec"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("")
    (package / "low" / "a.py").write_text("def f():\n    from deepspec.high import g\n    return g\n")
    (package / "high.py").write_text("from deepspec.low.a import f\ng = f\n")
    (package / "stray.py").write_text("")
    floors = [("low", ("deepspec.low",)), ("high", ("deepspec.high",))]
    graph = import_graph(package)
    assert graph["deepspec.low.a"] == {"deepspec.high"}
    assert upward_imports(graph, floors) == ["deepspec.low.a (low) -> deepspec.high (high)"]
    assert unplaced(graph, floors) == ["deepspec.stray"]
    assert unplaced(graph, floors + [("both", ("deepspec.low.a", "deepspec.stray"))]) == ["deepspec.low.a"]


def test_contributing_draws_the_floor_plan_from_the_list():
    contributing = (PACKAGE.parent / "CONTRIBUTING.md").read_text(encoding="utf-8")
    assert floor_plan() in contributing
