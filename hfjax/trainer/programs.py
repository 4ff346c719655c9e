"""The RL algorithms as short dataflow programs over the step API (HybridFlow's "few lines per algorithm").

Each program takes the step (`hfjax.trainer.step.Step`: the operations of its `PUBLIC_API`) and runs verl's order:
generate, [ReMax greedy baseline], rewards, old log probs, reference log probs, values, advantages (on the
controller, by the run's estimator: `algorithm.adv_estimator`, else the algorithm's own), critic update, actor
update. `PROGRAMS[name]` is the program of `algorithm.name`; `program_for` picks the run's, a user program
(`algorithm.program`, written the same way) first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from hfjax.user_code import load_callable

if TYPE_CHECKING:
    from hfjax.config.rl import AlgorithmConfig
    from hfjax.trainer.step import Step

Program = Callable[["Step"], None]


def ppo(s: Step) -> None:
    s.generate()
    s.score()
    s.old_log_prob()
    s.ref_log_prob()
    s.values("critic", "values")
    s.advantages()
    s.update_critic("critic", "values", "returns")
    s.update_actor()


def critic_free(s: Step) -> None:
    """GRPO, RLOO, REINFORCE++: no critic; advantages from the rewards (and the prompt groups)."""
    s.generate()
    s.score()
    s.old_log_prob()
    s.ref_log_prob()
    s.advantages()
    s.update_actor()


def remax(s: Step) -> None:
    s.greedy_baseline()  # one greedy response per prompt: its reward is the baseline
    critic_free(s)


def safe_rlhf(s: Step) -> None:
    s.generate()
    s.score()
    s.cost()
    s.old_log_prob()
    s.ref_log_prob()
    s.values("critic", "values")
    s.values("cost_critic", "cost_values")
    s.safe_advantages()  # reward and cost advantages, combined with the Lagrange multiplier
    s.update_critic("critic", "values", "returns")
    s.update_critic("cost_critic", "cost_values", "cost_returns")
    s.update_actor()
    s.update_lagrange()


PROGRAMS: dict[str, Program] = {
    "ppo": ppo,
    "grpo": critic_free,
    "rloo": critic_free,
    "reinforce_plus_plus": critic_free,
    "remax": remax,
    "safe_rlhf": safe_rlhf,
}


def program_for(algo: AlgorithmConfig) -> Program:
    """The run's program: the user's `algorithm.program` (checked when the config loaded), else `algorithm.name`'s."""
    return load_callable(algo.program, "user program") if algo.program else PROGRAMS[algo.name]
