"""User reward functions given as `path/to/file.py:function_name`, loaded with importlib, called like verl's
`compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)` (the signature is checked when
the file loads), their result checked to be a finite number (or a dict with a "score"); whatever a call raises
becomes a `RewardError` naming the function. Imports only the standard library and `hfjax.rewards.errors`."""

from __future__ import annotations

import importlib.util
import inspect
import math
import numbers
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hfjax.rewards.errors import RewardError

ScoreFn = Callable[..., float]
ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")  # what a reward function is called with


def as_score(value: Any, source: str) -> float:
    """A reward function's result as a float: a finite real number, or a dict whose "score" is one."""
    raw = value.get("score") if isinstance(value, dict) else value
    if isinstance(raw, numbers.Real) and math.isfinite(float(raw)):
        return float(raw)
    got = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    raise RewardError(f"{source} returned {got}; expected a finite number or a dict with a finite 'score'")


def check_signature(fn: Callable[..., Any], spec: str) -> None:
    """Raises RewardError unless `fn` can be called with the keyword arguments `ARGUMENTS` (verl's convention)."""
    try:
        inspect.signature(fn).bind(**dict.fromkeys(ARGUMENTS))
    except TypeError as exc:
        raise RewardError(
            f"reward function {spec!r}: cannot be called as {getattr(fn, '__name__', spec)}"
            f"({', '.join(f'{a}=...' for a in ARGUMENTS)}) ({exc}); expected "
            "def compute_score(data_source, solution_str, ground_truth, extra_info=None)"
        ) from None
    except ValueError:  # no signature to inspect (some builtins): it is checked at the first call
        return


def load_reward_function(spec: str) -> ScoreFn:
    """The function named by `spec` ("path/to/file.py:function_name"), wrapped to return a float. The file is
    executed once here. Pass the spec string (not the function) to workers that need it in another process."""
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name.isidentifier():
        raise RewardError(f"reward function: expected 'path/to/file.py:function_name', got {spec!r}")
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise RewardError(f"reward function {spec!r}: no such file {path}")
    module_spec = importlib.util.spec_from_file_location(f"hfjax_user_reward_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise RewardError(f"reward function {spec!r}: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # the user's module may raise anything while importing
        raise RewardError(f"reward function {spec!r}: importing {path} failed: {type(exc).__name__}: {exc}") from exc
    if not hasattr(module, name):
        defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise RewardError(f"reward function {spec!r}: {path} has no '{name}' (its functions: {defined})")
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardError(f"reward function {spec!r}: '{name}' is a {type(fn).__name__}, not a function")
    check_signature(fn, spec)

    def score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
        try:
            result = fn(
                data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info
            )
        except Exception as exc:  # the user's function may raise anything
            raise RewardError(f"reward function {spec!r} raised {type(exc).__name__}: {exc}") from exc
        return as_score(result, f"reward function {spec!r}")

    return score
