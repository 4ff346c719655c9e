"""`RunHealth`: stops (or warns about) an RL run that cannot learn, instead of letting it exit 0 after hours.

Two signs, checked after every step from what the step logged:
- updates skipped for non-finite gradients (`<role>/skipped`, the share of a role's optimizer steps skipped in the
  step) in `trainer.health.max_skipped_steps` consecutive steps: NaN or infinite weights, losses or data;
- every response of the batch scored alike in `trainer.health.max_flat_reward_steps` consecutive steps: advantages
  are then all zero (GRPO, RLOO) or carry no preference, so the policy cannot improve (a broken reward function, rows
  without the ground truth it needs, or a task already solved).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np

from hfjax.config.trainer import HealthConfig

log = logging.getLogger(__name__)
TRAINED_ROLES = ("actor", "critic", "cost_critic")


class RunStalledError(RuntimeError):
    """The run cannot learn (`trainer.health.on_stall: stop`)."""


class RunHealth:
    """Counts consecutive unhealthy steps; `observe` raises `RunStalledError` (or warns) past the limits."""

    def __init__(self, config: HealthConfig):
        self.config = config
        self.skipped_steps = 0
        self.flat_steps = 0

    def observe(self, step: int, metrics: Mapping[str, float], scores: np.ndarray) -> None:
        """`metrics`: what step `step` logged; `scores`: its per-response scores (rule and/or reward model)."""
        skipped = {role: metrics[f"{role}/skipped"] for role in TRAINED_ROLES if metrics.get(f"{role}/skipped", 0) > 0}
        self.skipped_steps = self.skipped_steps + 1 if skipped else 0
        flat = scores.size > 1 and bool(np.all(scores == scores.flat[0]))
        self.flat_steps = self.flat_steps + 1 if flat else 0
        cfg = self.config
        if cfg.max_skipped_steps and self.skipped_steps >= cfg.max_skipped_steps:
            shares = ", ".join(f"{role} {share:.0%}" for role, share in skipped.items())
            self._stall(
                f"step {step}: updates were skipped for non-finite gradients in {self.skipped_steps} consecutive "
                f"steps (share of optimizer steps skipped this step: {shares}); the weights, losses or data hold NaN "
                f"or infinite values, so the run cannot learn (trainer.health.max_skipped_steps="
                f"{cfg.max_skipped_steps})"
            )
            self.skipped_steps = 0  # warned: the next warning comes after as many steps again
        if cfg.max_flat_reward_steps and self.flat_steps >= cfg.max_flat_reward_steps:
            self._stall(
                f"step {step}: every response scored {float(scores.flat[0]):g} in {self.flat_steps} consecutive "
                "steps, so the advantages carry no signal and the run cannot learn; check the reward function and "
                f"that the data rows hold the ground truth it needs (trainer.health.max_flat_reward_steps="
                f"{cfg.max_flat_reward_steps})"
            )
            self.flat_steps = 0

    def _stall(self, message: str) -> None:
        if self.config.on_stall == "stop":
            raise RunStalledError(message + "; the run stops (its last checkpoint is kept)")
        log.warning("%s (trainer.health.on_stall=warn: the run goes on)", message)
