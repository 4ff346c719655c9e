"""A name -> function table for pluggable algorithm pieces (advantage estimators, policy losses), open to user code:
wherever a registered name is accepted, so is `path/to/file.py:function` (loaded through `hfjax.user_code`).

Owns registration, lookup, the signature check a table applies to every function it serves, and the config-load
validation of a name or spec (`resolve`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from hfjax.typed_config import check_name
from hfjax.user_code import absolute_spec, is_spec, load_callable

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Functions registered by name; `kind` (e.g. "advantage estimator") names the table in errors. `check(label,
    fn)` raises ValueError when `fn` cannot serve in this table; it runs on every registration and every function
    loaded from a `path.py:name` spec."""

    def __init__(self, kind: str, check: Callable[[str, F], None]):
        self.kind = kind
        self._check = check
        self._table: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator adding a function under `name`; registering a different function under a taken name fails."""
        if not isinstance(name, str) or not name or is_spec(name):
            raise ValueError(f"{self.kind} name must be a non-empty string, not a file spec, got {name!r}")

        def add(fn: F) -> F:
            known = self._table.get(name)
            if known is not None and known is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered to {known.__module__}.{known.__name__}")
            self._check(name, fn)
            self._table[name] = fn
            return fn

        return add

    def get(self, name: str) -> F:
        """The function registered under `name`, or the user function `name` = `path.py:function` names (checked);
        an unknown name raises ValueError listing the known ones."""
        if isinstance(name, str) and is_spec(name):
            fn = load_callable(name, self.kind)
            self._check(name, fn)
            return fn
        try:
            return self._table[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}") from None

    def resolve(self, field: str, value: str) -> str:
        """`value` of config field `field` as the config keeps it: a registered name as it is, or a `path.py:name`
        spec made absolute (workers may run in another directory) once its function loaded and passed the check.
        Raises ValueError starting with `field` otherwise."""
        if not is_spec(value):
            check_name(field, value, [*self.names(), "path/to/file.py:function"], self.kind)
            return value
        try:
            self.get(value)
            return absolute_spec(value, self.kind)
        except ValueError as exc:
            raise ValueError(f"{field}: {exc}") from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._table)
