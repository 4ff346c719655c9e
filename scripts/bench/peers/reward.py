"""The rule reward of the hfjax-vs-TRL GRPO comparison, one function for both sides.

Reward = the fraction of the response's characters that are ASCII digits (0.0 for an empty response), in [0, 1].
The workload's prompts ask for digits, the reference checkpoint starts from random weights (its samples hold a few
digits by chance, so groups of 4 samples differ and GRPO's advantages are non-zero), and the reward needs no ground
truth. hfjax takes it as `reward.function=scripts/bench/peers/reward.py:compute_score` (verl's signature); TRL's
`GRPOTrainer` takes `trl_reward` (its reward-function signature). Imports only the standard library.
"""

from __future__ import annotations

from typing import Any


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """Fraction of `solution_str`'s characters that are ASCII digits; `data_source`, `ground_truth` are unused."""
    if not solution_str:
        return 0.0
    return sum(ch in "0123456789" for ch in solution_str) / len(solution_str)


def _text(completion: str | list[dict[str, str]]) -> str:
    """A TRL completion as text: plain, or the content of its (assistant) messages for conversational prompts."""
    if isinstance(completion, str):
        return completion
    return "".join(message["content"] for message in completion)


def trl_reward(prompts: list, completions: list, **columns: Any) -> list[float]:
    """`compute_score` over a TRL batch; the dataset's verl columns (`data_source`, `reward_model`, `extra_info`)
    arrive as per-sample lists in `columns`."""
    n = len(completions)
    sources = columns.get("data_source") or [""] * n
    models = columns.get("reward_model") or [None] * n
    extras = columns.get("extra_info") or [None] * n
    return [
        compute_score(source, _text(completion), (model or {}).get("ground_truth"), extra)
        for completion, source, model, extra in zip(completions, sources, models, extras, strict=True)
    ]
