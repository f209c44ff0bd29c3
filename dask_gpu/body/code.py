"""What code a body runs, and how it travels: a digest of a function, and a module shipped as its source.

Two ways code reaches a worker:

- **As source** (`ShippedCode`): a function or class defined at module level of a module the worker cannot import
  by name (a flow file, a deployment's entrypoint, a project checkout) travels as the source text of everything
  the body can import of its project (dask_gpu.body.shiptree: a regular package whole; a flow file with what it
  imports from its folder, inside functions too), as Ray's `runtime_env` ships a working directory; in the body
  nothing un-shipped is imported beside it. The body imports
  them from that text (`load`) and names the callable in them, so module-level locks, clients and models are
  created on the worker, once per body, never pickled. Its digest covers every file and the callable's name, so
  the control plane can compute it from the bytes it forwards and the body checks it before running anything.
- **Pickled** (cloudpickle): everything else, by reference where the worker has the module (an installed package)
  and by value where it cannot (a closure, a lambda, a function of `__main__`). `code_digest` then hashes what will
  run: bytecode, defaults, closure values and what the function reads from its module.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.util
import os
import sys
import types
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from dask_gpu.body import shiptree
from dask_gpu.errors import ShippedCodeTooLarge

SOURCE_MAGIC = b"aisched-source/1\n"
OWN_PACKAGES = frozenset({"dask_gpu", "aisched_prefect", "blocks"})  # what the worker runs: never shipped
MAX_FILES = 1000  # module files of one project shipped with a call: past it, ShippedCodeTooLarge
MAX_BYTES = 8 * 2**20  # their text (a call is at most AISCHED_MAX_CALL_BYTES, 32 MiB by default)
BODY_ATTR = "__aisched_body__"  # an @ai_task's function carries its body under this name (aisched_prefect.flow.task)


def _norm(value: Any) -> Any:
    """A stable stand-in for a constant (frozensets print in hash order, which varies by process)."""
    if isinstance(value, (frozenset, set)):
        return ("set", sorted(repr(_norm(v)) for v in value))
    if isinstance(value, tuple):
        return tuple(_norm(v) for v in value)
    if isinstance(value, types.CodeType):
        return ("code", _code_bytes(value).hex())
    return value


def _code_bytes(code: types.CodeType) -> bytes:
    h = hashlib.sha256()
    h.update(code.co_code)
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars, code.co_argcount,
                   code.co_kwonlyargcount)).encode())
    h.update(repr(tuple(_norm(c) for c in code.co_consts)).encode())
    return h.digest()


def code_digest(fn: Any) -> str:
    """What will run, as a hash: the function's name, bytecode (nested functions included), default arguments,
    closure values, and what it reads by name from its own module (functions, classes and their methods, plain
    constants), recursively.

    The same function gives the same digest in every process of the same Python:

    >>> def f(x, k=2): return {1, 2} | {x * k}
    >>> code_digest(f) == code_digest(f)
    True
    >>> def g(x, k=3): return {1, 2} | {x * k}
    >>> code_digest(f) != code_digest(g)
    True
    """
    h = hashlib.sha256()
    if isinstance(fn, type):  # a callable class (constructed once per body, called per run)
        h.update(f"class {fn.__module__}.{fn.__qualname__}".encode())
        _class_feed(h, fn, {id(fn)}, 0)
    else:
        _feed(h, fn, set(), 0)
    return h.hexdigest()


def _value(value: Any) -> bytes:
    """A process-independent stand-in for a default or closure value (objects by type: their repr holds addresses)."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value).encode()
    if isinstance(value, (tuple, list, frozenset, set)):
        return repr(_norm(tuple(value) if not isinstance(value, (set, frozenset)) else frozenset(value))).encode()
    if isinstance(value, dict):
        return repr(sorted((repr(k), _value(v)) for k, v in value.items())).encode()
    return f"<{type(value).__module__}.{type(value).__qualname__}>".encode()


def _feed(h: Any, fn: Any, seen: set[int], depth: int) -> None:
    fn = getattr(fn, "__wrapped__", fn) if not hasattr(fn, "__code__") else fn
    h.update(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}".encode())
    code = getattr(fn, "__code__", None)
    if code is None or id(fn) in seen or depth > 8:
        return
    seen.add(id(fn))
    h.update(_code_bytes(code))
    for value in (getattr(fn, "__defaults__", None) or ()):
        h.update(_value(value))
    for key, value in sorted((getattr(fn, "__kwdefaults__", None) or {}).items()):
        h.update(key.encode() + _value(value))
    for cell in (getattr(fn, "__closure__", None) or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(value) and hasattr(value, "__code__"):
            _feed(h, value, seen, depth + 1)
        else:
            h.update(_value(value))
    module = getattr(fn, "__module__", None)
    scope = getattr(fn, "__globals__", {})
    for name in _global_names(code):  # what it reads from its own module: changing one changes what runs
        value = scope.get(name)
        if value is None and name not in scope:
            continue
        if isinstance(value, type) and value.__module__ == module and id(value) not in seen:
            seen.add(id(value))
            h.update(f"class {name}".encode())
            _class_feed(h, value, seen, depth)
        elif callable(value) and hasattr(value, "__code__"):
            if getattr(value, "__module__", None) == module:
                _feed(h, value, seen, depth + 1)
        elif not isinstance(value, types.ModuleType) and _plain(value):
            h.update(f"{name}=".encode() + _value(value))


def _plain(value: Any) -> bool:
    """Data a body can read as a constant (numbers, text, and containers of them), not an object with identity."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return True
    if isinstance(value, (tuple, list, frozenset, set)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


def _global_names(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _global_names(const)
    return sorted(set(names))


def _class_feed(h: Any, cls: type, seen: set[int], depth: int) -> None:
    """A class's methods and plain attributes (a class a body reads, or one used as the body: a callable class)."""
    for attr, member in sorted(vars(cls).items()):
        member = getattr(member, "__func__", member)  # staticmethod, classmethod
        if hasattr(member, "__code__"):
            _feed(h, member, seen, depth + 1)
        elif not attr.startswith("__"):
            h.update(attr.encode() + _value(member))


# -- code as source ---------------------------------------------------------------------------------------------
class SourceFile(BaseModel):
    """One module's source, as the flow process read it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    module: str = Field(min_length=1, max_length=300)
    source: str
    origin: str = ""  # its path on the flow's host (tracebacks, and `__file__`)
    package: bool = False  # an `__init__.py`


class ShippedCode(BaseModel):
    """A callable named in modules that travel as source: what a body imports and runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    module: str
    qualname: str
    files: tuple[SourceFile, ...]

    def digest(self) -> str:
        """sha256 of every file's name and text and of the callable's name (not of where the files were)."""
        h = hashlib.sha256()
        h.update(f"{self.module}\0{self.qualname}\0".encode())
        for f in sorted(self.files, key=lambda f: f.module):
            h.update(f"{f.module}\0{int(f.package)}\0{len(f.source)}\0".encode())
            h.update(f.source.encode())
        return h.hexdigest()

    def encode(self) -> bytes:
        """The marker, the code as one line of JSON, a newline: a body's arguments follow."""
        return SOURCE_MAGIC + self.model_dump_json().encode() + b"\n"


def split(data: bytes) -> tuple[ShippedCode | None, int]:
    """The shipped code at the start of a body's bytes and where what follows it (the arguments) begins;
    (None, 0) where the function was pickled."""
    if not data.startswith(SOURCE_MAGIC):
        return None, 0
    end = data.find(b"\n", len(SOURCE_MAGIC))
    end = len(data) if end < 0 else end
    return ShippedCode.model_validate_json(data[len(SOURCE_MAGIC):end]), min(end + 1, len(data))


def shipped_digest(fn_bytes: bytes) -> str | None:
    """The digest of a function's bytes that are shipped code (what the control plane checks), else None."""
    code, _ = split(fn_bytes)
    return code.digest() if code is not None else None


def _installed(module: types.ModuleType) -> bool:
    """A module the worker imports by name: the standard library, an installed package, or this project's own."""
    name = module.__name__.split(".", 1)[0]
    if name in OWN_PACKAGES or name in sys.builtin_module_names:
        return True
    path = getattr(module, "__file__", None) or ""
    return not path or "site-packages" in path or "dist-packages" in path or path.startswith(
        (sys.base_prefix + os.sep, sys.prefix + os.sep))


def _resolve(module: types.ModuleType, qualname: str) -> Any:
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def unwrap(obj: Any) -> Any:
    """The body an object names: an @ai_task (a Prefect task) gives its declared function or class."""
    fn = getattr(obj, "fn", None)
    if fn is not None and not isinstance(obj, type):
        return getattr(fn, BODY_ATTR, fn)
    return obj


def _source(module: types.ModuleType, name: str | None = None) -> SourceFile | None:
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError):
        return None
    return SourceFile(module=name or module.__name__, source=text, origin=os.path.abspath(path),
                      package=os.path.basename(path) == "__init__.py")


def _uses(module: types.ModuleType) -> list[types.ModuleType]:
    """The modules a module's globals come from (imported modules, and the modules of imported names)."""
    out = []
    for value in list(vars(module).values()):
        name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        found = sys.modules.get(name) if isinstance(name, str) else None
        if found is not None and found is not module:
            out.append(found)
    return out


def _project_of(module: types.ModuleType, name: str) -> Callable[[types.ModuleType], bool]:
    """Which modules belong with `module` (named `name`): its own top-level package, or (a top-level module) its own
    folder."""
    top = name.split(".", 1)[0]
    folder = os.path.dirname(os.path.abspath(getattr(module, "__file__", "") or ""))

    def mine(m: types.ModuleType) -> bool:
        if _installed(m) or m.__name__ == "__main__":
            return False
        if "." in name or hasattr(module, "__path__"):
            return m.__name__.split(".", 1)[0] == top
        return "." not in m.__name__ and os.path.dirname(os.path.abspath(getattr(m, "__file__", "") or "")) == folder

    return mine


def ship(fn: Any) -> ShippedCode | None:
    """`fn` as shipped source, or None where it must be pickled (a closure, a lambda, `__main__`, an installed
    module, a module whose file cannot be read, or a name in its module that is not `fn`).

    What ships is everything the body can import of the project (dask_gpu.body.shiptree): a task in a regular package
    ships its top-level package whole; one in a flow file or a namespace package ships what its source imports
    from its own folder or namespace, inside functions too, transitively. Raises ShippedCodeTooLarge past
    MAX_FILES files or MAX_BYTES."""
    qualname = getattr(fn, "__qualname__", "") or ""
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    if not qualname or "<" in qualname or module is None or _installed(module):
        return None
    name = module.__name__
    if name == "__main__":  # `python -m pkg.mod`: shipped under its own name (its `__main__` block does not run)
        spec = getattr(module, "__spec__", None)
        name = getattr(spec, "name", None) or ""
        if not name or name == "__main__":
            return None  # a script run as `python FILE`: importing it could run it all again, so it is pickled
    if unwrap(_resolve(module, qualname)) is not fn:
        return None
    own = _source(module, name)
    if own is None:
        return None
    files = _Files(name)
    top = sys.modules.get(name.split(".", 1)[0])
    if "." in name and top is not None and getattr(top, "__file__", None) and not _installed(top):
        for mod, path, package in shiptree.package_files(top.__name__, list(getattr(top, "__path__", []))):
            src = _read(mod, path, package)
            if src is not None:
                files.add(src)
        if name not in files.files:
            files.add(own)
    else:
        _ship_imported(module, name, own, files)
    return ShippedCode(module=name, qualname=qualname, files=tuple(files.files.values()))


class _Files:
    """The files shipped so far, within the limits on what travels with every call."""

    def __init__(self, name: str) -> None:
        self.name, self.size = name, 0
        self.files: dict[str, SourceFile] = {}

    def add(self, src: SourceFile) -> None:
        if src.module in self.files:
            return
        self.size += len(src.source)
        self.files[src.module] = src
        if len(self.files) > MAX_FILES or self.size > MAX_BYTES:
            top = self.name.split(".", 1)[0]
            raise ShippedCodeTooLarge(
                f"the code of task module {self.name!r} ships as source with every call, and its project "
                f"({top!r}) has more than {MAX_FILES} module files or {MAX_BYTES // 2**20} MiB of them "
                f"({len(self.files)} files, {self.size} bytes so far). Fix: install the large part on the workers as "
                f"a package (pip install), so it is the worker's environment and is not shipped, or move the task "
                f"into a smaller package")


def _read(module: str, path: str, package: bool) -> SourceFile | None:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError):
        return None
    return SourceFile(module=module, source=text, origin=os.path.abspath(path), package=package)


def _ship_imported(module: types.ModuleType, name: str, own: SourceFile, files: _Files) -> None:
    """A flow file's folder, or a namespace package: what the task's module imports of it, at import time or
    inside a function (read from the source), transitively."""
    top_name = name.split(".", 1)[0]
    top = sys.modules.get(top_name)
    namespace = "." in name and top is not None and hasattr(top, "__path__")
    portions = [os.path.abspath(p) for p in getattr(top, "__path__", [])] if namespace else []
    folder = os.path.dirname(own.origin)
    mine = _project_of(module, name)

    def where(candidate: str) -> tuple[str, bool] | None:
        if candidate.split(".", 1)[0] in OWN_PACKAGES:
            return None
        if namespace:
            return shiptree.find_in(candidate, portions) if candidate.split(".", 1)[0] == top_name else None
        path = os.path.join(folder, candidate + shiptree.PY)
        return (path, False) if "." not in candidate and os.path.isfile(path) else None

    if namespace:  # the namespace itself: an empty package in the body (it has no file of its own)
        files.add(SourceFile(module=top_name, source="", package=True))
    todo = [own]
    while todo:
        src = todo.pop()
        if src.module in files.files:
            continue
        files.add(src)
        names = shiptree.imported_names(src.source, src.module, src.package)
        names |= shiptree.parents(src.module)  # importing `a.b.c` imports `a.b` first: its `__init__` ships too
        loaded = sys.modules.get(src.module) if src is not own else module
        names |= {m.__name__ for m in (_uses(loaded) if loaded is not None else ()) if mine(m)}
        for candidate in sorted(names - set(files.files)):
            found = where(candidate)
            if found is not None:
                nxt = _read(candidate, *found)
                if nxt is not None:
                    todo.append(nxt)


MAX_PRELOADS = 64  # the most module names a body asks its zygote to import first (aisched_prefect.wire's bound)


def preloads(code: ShippedCode, limit: int = MAX_PRELOADS) -> list[str]:
    """The installed modules the shipped ones use (torch, prefect.flows, ...): what the worker's zygote imports once,
    so a fresh body does not pay those imports.

    Full dotted names, not packages' tops: a package imports little of itself (`import prefect` leaves
    `prefect.flows` and `prefect.client.schemas` to the first `from prefect import flow`), so a body forked after
    only the tops paid 0.9 s of CPU importing the rest for the batch-inference example. Names come from what the
    shipped sources import (anywhere in them) and from where their module-level names were defined; those this
    process has imported from an installed package, the deepest of each chain (importing `a.b.c` imports `a.b`)."""
    shipped = {f.module for f in code.files}
    names: set[str] = set()
    for f in code.files:
        names |= shiptree.imported_names(f.source, f.module, f.package)
        module = sys.modules.get(f.module)
        names.update(used.__name__ for used in (_uses(module) if module is not None else ()))
    found = {n for n in names if n not in shipped and isinstance(sys.modules.get(n), types.ModuleType)
             and n.split(".", 1)[0] not in sys.stdlib_module_names and not n.startswith("_")
             and _installed(sys.modules[n])}
    deepest = sorted(n for n in found if not any(other.startswith(n + ".") for other in found))
    return deepest[:limit]


def shipped_modules(code: ShippedCode) -> set[str]:
    return {f.module for f in code.files}


class _ShippedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports the shipped modules from their text, before anything on the worker's path of the same name, and
    refuses what was not shipped beside them (dask_gpu.body.shiptree.closed): a module of a shipped package, or a plain
    module of a shipped flow file's folder, found on the worker's path would be code nobody admitted."""

    def __init__(self, files: tuple[SourceFile, ...]) -> None:
        self.files = {f.module: f for f in files}
        self.tops = frozenset(f.module.split(".", 1)[0] for f in files if "." in f.module or f.package)
        self.folders = frozenset(os.path.dirname(f.origin) for f in files
                                 if "." not in f.module and not f.package and f.origin)

    def closed(self, name: str) -> bool:
        return name not in self.files and shiptree.closed(name, self.tops, self.folders, OWN_PACKAGES)

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        f = self.files.get(name)
        if f is None:
            if self.closed(name):
                raise ModuleNotFoundError(
                    f"module {name!r} was not shipped with this task's code, so the body does not import it from the "
                    "worker's path. Fix: keep it in the task's package (a package ships whole) or import it from the "
                    "task's module, or install it on the workers as a package", name=name)
            return None
        return importlib.util.spec_from_loader(name, self, origin=f.origin or None, is_package=f.package)

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        import linecache

        f = self.files[module.__name__]
        filename = f.origin or f"<aisched-shipped {f.module}>"
        module.__file__ = filename
        if f.package:  # kept for data files read beside the code; an un-shipped module there is refused above
            module.__path__ = [os.path.dirname(f.origin)] if f.origin else []
        lines = f.source.splitlines(keepends=True)
        linecache.cache[filename] = (len(f.source), None, lines, filename)  # tracebacks show the shipped lines
        exec(compile(f.source, filename, "exec"), module.__dict__)


def load(code: ShippedCode) -> Any:
    """Import the shipped modules (once per process) and return the callable they name (an @ai_task's body)."""
    finder = _ShippedFinder(code.files)
    for name in list(sys.modules):  # a same-named module from the worker's path is not what was admitted
        if name in finder.files or name.split(".", 1)[0] in finder.tops:
            sys.modules.pop(name, None)
    sys.meta_path.insert(0, finder)
    module = importlib.import_module(code.module)
    obj = unwrap(_resolve(module, code.qualname))
    if obj is None:
        raise ImportError(f"{code.module} has no {code.qualname}: the shipped source does not define it")
    return obj
