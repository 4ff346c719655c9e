"""The RL run config: data, roles (actor, rollout, critic, reward/cost models), algorithm and trainer sections.

Loaded with `load_rl_config(path, overrides)` — YAML plus `key=value` overrides, validated into these dataclasses
before any worker starts (an unknown key or a bad value names its full path and what was expected). `model_path`
at the top is the default checkpoint of every role that does not name its own.
Imports `hfjax.typed_config` and the role sections of `hfjax.workers.config`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from hfjax.typed_config import load_config
from hfjax.workers.config import ActorConfig, CriticConfig, RewardModelConfig, RolloutConfig

ALGORITHMS = ("ppo", "grpo", "rloo", "reinforce_plus_plus", "remax", "safe_rlhf")
PLACEMENTS = ("colocate", "split", "standalone")


@dataclasses.dataclass
class DataConfig:
    """Prompt datasets in verl's schema (parquet or JSONL)."""

    train_files: list[str] = dataclasses.field(default_factory=list)
    val_files: list[str] = dataclasses.field(default_factory=list)
    max_prompt_length: int = 64
    truncation: Literal["error", "filter", "left", "right"] = "filter"
    train_batch_size: int = 16
    val_batch_size: int = 64
    shuffle: bool = True
    seed: int = 0


@dataclasses.dataclass
class AlgorithmConfig:
    """Which dataflow program runs, and its advantage / KL / constraint settings."""

    name: Literal["ppo", "grpo", "rloo", "reinforce_plus_plus", "remax", "safe_rlhf"] = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000
    cost_limit: float = 0.0
    lambda_init: float = 1.0
    lambda_lr: float = 0.05


@dataclasses.dataclass
class RewardConfig:
    """Rule reward (`function`: empty = dispatch by data_source, else `path.py:name`), and optional models."""

    function: str | None = None
    use_rule: bool = True
    reward_model: RewardModelConfig = dataclasses.field(default_factory=RewardModelConfig)
    cost_model: RewardModelConfig = dataclasses.field(default_factory=RewardModelConfig)


@dataclasses.dataclass
class TrainerConfig:
    """The loop: steps, placement of roles on devices, checkpoints, validation and logging."""

    run_dir: str = "runs/rl"
    total_steps: int = 3
    critic_warmup: int = 0
    placement: Literal["colocate", "split", "standalone"] = "colocate"
    backend: Literal["ray", "local"] = "ray"
    device: Literal["cpu", "gpu", "tpu"] = "cpu"
    devices: int = 8
    save_freq: int = 0
    test_freq: int = 0
    val_before_train: bool = False
    resume: Literal["auto", "never"] = "auto"
    max_to_keep: int = 3
    tensorboard: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        if self.total_steps < 1 or self.devices < 1:
            raise ValueError("total_steps and devices must be >= 1")


@dataclasses.dataclass
class RLConfig:
    """A whole RL run."""

    model_path: str = ""
    tokenizer_path: str = ""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    actor: ActorConfig = dataclasses.field(default_factory=ActorConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)

    def __post_init__(self) -> None:
        for section in (self.actor, self.critic):
            if not section.model_path:
                section.model_path = self.model_path
        if not self.actor.model_path:
            raise ValueError("model_path (or actor.model_path) is required")
        if not self.tokenizer_path:
            self.tokenizer_path = self.actor.model_path
        if self.algorithm.name == "safe_rlhf" and not self.reward.cost_model.enabled:
            raise ValueError("algorithm.name=safe_rlhf needs reward.cost_model.model_path")
        if self.algorithm.name in ("grpo", "rloo") and self.rollout.n < 2:
            raise ValueError(
                f"algorithm.name={self.algorithm.name} compares samples of a prompt: rollout.n must be >= 2"
            )

    @property
    def uses_critic(self) -> bool:
        return self.algorithm.name in ("ppo", "safe_rlhf")

    @property
    def uses_ref(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def reuses_update_log_probs(self) -> bool:
        """Whether the actor update computes the old log probs itself (`actor.old_log_prob: auto` with one optimizer
        step per iteration and no KL in the reward): the policy has not moved since generation, so they are the
        update's own log probs, detached."""
        actor = self.actor
        single_step = actor.ppo_epochs == 1 and actor.ppo_mini_batch_size >= self.data.train_batch_size * self.rollout.n
        return actor.old_log_prob == "auto" and single_step and not self.algorithm.use_kl_in_reward


def load_rl_config(source: str | Path | dict[str, Any] | None, overrides: Sequence[str] = ()) -> RLConfig:
    """Reads and validates an RL config (YAML path or dict) with `key=value` overrides."""
    return load_config(RLConfig, source, overrides)
