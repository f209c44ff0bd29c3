"""Named errors for the isolation modules, each an `IsolationError`, made on first use.

Why lazily: `dask_gpu.isolation` (where IsolationError lives) may come to
import these modules, so they must not import it at their own import time.
A module lists its errors with `lazy_errors` and sets the result as its
`__getattr__` (PEP 562): `from dask_gpu.isolation.cleanup import RemovalError`
and `except cleanup.RemovalError` see one class, made once.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

_lock = threading.Lock()


def lazy_errors(module: str, docs: dict[str, str]) -> Callable[[str], type]:
    """A module `__getattr__` that makes each error named in `docs` (name -> docstring) on first access."""

    def get(name: str) -> type:
        if name not in docs:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        mod = sys.modules[module]
        with _lock:
            cls = mod.__dict__.get(name)
            if cls is None:
                from dask_gpu.isolation import IsolationError

                cls = type(name, (IsolationError,), {"__doc__": docs[name], "__module__": module, "__qualname__": name})
                setattr(mod, name, cls)
        return cls

    return get
