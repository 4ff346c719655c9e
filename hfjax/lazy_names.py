"""A package's public names loaded on first use: a package `__init__` that sets
`__getattr__ = lazy_names(__name__, {"Name": "module", ...})` imports `module` only when `package.Name` is read, so
importing one of its modules does not import the others' dependencies."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """The module `__getattr__` of `package` that resolves each name of `exports` (name -> submodule)."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    return __getattr__
