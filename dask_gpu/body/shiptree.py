"""Which module files of a project travel with a task's code, and which names a body may then not import.

Code identity is everything the body can import of the shipped code (issue 39), not only what the task's module
referenced when the flow imported it: a helper imported inside the task function runs too.

- A task in a **regular package** (a folder with `__init__.py`) ships its top-level package whole: every module file
  of it, subpackages included (Ray's `runtime_env` ships a working directory the same way).
- A task in a **top-level module** (a flow file) or a **namespace package** (no `__init__.py`, e.g. a `tests`
  folder) ships the modules it imports from its own folder or namespace, anywhere in their source (inside a
  function too, read from the source text, not only what import time left in `sys.modules`), transitively.
- In the body the shipped code is **closed**: a module of a shipped package, or a plain module of a shipped module's
  folder, that was not shipped cannot be imported (`closed_names`), so code a person never approved cannot run beside
  approved code on a worker that happens to have the same path (a shared checkout or image).

Installed third-party packages stay the worker's environment and are never shipped.
"""

from __future__ import annotations

import ast
import functools
import os
from collections.abc import Iterable, Iterator

PY = ".py"


def _identifier(name: str) -> bool:
    return name.isidentifier() and not name.startswith(".")


def package_files(top: str, folders: Iterable[str]) -> Iterator[tuple[str, str, bool]]:
    """Every module file of the regular package `top` at `folders` (its `__path__`): (module, path, is_package)."""
    for root in folders:
        root = os.path.abspath(root)
        for here, dirs, names in os.walk(root):
            rel = os.path.relpath(here, root)
            parts = [] if rel == "." else rel.split(os.sep)
            # Only regular subpackages: a folder without `__init__.py` (data, docs, a venv) is not module code.
            dirs[:] = sorted(d for d in dirs if _identifier(d) and os.path.isfile(os.path.join(here, d, "__init__.py")))
            for n in sorted(names):
                stem = n[:-len(PY)]
                if not n.endswith(PY) or not _identifier(stem):
                    continue
                if stem == "__init__":
                    yield ".".join([top, *parts]), os.path.join(here, n), True
                else:
                    yield ".".join([top, *parts, stem]), os.path.join(here, n), False


@functools.lru_cache(maxsize=4096)
def imported_names(source: str, module: str, is_package: bool) -> frozenset[str]:
    """The absolute module names a module's source imports anywhere (top level or inside a function), with
    `from a import b` giving both `a` and `a.b` (b may be a submodule); relative imports resolved.

    Kept per text: a flow process ships (and names the preloads of) the same sources at every flow run, and parsing
    them took 10 ms or more of each run's start."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return frozenset()
    base = module.split(".") if is_package else module.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                stem = base[:len(base) - (node.level - 1)] if node.level - 1 <= len(base) else []
                if not stem:
                    continue
                name = ".".join(stem + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if not name:
                continue
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names if a.name != "*")
    # every parent of a dotted name is imported with it
    return frozenset(out.union(*(parents(n) for n in out)))


def parents(name: str) -> set[str]:
    """The packages above a dotted module name: `a.b.c` -> {`a`, `a.b`}."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def find_in(name: str, top_folders: list[str]) -> tuple[str, bool] | None:
    """The file of module `name` (a dotted name under a namespace package whose portions are `top_folders`), by
    path alone (nothing is imported): (path, is_package), or None."""
    parts = name.split(".")[1:]
    for root in top_folders:
        base = os.path.join(root, *parts)
        if os.path.isfile(os.path.join(base, "__init__.py")):
            return os.path.join(base, "__init__.py"), True
        if parts and os.path.isfile(base + PY):
            return base + PY, False
    return None


def closed(name: str, tops: frozenset[str], folders: frozenset[str], own: frozenset[str]) -> bool:
    """Whether a body may not import `name`, un-shipped: a module of a shipped package (`tops`), or a plain
    module found in a shipped module's folder (`folders`). The worker's own packages are never closed."""
    top = name.split(".", 1)[0]
    if top in own:
        return False
    if top in tops:
        return True
    if "." in name or not folders:
        return False
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec(name)
    origin = getattr(spec, "origin", None) if spec is not None else None
    if not origin or spec is None or spec.submodule_search_locations is not None:
        return False  # a package beside the flow file is a unit of its own (shipped whole when the task is in it)
    return os.path.dirname(os.path.abspath(origin)) in folders
