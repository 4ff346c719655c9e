"""The RL algorithms as short dataflow programs over the role handles (HybridFlow's "few lines per algorithm").

Each program takes the step context (`hfjax.trainer.rl.Step`: role handles, rewards, timers, the batch) and runs
verl's order: generate, [ReMax greedy baseline], rewards, old log probs, reference log probs, values, advantages
(on the controller), critic update, actor update. `PROGRAMS[name]` selects one by `algorithm.name`.
Imports `hfjax.algos` and `hfjax.protocol` only (the context brings everything else).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ESTIMATOR = {
    "ppo": "gae",
    "grpo": "grpo",
    "rloo": "rloo",
    "reinforce_plus_plus": "reinforce_plus_plus",
    "remax": "remax",
    "safe_rlhf": "gae",
}


def ppo(s: Any) -> None:
    s.generate()
    s.score()
    s.old_log_prob()
    s.ref_log_prob()
    s.values("critic", "values")
    s.advantages(ESTIMATOR["ppo"])
    s.update_critic("critic", "values", "returns")
    s.update_actor()


def group_relative(estimator: str) -> Callable[[Any], None]:
    """GRPO, RLOO, REINFORCE++: no critic; advantages from the rewards (and the prompt groups)."""

    def program(s: Any) -> None:
        s.generate()
        s.score()
        s.old_log_prob()
        s.ref_log_prob()
        s.advantages(estimator)
        s.update_actor()

    return program


def remax(s: Any) -> None:
    s.greedy_baseline()  # one greedy response per prompt: its reward is the baseline
    s.generate()
    s.score()
    s.old_log_prob()
    s.ref_log_prob()
    s.advantages(ESTIMATOR["remax"])
    s.update_actor()


def safe_rlhf(s: Any) -> None:
    s.generate()
    s.score()
    s.cost()
    s.old_log_prob()
    s.ref_log_prob()
    s.values("critic", "values")
    s.values("cost_critic", "cost_values")
    s.safe_advantages()  # reward and cost GAE, combined with the Lagrange multiplier
    s.update_critic("critic", "values", "returns")
    s.update_critic("cost_critic", "cost_values", "cost_returns")
    s.update_actor()
    s.update_lagrange()


PROGRAMS: dict[str, Callable[[Any], None]] = {
    "ppo": ppo,
    "grpo": group_relative("grpo"),
    "rloo": group_relative("rloo"),
    "reinforce_plus_plus": group_relative("reinforce_plus_plus"),
    "remax": remax,
    "safe_rlhf": safe_rlhf,
}
