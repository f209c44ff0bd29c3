"""The house's shape, read from the source (ast only: nothing of the project is run, no server).

- What a body may reach: a module under `dask_gpu/body/` runs inside a body, beside a tenant's code. It must not
  import, directly or through any module of the project it imports (at import time or inside a function, and the
  packages above each), anything that holds a key or a ticket registry: the worker's and the scheduler's folders,
  the tickets, the security and the gate modules, the Slurm scaler, the control plane, the ledger, the CLI.
- Sizes: no folder over 15 modules (`__init__` not counted), no module over 600 lines, no class over 300 lines.
- No import circle: the modules' top-level imports (not those inside functions or under TYPE_CHECKING), with the
  packages above each module imported, form no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dask_gpu", "aisched_prefect")

BODY = "dask_gpu.body"
# What holds a key or a ticket registry: a module named here, or any module below it.
BODY_MAY_NOT_REACH = (
    "dask_gpu.worker",
    "dask_gpu.scheduler",
    "dask_gpu.tickets",
    "dask_gpu.security",
    "dask_gpu.gate",
    "dask_gpu.slurm.scaler",
    "aisched_prefect.control",
    "aisched_prefect.ledger",
    "aisched_prefect.cli",
)

MAX_MODULES_IN_A_FOLDER = 15
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the project's packages: dotted name -> file (a package is its `__init__.py`)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def lazy_names(tree: ast.Module) -> dict[str, str]:
    """A package's names imported on first use (dask_gpu.lazy): `_WHERE = {name: module}`, or
    `_FROM = {module: "name name ..."}`, as literals."""
    names: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target = node.targets[0].id
            if target not in ("_WHERE", "_FROM") or not isinstance(node.value, ast.Dict):
                continue
            try:
                table = ast.literal_eval(node.value)
            except ValueError:
                continue
            if target == "_WHERE":
                names.update(table)
            else:
                names.update({name: module for module, text in table.items() for name in text.split()})
    return names


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(tree: ast.Module, top_level_only: bool) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Import statements, with whether each runs at import time. TYPE_CHECKING blocks never run; with
    `top_level_only`, imports inside a function or class body are left out."""
    found = []

    def walk(node: ast.AST, at_import: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and is_type_checking(child):
                for other in child.orelse:
                    walk_one(other, at_import)
                continue
            walk_one(child, at_import)

    def walk_one(child: ast.AST, at_import: bool) -> None:
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            found.append((child, at_import))
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            if not top_level_only:
                walk(child, False)
        else:
            walk(child, at_import)

    walk(tree, True)
    return found


def with_packages(name: str) -> list[str]:
    """`a.b.c` -> [`a`, `a.b`, `a.b.c`]: importing a module runs each package above it first."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


class Graph:
    """The project's imports between its own modules, read from the source."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self.trees = {name: ast.parse(path.read_text(), str(path)) for name, path in files.items()}
        self.lazy = {name: lazy_names(tree) for name, tree in self.trees.items() if files[name].name == "__init__.py"}

    def resolve(self, importer: str, node: ast.Import | ast.ImportFrom, own_packages: bool = True) -> set[str]:
        """The project's modules one import statement runs: each named module, the packages above it, and for
        `from package import name` the submodule or, for a lazy public name, the module it lives in.

        Without `own_packages`, a package above the importer counts only where the statement reads a name of its
        own (`from package import NAME`, not a submodule): Python runs a module's packages before the module, so
        `from a.b import c` inside `a.b.d` waits for nothing of `a.b`'s that is not there already."""
        targets: set[str] = set()
        needed: set[str] = set()
        if isinstance(node, ast.Import):
            for alias in node.names:
                targets.update(with_packages(alias.name))
        else:
            base = node.module or ""
            if node.level:
                package = importer if self.files[importer].name == "__init__.py" else importer.rpartition(".")[0]
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            targets.update(with_packages(base))
            for alias in node.names:
                if f"{base}.{alias.name}" in self.files:
                    targets.add(f"{base}.{alias.name}")
                elif alias.name in self.lazy.get(base, {}):
                    targets.update(with_packages(self.lazy[base][alias.name]))
                else:
                    needed.add(base)
        if not own_packages:
            targets -= set(with_packages(importer)) - needed
        return {t for t in targets if t in self.files and t != importer}

    def edges(self, top_level_only: bool, own_packages: bool = True) -> dict[str, set[str]]:
        return {name: {target for node, _ in imports_of(tree, top_level_only)
                       for target in self.resolve(name, node, own_packages)}
                for name, tree in self.trees.items()}


def reach(edges: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every module `start` brings in, each with one path of imports that brings it."""
    paths = {start: [start]}
    todo = [start]
    while todo:
        here = todo.pop()
        for there in sorted(edges.get(here, ())):
            if there not in paths:
                paths[there] = [*paths[here], there]
                todo.append(there)
    return paths


def forbidden_for_body(files: dict[str, Path]) -> list[str]:
    """'body module -> ... -> forbidden module' for each forbidden module a body module reaches."""
    graph = Graph(files)
    edges = graph.edges(top_level_only=False)
    found = []
    for name in sorted(files):
        if name != BODY and not name.startswith(BODY + "."):
            continue
        for target, path in sorted(reach(edges, name).items()):
            if forbidden(target) and not any(forbidden(step) for step in path[:-1]):  # the first on each chain
                found.append(" -> ".join(path))
    return found


def forbidden(module: str) -> bool:
    return any(module == bad or module.startswith(bad + ".") for bad in BODY_MAY_NOT_REACH)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for there in edges.get(node, ()):
            if there not in index:
                visit(there)
                low[node] = min(low[node], low[there])
            elif there in on_stack:
                low[node] = min(low[node], index[there])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


@pytest.fixture(scope="module")
def files() -> dict[str, Path]:
    return module_files()


def test_the_graph_sees_the_body_and_its_imports(files):
    # The checks below are only as good as the graph: it must find the body's modules and what they import.
    assert "dask_gpu.body.child" in files and "dask_gpu.worker.plugin" in files
    edges = Graph(files).edges(top_level_only=False)
    assert "dask_gpu.body.code" in edges["dask_gpu.body.child"]
    assert {"dask_gpu", "dask_gpu.body"} <= edges["dask_gpu.body.child"]
    assert "dask_gpu.worker.plugin" in reach(edges, "dask_gpu.worker.execute")


def test_a_body_reaches_nothing_that_holds_a_key_or_a_ticket_registry(files):
    found = forbidden_for_body(files)
    assert not found, ("modules under dask_gpu/body/ run beside a tenant's code and must not import what holds a key "
                       "or a ticket registry; these import chains do:\n" + "\n".join(found))


def test_the_body_check_fails_on_a_forbidden_import_however_deep(tmp_path):
    # A flat copy of the rule's shape: a body module importing a helper that imports the ticket registry.
    (tmp_path / "dask_gpu" / "body").mkdir(parents=True)
    (tmp_path / "aisched_prefect").mkdir()
    (tmp_path / "dask_gpu" / "__init__.py").write_text('_FROM = {"dask_gpu.tickets": "TicketRegistry"}\n')
    (tmp_path / "dask_gpu" / "body" / "__init__.py").write_text("")
    (tmp_path / "aisched_prefect" / "__init__.py").write_text("")
    (tmp_path / "dask_gpu" / "tickets.py").write_text("KEY = 1\n")
    (tmp_path / "dask_gpu" / "helper.py").write_text("def f():\n    from dask_gpu import TicketRegistry\n")
    (tmp_path / "dask_gpu" / "body" / "child.py").write_text("from .. import helper\n")
    assert forbidden_for_body(module_files(tmp_path)) == [
        "dask_gpu.body.child -> dask_gpu.helper -> dask_gpu.tickets"]


def test_no_folder_holds_more_than_15_modules(files):
    counts: dict[str, int] = {}
    for path in files.values():
        if path.name != "__init__.py":
            folder = str(path.parent.relative_to(ROOT))
            counts[folder] = counts.get(folder, 0) + 1
    assert {f: n for f, n in counts.items() if n > MAX_MODULES_IN_A_FOLDER} == {}


def test_no_module_over_600_lines_and_no_class_over_300(files):
    long_modules = {}
    long_classes = {}
    for name, path in files.items():
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long_modules[name] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long_classes[f"{name}.{node.name}"] = node.end_lineno - node.lineno + 1
    assert long_modules == {} and long_classes == {}


def test_no_import_circle_at_import_time(files):
    found = cycles(Graph(files).edges(top_level_only=True, own_packages=False))
    assert found == [], "modules that import each other at import time (directly or around a circle):\n" + "\n".join(
        " ".join(c) for c in found)


def test_the_circle_check_sees_a_circle_through_a_package():
    edges = {"a": {"a.b"}, "a.b": {"a", "a.c"}, "a.c": set()}
    assert cycles(edges) == [["a", "a.b"]]
