"""User code named in a config as `path/to/file.py:name` (reward functions, algorithm programs, advantage estimators,
policy losses): the spec's format, its absolute form, loading the file and fetching the name, and checking that the
object can be called as hfjax will call it.

A file is executed once per version (its path and modification time), so a config check, the controller and a worker
thread of one process share one module. Other processes (Ray workers) load the file themselves: pass them the spec
made absolute by `absolute_spec`, since their working directory may differ. Every error is a `UserCodeError` naming
what the object is for and the spec.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

SPEC_FORMAT = "'path/to/file.py:function_name'"
_MODULES: dict[tuple[Path, int], ModuleType] = {}


class UserCodeError(ValueError):
    """A `path.py:name` spec that is malformed, whose file cannot be found or imported, or whose object is missing,
    not callable or not callable as expected."""


def is_spec(text: str) -> bool:
    """Whether `text` names user code (`something.py:name`) rather than a registered name."""
    path, sep, _ = text.rpartition(":")
    return bool(sep) and path.endswith(".py")


def _parse(spec: str, what: str) -> tuple[Path, str]:
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text.endswith(".py") or not name.isidentifier():
        raise UserCodeError(f"{what}: expected {SPEC_FORMAT}, got {spec!r}")
    return Path(path_text).expanduser().resolve(), name


def absolute_spec(spec: str, what: str) -> str:
    """`spec` with its file as an absolute path (resolved against the working directory)."""
    path, name = _parse(spec, what)
    return f"{path}:{name}"


def user_module(spec: str, what: str) -> ModuleType:
    """The module of `spec`'s file, executed on the first use of this version of the file."""
    path, _ = _parse(spec, what)
    if not path.is_file():
        raise UserCodeError(f"{what} {spec!r}: no such file {path}")
    key = (path, path.stat().st_mtime_ns)
    if key in _MODULES:
        return _MODULES[key]
    module_spec = importlib.util.spec_from_file_location(f"hfjax_user_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise UserCodeError(f"{what} {spec!r}: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # the user's module may raise anything while importing
        raise UserCodeError(f"{what} {spec!r}: importing {path} failed: {type(exc).__name__}: {exc}") from exc
    _MODULES[key] = module
    return module


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """The callable `spec` names (`what` says what it is for, in errors)."""
    module = user_module(spec, what)
    path, name = _parse(spec, what)
    if not hasattr(module, name):
        defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise UserCodeError(f"{what} {spec!r}: {path} has no '{name}' (its functions: {defined})")
    fn = getattr(module, name)
    if not callable(fn):
        raise UserCodeError(f"{what} {spec!r}: '{name}' is a {type(fn).__name__}, not a function")
    return fn


def check_call(fn: Callable[..., Any], spec: str, what: str, expected: str, *args: Any, **kwargs: Any) -> None:
    """Raises UserCodeError unless `fn(*args, **kwargs)` fits `fn`'s signature; `expected` shows a definition that
    does. A callable without a signature to inspect passes (it fails at its first call instead)."""
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        call = ", ".join(["..."] * len(args) + [f"{key}=..." for key in kwargs])
        raise UserCodeError(
            f"{what} {spec!r}: cannot be called as {getattr(fn, '__name__', spec)}({call}) ({exc}); expected {expected}"
        ) from None
    except ValueError:
        return
