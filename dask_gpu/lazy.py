"""A package's public names, imported on first use (PEP 562) rather than with the package.

A package's `__init__` says where each public name lives; importing the package imports none of those modules.
So a body that imports `dask_gpu.body.current` does not load the worker's plugin or its ticket registry through
`dask_gpu/__init__`, `aisched --help` does not pay for Prefect and Dask, and a package's `__init__` is no floor
in an import circle. `from dask_gpu import current_devices` works as before: the name is imported when asked for,
then kept as an ordinary attribute.

    __getattr__, __dir__ = public_names(__name__, {"GPURequest": "dask_gpu.request", ...}, globals())
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def public_names(package: str, where: Mapping[str, str],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` of `package`, whose public names are `where`'s keys, each
    imported from the module it maps to. A name not in `where` is tried as a submodule (`dask_gpu.isolation`),
    as an eagerly importing package made its submodules attributes."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # once imported, an ordinary attribute
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *where})

    return __getattr__, __dir__
