"""A name -> function table for pluggable algorithm pieces (advantage estimators, policy losses).

Owns registration, lookup and the error that lists the known names. Imports nothing from hfjax.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Functions registered by name; `kind` (e.g. "advantage estimator") names the table in errors."""

    def __init__(self, kind: str):
        self.kind = kind
        self._table: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator adding a function under `name`; registering a different function under a taken name fails."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def add(fn: F) -> F:
            known = self._table.get(name)
            if known is not None and known is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered to {known.__module__}.{known.__name__}")
            self._table[name] = fn
            return fn

        return add

    def get(self, name: str) -> F:
        """The function registered under `name`; an unknown name raises ValueError listing the known ones."""
        try:
            return self._table[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._table)
