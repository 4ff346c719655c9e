"""The RL run config: data, roles (actor, rollout, critic, reward/cost models), algorithm and trainer sections.

Loaded with `load_rl_config(path, overrides)` — YAML plus `key=value` overrides, validated into these dataclasses
before any worker starts (an unknown key, a number out of its range, an unknown registry name or sizes that do not
fit together name the full path and what was expected). What needs files (checkpoints, datasets, the reward
function) and the device memory is checked by `hfjax.trainer.preflight.check_rl_run`. `model_path`
at the top is the default checkpoint of every role that does not name its own.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from hfjax.algos.advantages import ADVANTAGE_ESTIMATORS, required_inputs
from hfjax.config.roles import KL_NAMES, ActorConfig, CriticConfig, RewardModelConfig, RolloutConfig
from hfjax.config.trainer import TrainerConfig
from hfjax.parallel.host_local import check_per_host_generation, check_stationary_generation
from hfjax.parallel.layout import Layout
from hfjax.typed_config import (
    AT_LEAST_1,
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    check_fields,
    check_name,
    load_config,
)
from hfjax.user_code import UserCodeError, absolute_spec, check_call, load_callable, user_module

ALGORITHMS = ("ppo", "grpo", "rloo", "reinforce_plus_plus", "remax", "safe_rlhf")
# The roles a program may call besides the actor (a rollout group and a reward model come from the rest of the config)
OPTIONAL_ROLES = ("critic", "cost_model", "cost_critic")
ALGORITHM_ROLES = {"ppo": ("critic",), "safe_rlhf": OPTIONAL_ROLES}
DEFAULT_ESTIMATORS = {name: name for name in ALGORITHMS} | {"ppo": "gae", "safe_rlhf": "gae"}


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
    # a vision-language policy's images per prompt row at most (a row with more: a one-line error naming it); the
    # compile check sizes every pass for rows of this many images (or as many as max_prompt_length holds, if fewer)
    max_images: int = 4

    def __post_init__(self) -> None:
        check_fields(
            self,
            max_prompt_length=AT_LEAST_1,
            max_images=AT_LEAST_1,
            train_batch_size=AT_LEAST_1,
            val_batch_size=AT_LEAST_1,
            seed=NON_NEGATIVE,
        )


@dataclasses.dataclass
class AlgorithmConfig:
    """Which dataflow program runs, and its advantage / KL / constraint settings."""

    name: Literal["ppo", "grpo", "rloo", "reinforce_plus_plus", "remax", "safe_rlhf"] = "grpo"
    # a program of your own, `path/to/file.py:function`, run as function(step) instead of name's program; the roles
    # it calls besides the actor are its file's `ROLES` (e.g. ROLES = ["critic"]; default none); null: name's program
    program: str | None = None
    # registered name (gae, grpo, rloo, opo, ...) or `path/to/file.py:function`; null: name's (gae for ppo, safe_rlhf)
    adv_estimator: str | None = None
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

    def __post_init__(self) -> None:
        check_fields(
            self,
            gamma=FRACTION,
            lam=FRACTION,
            kl_coef=NON_NEGATIVE,
            target_kl=POSITIVE,
            horizon=AT_LEAST_1,
            cost_limit=(math.isfinite, "a finite number"),
            lambda_init=NON_NEGATIVE,  # a Lagrange multiplier
            lambda_lr=NON_NEGATIVE,
        )
        check_name("kl_penalty", self.kl_penalty, KL_NAMES, "KL estimator")
        if self.adv_estimator is not None:
            self.adv_estimator = ADVANTAGE_ESTIMATORS.resolve("adv_estimator", self.adv_estimator)
        self._roles = ALGORITHM_ROLES.get(self.name, ())
        if self.program is not None:
            self.program, self._roles = _load_program(self.program)
        self._check_estimator_inputs()

    @property
    def estimator(self) -> str:
        """The advantage estimator `Step.advantages()` uses: `adv_estimator`, else the one of `name`."""
        return self.adv_estimator or DEFAULT_ESTIMATORS[self.name]

    @property
    def roles(self) -> tuple[str, ...]:
        """The `OPTIONAL_ROLES` the program calls: its file's `ROLES`, or those of the built-in program `name`."""
        return self._roles

    @property
    def source(self) -> str:
        """Which setting chose the program, for messages."""
        return f"algorithm.program={self.program}" if self.program else f"algorithm.name={self.name}"

    def _check_estimator_inputs(self) -> None:
        needs = required_inputs(self.estimator)
        if "values" in needs and "critic" not in self.roles:
            raise ValueError(
                f"adv_estimator: {self.estimator!r} needs the values of a critic, which {self.source} does not run "
                "(a program of your own lists 'critic' in its file's ROLES)"
            )
        if "reward_baselines" in needs and self.program is None and self.name != "remax":
            raise ValueError(
                f"adv_estimator: {self.estimator!r} needs reward_baselines (ReMax's greedy rewards), which only "
                f"algorithm.name=remax or a program calling step.greedy_baseline() computes"
            )
        if "sum_pi_squared" in needs:
            raise ValueError(
                f"adv_estimator: {self.estimator!r} needs sum_pi_squared (the old policy's summed squared token "
                "probabilities), which the training step does not compute yet; call "
                "hfjax.algos.compute_advantage with hfjax.algos.sum_pi_squared_from_logits from your own code"
            )


def _load_program(spec: str) -> tuple[str, tuple[str, ...]]:
    """A user program's absolute spec and the roles its file declares, after checking that it loads, can be called
    as function(step) and declares known roles; raises ValueError naming `program`."""
    what = "user program"
    try:
        check_call(load_callable(spec, what), spec, what, "def program(step): ...", None)
        roles = getattr(user_module(spec, what), "ROLES", ())
        if isinstance(roles, str) or not isinstance(roles, list | tuple) or not set(roles) <= set(OPTIONAL_ROLES):
            raise UserCodeError(
                f"{what} {spec!r}: its file's ROLES is {roles!r}; expected a list of the roles the program calls "
                f"besides the actor, from {list(OPTIONAL_ROLES)}"
            )
        return absolute_spec(spec, what), tuple(roles)
    except UserCodeError as exc:
        raise ValueError(f"program: {exc}") from None


@dataclasses.dataclass
class RewardConfig:
    """Rule reward (`function`: empty = dispatch by data_source, else `path.py:name`), and optional models."""

    function: str | None = None
    use_rule: bool = True
    # a rule reward that raises or returns no finite number: stop the run (`raise`), or score the sample 0 and count
    # it in the metric `reward/errors` (`skip`; a batch whose every sample fails still stops the run)
    on_error: Literal["raise", "skip"] = "raise"
    reward_model: RewardModelConfig = dataclasses.field(default_factory=RewardModelConfig)
    cost_model: RewardModelConfig = dataclasses.field(default_factory=RewardModelConfig)

    def __post_init__(self) -> None:
        if self.function is not None:
            path, sep, name = self.function.rpartition(":")
            if not (sep and path.endswith(".py") and name.isidentifier()):
                raise ValueError(f"function: expected 'path/to/file.py:function_name', got {self.function!r}")


@dataclasses.dataclass
class AsyncConfig:
    """Asynchronous RL (the `async:` section): how many policy versions old a rollout batch may be when the trainer
    updates on it. 0 is the synchronous loop; above 0 the rollout group (placement `disaggregated`) generates the
    next batches while the trainer updates, and weights go to it after every update."""

    max_staleness: int = 0
    # partial rollouts: a generation under way moves to newer weights as soon as they exist (checked every
    # `check_every` decode steps); the samples not yet ended continue under them, re-prefilled with their tokens so far
    partial_rollout: bool = False
    check_every: int = 8
    # how the rollout group switches to new weights: `atomic` places them beside the old ones first (two copies on
    # the devices); `in_place` keeps them on the host and replaces one parameter at a time (weights + one parameter)
    weight_swap: Literal["atomic", "in_place"] = "atomic"

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness: expected >= 0, got {self.max_staleness}")
        if self.check_every < 1:
            raise ValueError(f"check_every: expected >= 1, got {self.check_every}")
        if self.partial_rollout and not self.max_staleness:
            raise ValueError("partial_rollout: needs max_staleness >= 1 (at 0 no weights change during a rollout)")


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
    async_: AsyncConfig = dataclasses.field(default_factory=AsyncConfig)  # YAML key `async`

    def __post_init__(self) -> None:
        for section in (self.actor, self.critic):
            if not section.model_path:
                section.model_path = self.model_path
        if not self.actor.model_path:
            raise ValueError("model_path (or actor.model_path) is required")
        if not self.tokenizer_path:
            self.tokenizer_path = self.actor.model_path
        if self.rollout.agent.enabled and not self.rollout.agent.tokenizer_path:
            self.rollout.agent.tokenizer_path = self.tokenizer_path
        if self.rollout.agent.enabled and self.async_.partial_rollout:
            raise ValueError("async.partial_rollout: not supported with rollout.agent (multi-turn) rollouts yet")
        algo = self.algorithm
        if "cost_model" in algo.roles and not self.reward.cost_model.enabled:
            raise ValueError(f"{algo.source} needs reward.cost_model.model_path")
        if algo.estimator in ("grpo", "rloo") and self.rollout.n < 2:
            chosen = f"adv_estimator={algo.estimator}" if algo.adv_estimator else f"name={algo.name}"
            raise ValueError(f"algorithm.{chosen} compares samples of a prompt: rollout.n must be >= 2")

        if self.async_.max_staleness and self.trainer.placement != "disaggregated":
            raise ValueError(
                f"async.max_staleness={self.async_.max_staleness} overlaps generation with training, which needs "
                f"the rollout on devices of its own: set trainer.placement=disaggregated (got "
                f"{self.trainer.placement!r})"
            )
        if self.trainer.placement == "disaggregated" and self.trainer.backend != "ray":
            raise ValueError("trainer.placement=disaggregated runs two worker groups: it needs trainer.backend=ray")
        self._resolve_rollout_correction()
        self._check_packed_rows()
        self._check_layouts()

    def _resolve_rollout_correction(self) -> None:
        """`actor.rollout_correction.rollout_is: auto` becomes token-level TIS when rollouts may be stale (they come
        from an older policy than the trainer's), else none; a stale run left uncorrected is warned about."""
        correction, staleness = self.actor.rollout_correction, self.async_.max_staleness
        if correction.rollout_is == "auto":
            correction.rollout_is = "token" if staleness else None
            if staleness:
                warnings.warn(
                    f"async.max_staleness={staleness}: rollouts may come from a policy older than the trainer's "
                    f"(by up to {staleness} updates), so actor.rollout_correction.rollout_is defaults to token "
                    f"(truncated importance weights, threshold {correction.rollout_is_threshold}); set it to null to "
                    "train uncorrected, or to sequence",
                    stacklevel=2,
                )
        elif staleness and not correction.enabled:
            warnings.warn(
                f"async.max_staleness={staleness} with actor.rollout_correction.rollout_is and rollout_rs null: the "
                "policy gradient uses stale samples without importance weights or rejection (biased); set "
                "rollout_is: token to correct it",
                stacklevel=2,
            )

    @property
    def disaggregated(self) -> bool:
        return self.trainer.placement == "disaggregated"

    def role_names(self) -> list[str]:
        """The roles this run needs, in start-up order."""
        names = ["actor"]
        names += ["rollout"] if self.disaggregated else []
        names += ["critic"] if self.uses_critic else []
        names += ["reward_model"] if self.reward.reward_model.enabled else []
        names += [name for name in ("cost_model", "cost_critic") if name in self.algorithm.roles]
        return names

    def group_shape(self, role: str) -> tuple[int, int]:
        """(hosts, devices per host) of the worker group that runs `role`."""
        groups = self.worker_groups()
        index = next(i for i, names in enumerate(groups) if role in names)
        return self.trainer.group_shapes(len(groups))[index]

    @property
    def keeps_lora_base_in_gen(self) -> bool:
        """Whether the actor's LoRA base stays in the generation layout: LoRA, colocated generation and
        `rollout.lora_base_layout: gen`."""
        return self.actor.lora.enabled and not self.disaggregated and self.rollout.lora_base_layout == "gen"

    def worker_groups(self) -> list[list[str]]:
        """The role names of each worker group of `trainer.placement`."""
        roles, placement = self.role_names(), self.trainer.placement
        if placement == "disaggregated":
            return [["rollout"], [name for name in roles if name != "rollout"]]
        if placement == "colocate" or len(roles) == 1:
            return [roles]
        if placement == "split":
            return [["actor"], roles[1:]]
        return [[name] for name in roles]

    def _check_packed_rows(self) -> None:
        """A packed row holds at least one whole sequence: `packed_row_tokens` >= the longest prompt + response."""
        longest = self.data.max_prompt_length + self.rollout.response_length
        for name, section in (("actor", self.actor), ("critic", self.critic)):
            if 0 < section.packed_row_tokens < longest:
                raise ValueError(
                    f"{name}.packed_row_tokens={section.packed_row_tokens}: a packed row holds whole sequences, "
                    f"expected 0 (off) or at least data.max_prompt_length + rollout.response_length = {longest}"
                )

    def _check_layouts(self) -> None:
        """Every configured layout has the devices of its role's group; generation over several hosts keeps each
        data-parallel replica inside one host."""
        groups = self.worker_groups()
        self.trainer.group_shapes(len(groups))  # a count per group, where they are given
        layouts = {
            "actor.train_layout": ("actor", self.actor.train_layout),
            "rollout.gen_layout": ("rollout" if self.disaggregated else "actor", self.rollout.gen_layout),
            "critic.layout": ("critic", self.critic.layout),
            "reward.reward_model.layout": ("reward_model", self.reward.reward_model.layout),
            "reward.cost_model.layout": ("cost_model", self.reward.cost_model.layout),
        }
        roles = {name for group in groups for name in group}
        for key, (role, config) in layouts.items():
            if config is None:
                continue
            layout = Layout.from_config(config, key)  # checked even for a role this run does not start
            if key == "rollout.gen_layout" and layout.axis_size("sequence") > 1:
                raise ValueError(
                    f"{key}: mesh axis 'sequence' (size {layout.axis_size('sequence')}) splits the positions of the "
                    "training and log-prob passes; generation decodes one position per step, so its layout has no "
                    "sequence axis: drop it (data, fsdp or tensor split generation)"
                )
            if role not in roles:
                continue
            hosts, per_host = self.group_shape(role)
            shape = f"{hosts} host(s) x {per_host} devices" if hosts > 1 else f"{per_host} devices"
            if layout.size != hosts * per_host:
                split = f"trainer.group_devices={self.trainer.group_devices}, " if self.trainer.group_devices else ""
                raise ValueError(
                    f"{key}: {layout.describe()} has {layout.size} devices, but the {role} group has {shape} "
                    f"(trainer.hosts={self.trainer.hosts}, trainer.devices_per_host={self.trainer.devices_per_host}, "
                    f"{split}placement {self.trainer.placement!r})"
                )
            if key == "rollout.gen_layout" and hosts > 1:
                check_per_host_generation(layout, hosts, key)
                if self.keeps_lora_base_in_gen:
                    check_stationary_generation(layout, per_host)
        sizes = {
            "actor.micro_batch_size": self.actor.micro_batch_size,
            "actor.ppo_mini_batch_size": self.actor.ppo_mini_batch_size,
        }
        if self.uses_critic:
            sizes.update(
                {
                    "critic.micro_batch_size": self.critic.micro_batch_size,
                    "critic.ppo_mini_batch_size": self.critic.ppo_mini_batch_size,
                }
            )
        hosts = self.group_shape("actor")[0]  # every group's: whole hosts each, or the one host
        for key, rows in sizes.items():
            if hosts > 1 and rows % hosts:
                raise ValueError(
                    f"{key}={rows}: its group has {hosts} hosts, each taking an equal share of every batch; use a "
                    f"multiple of {hosts}"
                )

    @property
    def uses_critic(self) -> bool:
        return "critic" in self.algorithm.roles

    @property
    def uses_ref(self) -> bool:
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def reuses_update_log_probs(self) -> bool:
        """Whether the actor update computes the old log probs itself (`actor.old_log_prob: auto` with one optimizer
        step per iteration, no KL in the reward and no rollout correction): the old log probs are the trainer's
        current policy, which the update's own forward is until its single optimizer step, so they are that
        forward's log probs, detached. That policy is not the rollout's when rollouts are stale
        (`async.max_staleness`) or the engine's numerics differ: that gap is what `actor.rollout_correction` corrects,
        on the controller before the advantages, so a correction needs the separate pass."""
        actor = self.actor
        single_step = actor.ppo_epochs == 1 and actor.ppo_mini_batch_size >= self.data.train_batch_size * self.rollout.n
        no_correction = not actor.rollout_correction.enabled
        return actor.old_log_prob == "auto" and single_step and not self.algorithm.use_kl_in_reward and no_correction


def load_rl_config(source: str | Path | dict[str, Any] | None, overrides: Sequence[str] = ()) -> RLConfig:
    """Reads and validates an RL config (YAML path or dict) with `key=value` overrides."""
    return load_config(RLConfig, source, overrides)
