"""User reward functions given as `path/to/file.py:function_name`, loaded with importlib, called like verl's
`compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)` (the signature is checked when
the file loads), their result checked to be a finite number (or a dict with a "score"); whatever a call raises
becomes a `RewardError` naming the function."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

from hfjax.rewards.errors import RewardError
from hfjax.user_code import UserCodeError, check_call, load_callable

ScoreFn = Callable[..., float]
ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")  # what a reward function is called with
EXPECTED = "def compute_score(data_source, solution_str, ground_truth, extra_info=None)"


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
        check_call(fn, spec, "reward function", EXPECTED, **dict.fromkeys(ARGUMENTS))
    except UserCodeError as exc:
        raise RewardError(str(exc)) from None


def load_reward_function(spec: str) -> ScoreFn:
    """The function named by `spec` ("path/to/file.py:function_name"), wrapped to return a float. The file is
    loaded through `hfjax.user_code`. Pass the spec string (not the function) to workers that need it in another
    process."""
    try:
        fn = load_callable(spec, "reward function")
    except UserCodeError as exc:
        raise RewardError(str(exc)) from exc.__cause__
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
