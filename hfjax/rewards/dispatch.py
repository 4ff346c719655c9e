"""Rule-reward dispatch by `data_source`, as verl's default `compute_score`: a registry from data source names to
scoring functions, with GSM8K, geometry3k and the synthetic addition and shapes tasks built in, and
`make_reward_function` choosing between it and a user function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hfjax.rewards.errors import RewardError
from hfjax.rewards.rules import boxed_answer_score, exact_match_score, gsm8k_score
from hfjax.rewards.user_function import ScoreFn, as_score, load_reward_function

Scorer = Callable[[str, Any, dict], float]  # (solution_str, ground_truth, extra_info) -> score

SCORERS: dict[str, Scorer] = {
    "openai/gsm8k": lambda solution, truth, extra: gsm8k_score(solution, truth),
    "gsm8k": lambda solution, truth, extra: gsm8k_score(solution, truth),
    "hfjax/addition": lambda solution, truth, extra: exact_match_score(solution, truth),
    "hfjax/shapes": lambda solution, truth, extra: exact_match_score(solution, truth),
    "hiyouga/geometry3k": lambda solution, truth, extra: boxed_answer_score(solution, truth),
}


def register_scorer(data_source: str, scorer: Scorer) -> None:
    """Makes `compute_score` use `scorer(solution_str, ground_truth, extra_info)` for rows of `data_source`."""
    SCORERS[data_source] = scorer


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """The rule reward of one response, chosen by its row's `data_source`."""
    scorer = SCORERS.get(data_source)
    if scorer is None:
        raise RewardError(
            f"no rule reward for data_source {data_source!r} (known: {sorted(SCORERS)}); register one with "
            "register_scorer or give a reward function as 'path/to/file.py:function_name'"
        )
    try:
        value = scorer(solution_str, ground_truth, extra_info or {})
    except Exception as exc:  # a registered scorer may raise anything
        raise RewardError(f"the {data_source!r} scorer raised {type(exc).__name__}: {exc}") from exc
    return as_score(value, f"the {data_source!r} scorer")


def make_reward_function(spec: str | None = None) -> ScoreFn:
    """`compute_score` (dispatch by data source) when `spec` is empty, else the user function it names."""
    return load_reward_function(spec) if spec else compute_score
