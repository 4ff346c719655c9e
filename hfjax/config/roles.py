"""Typed config sections of the model roles (actor, rollout, reference, critic, reward model).

Plain dataclasses with defaults beside their fields; `hfjax.config.rl` composes them into the run config and
`hfjax.typed_config` validates YAML and `key=value` overrides into them. Every number is checked against its range
and every name of a registry (policy losses, KL estimators) against that registry when the config loads; a policy
loss given as user code `path/to/file.py:function` is loaded and its signature checked then, and its path kept
absolute (the actor's workers load it again, from any working directory). Layouts
stay dicts in `Layout.from_config` form; `None` means "all of this process's devices" (fsdp for training, data
parallel for generation).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Literal

from hfjax.algos.kl import KL_ALIASES, KL_KINDS
from hfjax.algos.losses import POLICY_LOSSES, check_actor_policy_loss
from hfjax.algos.rollout_correction import parse_is_threshold
from hfjax.algos.rollout_rejection import parse_rejection
from hfjax.models.lora import LoraConfig
from hfjax.optim.optimizer import OptimConfig
from hfjax.typed_config import AT_LEAST_1, NON_NEGATIVE, POSITIVE, POSITIVE_OR_NULL, check_fields, check_name

Dtype = Literal["float32", "bfloat16", "float16"]
KL_NAMES = (*KL_KINDS, *KL_ALIASES)


def check_batch_sizes(section: Any) -> None:
    """`ppo_epochs`, `ppo_mini_batch_size` and `micro_batch_size` are >= 1, `packed_row_tokens` >= 0, and
    micro-batches divide a mini-batch."""
    check_fields(
        section,
        ppo_epochs=AT_LEAST_1,
        ppo_mini_batch_size=AT_LEAST_1,
        micro_batch_size=AT_LEAST_1,
        packed_row_tokens=NON_NEGATIVE,
    )
    mini, micro = section.ppo_mini_batch_size, section.micro_batch_size
    if mini % micro:
        raise ValueError(f"ppo_mini_batch_size: expected a multiple of micro_batch_size={micro}, got {mini}")
    if section.packed_row_tokens and section.lora.drops_out:  # a packed row holds several sequences' masks
        raise ValueError("lora.dropout: not supported with packed_row_tokens yet")


def warn_low_precision_master(section: str, param_dtype: str) -> None:
    """Warns when a trained role keeps its master weights below float32: an update smaller than half a unit in the
    last place of a weight (2^-9 of it in bfloat16; a 1e-6 step on a weight of 0.02) rounds to nothing."""
    if param_dtype != "float32":
        warnings.warn(
            f"{section}.param_dtype={param_dtype}: the trained master weights are stored in {param_dtype}, so small "
            "updates (e.g. lr 1e-6) round to zero; keep param_dtype=float32 (the default) and set dtype for compute",
            stacklevel=3,
        )


@dataclasses.dataclass
class AgentConfig:
    """Multi-turn rollouts (`rollout.agent`): each sample is a trajectory of model turns and observations of an
    environment `env` (`path/to/file.py:ClassName`, a subclass of `hfjax.envs.Environment`, built with `env_kwargs`
    per trajectory; empty = one response per prompt). A trajectory ends when the environment says done, after
    `max_turns` model turns, or at `max_tokens_per_trajectory` tokens after the prompt (model and environment tokens;
    0 = `rollout.response_length`); a turn ends at a stop token or `max_tokens_per_turn` (0 = no limit of its own).
    `env_workers` threads run environment steps while the other trajectories decode; a step without a result
    `env_step_timeout_s` seconds after it was submitted ends its trajectory as `env_error`."""

    env: str = ""  # the environment, `path/to/file.py:ClassName`; empty: one response per prompt
    max_turns: int = 4  # model turns per trajectory at most
    max_tokens_per_trajectory: int = 0  # tokens after the prompt (model and environment); 0: rollout.response_length
    max_tokens_per_turn: int = 0  # tokens of one model turn at most; 0: no limit of its own
    env_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # keyword arguments of each environment
    env_workers: int = 16  # threads running environment steps (tools) beside decoding
    env_step_timeout_s: float = 600.0  # seconds an environment step may take; past it the trajectory ends (env_error)
    tokenizer_path: str = ""  # decodes turns and renders observations; default: the run's tokenizer_path

    def __post_init__(self) -> None:
        check_fields(
            self,
            max_turns=AT_LEAST_1,
            max_tokens_per_trajectory=NON_NEGATIVE,
            max_tokens_per_turn=NON_NEGATIVE,
            env_workers=AT_LEAST_1,
            env_step_timeout_s=(lambda v: 0 < v < float("inf"), "> 0 (finite)"),
        )
        if self.env:
            from hfjax.envs.base import load_environment
            from hfjax.user_code import absolute_spec

            self.env = absolute_spec(self.env, "env")
            try:
                load_environment(self.env)
            except ValueError as exc:  # EnvError, UserCodeError: the message names the spec and what was expected
                raise ValueError(f"env: {exc}") from None

    @property
    def enabled(self) -> bool:
        return bool(self.env)


@dataclasses.dataclass
class RolloutConfig:
    """Sampling during RL (`temperature` is also the one log probs are computed at); `agent` makes rollouts
    multi-turn."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    response_length: int = 128
    slots: int = 64
    # positions of the shared prompt KV pool per host (the samples of a prompt share one copy; all data shards
    # together); null: a max_prompt_length prompt per slot (the memory of one copy per sample); GRPO with n samples
    # needs about slots / n prompts' worth; multi-turn (agent) rollouts need null
    prompt_cache_tokens: int | None = None
    seed: int = 0
    ignore_eos: bool = False  # benchmarks: every response runs to response_length
    gen_layout: dict[str, Any] | None = None
    hybrid_engine: Literal["zero_redundancy", "naive"] = "zero_redundancy"
    # optimizer state (and the float32 master, when generation uses a cast copy) in pinned host memory while
    # generating (GPU/TPU)
    offload_optimizer: bool = False
    keep_host_memory: bool = True  # CPU: malloc keeps freed memory, so train <-> gen transitions reuse it
    # a LoRA actor's frozen base: kept in the generation layout for the whole run, where the training passes read it
    # too, so each transition moves the adapters alone (`gen`); or sharded by the training layout and moved into the
    # generation layout before every generation (`train`: usually less memory while training, a gather of the base
    # per step); a disaggregated placement's trainer keeps it in the training layout either way
    lora_base_layout: Literal["gen", "train"] = "gen"
    agent: AgentConfig = dataclasses.field(default_factory=AgentConfig)  # multi-turn rollouts with an environment

    def __post_init__(self) -> None:
        check_fields(
            self,
            n=AT_LEAST_1,
            response_length=AT_LEAST_1,
            slots=AT_LEAST_1,
            prompt_cache_tokens=(lambda v: v is None or v >= 1, "null or >= 1 (positions of the prompt pool)"),
            seed=NON_NEGATIVE,
            # log probs are computed at this temperature (logits / temperature): 0 is no distribution
            temperature=(lambda v: 0 < v < float("inf"), "> 0 (finite; the log probs are taken at it)"),
            top_k=(lambda v: v >= 0, ">= 0 (0 = off)"),
            top_p=(lambda v: 0 < v <= 1, "in (0, 1]"),
        )
        if self.agent.env and self.prompt_cache_tokens is not None:
            raise ValueError(
                f"prompt_cache_tokens: expected null with agent.env set, got {self.prompt_cache_tokens} (multi-turn"
                " rollouts start trajectories one at a time, each may hold a prompt of its own)"
            )
        budget = self.agent.max_tokens_per_trajectory
        if budget > self.response_length:
            raise ValueError(
                f"agent.max_tokens_per_trajectory: {budget} exceeds response_length {self.response_length} (the "
                "trajectory after the prompt is the response)"
            )


@dataclasses.dataclass
class RolloutCorrectionConfig:
    """Off-policy correction, verl's `algorithm.rollout_correction` (decoupled mode) with verl's keys and values:
    before the advantages, the controller weighs tokens by the ratio of the training policy pi_old (old log probs)
    to the rollout policy mu that sampled them (its own log probs) and/or rejects tokens or sequences whose
    divergence leaves a bound (they leave the response mask: the advantages, the losses and their token and sequence
    counts see only the kept ones). The mismatch metrics (`rollout_corr/*`) are logged whatever the settings.
    Quote a "lower_upper" threshold in YAML, or write both bounds with a decimal point: YAML reads 0.5_2 as 0.52."""

    # importance weights per token or per sequence; null: none; auto: token when async.max_staleness > 0, else null
    rollout_is: Literal["auto", "token", "sequence"] | None = "auto"
    # a number u: weights truncated at u (TIS); "lower_upper" (e.g. "0.5_5.0"): weights outside it become 0 (IcePop)
    rollout_is_threshold: str | float = 2.0
    rollout_is_batch_normalize: bool = False  # divide the weights by their mean over the batch
    # rejection: comma-separated options, all must pass (token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2..3)
    rollout_rs: str | None = None
    # one per option (comma-separated) or one for all; k1: "lower_upper" bounds of mu / pi_old, or u for [1/u, u];
    # k2, k3: an upper bound
    rollout_rs_threshold: str | float | None = None

    def __post_init__(self) -> None:
        parse_is_threshold(self.rollout_is_threshold)
        if self.rollout_rs is not None:
            parse_rejection(self.rollout_rs, self.rollout_rs_threshold)

    @property
    def enabled(self) -> bool:
        """Whether weights or rejection change the loss (`rollout_is: auto` resolved by the run config first)."""
        return self.rollout_is is not None or self.rollout_rs is not None


@dataclasses.dataclass
class ActorConfig:
    """The policy: its checkpoint, numerics, training layout, optimizer and PPO update settings."""

    model_path: str = ""
    dtype: Dtype = "float32"  # compute (and generation weights, KV cache)
    param_dtype: Dtype = "float32"  # storage of the trained master copy (optimizer state is always float32)
    train_layout: dict[str, Any] | None = None
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-6))
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 16
    micro_batch_size: int = 8
    policy_loss: str = "ppo"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: Literal[
        "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    # "auto": when an iteration makes a single optimizer step (one epoch, one mini-batch) and the KL is not in the
    # reward, the update's own forward gives the old log probs (detached, so the ratio is exactly 1), saving one
    # forward pass over the batch; "recompute": always a separate pass first (verl's behaviour).
    old_log_prob: Literal["auto", "recompute"] = "auto"
    # Group rows by length and drop the columns that are padding in a whole micro-batch (prompts and responses, to
    # padded lengths 16, 24, 32, 48, 64, ...: a few more compiled shapes) in log-prob passes and updates.
    trim_padding: bool = True
    # Padding-free micro-batches (verl's use_dynamic_bsz with ppo_max_token_len_per_gpu): > 0 packs the sequences of
    # updates and log-prob passes several to a row, one row of at most this many tokens per batch part of the layout
    # (data x fsdp shard) per micro-batch, instead of micro_batch_size padded rows. At least the longest prompt +
    # response_length. 0: off.
    packed_row_tokens: int = 0
    # Activation rematerialisation per decoder layer in the update's backward: "none" keeps every activation,
    # "full" keeps each layer's input and recomputes the rest (least memory, about a third more FLOPs), "dots"
    # keeps the matmul outputs and recomputes the elementwise work.
    remat: Literal["none", "full", "dots"] = "none"
    # Mixture-of-experts models: null sends every token to its experts (each expert's buffer holds a whole row:
    # memory and FLOPs of num_experts x the row); a factor f caps each expert at f x length x k / num_experts slots
    # per row (about f x k x the row), and a token choice past its expert's capacity adds nothing, in the passes
    # that route themselves: the update, log-prob and reference passes, or with router_replay the reference's alone
    # (the actor's update and log-prob passes then replay generation's routes, dropless: every expert generation
    # used is kept). Generation never drops a token.
    expert_capacity_factor: float | None = None
    # Rollout routing replay (mixture-of-experts policies): generation records the experts every layer chose for
    # each token, and the log-prob passes and the update route each token to exactly those (weighted by the
    # policy's own router probabilities, so the router still learns to weigh them), removing the routing mismatch
    # between generation and training. These passes drop no token (expert_capacity_factor caps only the reference,
    # which routes itself).
    router_replay: bool = False
    # Mixture-of-experts policies: the update adds this times transformers' load-balancing loss (Switch
    # Transformer's: experts x sum over experts of the share of choices times the mean router probability, over
    # every layer's real tokens) to the policy loss; 0 leaves it out (the router metrics are reported either way).
    router_aux_loss_coef: float = 0.0
    rollout_correction: RolloutCorrectionConfig = dataclasses.field(default_factory=RolloutCorrectionConfig)
    # Low-rank adapters (rank > 0): the base is frozen and stored in `dtype` (param_dtype applies to nothing then),
    # float32 adapters and their optimizer state are trained, checkpoints hold the adapters, and the reference policy
    # is the base with adapters off (no second copy)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    # Vision-language policies: true keeps the vision tower as the checkpoint has it (no gradients, no optimizer
    # state, not in the actor's checkpoints); the projector into the language model and the language model train.
    freeze_vision_tower: bool = False
    # Vision-language policies: each device encodes at most this many images at once (one step after another), in
    # every pass and in generation's prefill, which bounds the tower's activations (0: all its images at once)
    images_per_step: int = 0

    def __post_init__(self) -> None:
        check_batch_sizes(self)
        self.policy_loss = POLICY_LOSSES.resolve("policy_loss", self.policy_loss)  # a user file's path: absolute
        try:
            check_actor_policy_loss(self.policy_loss)
        except ValueError as exc:
            raise ValueError(f"policy_loss: {exc}") from None
        check_name("kl_loss_type", self.kl_loss_type, KL_NAMES, "KL estimator")
        check_fields(
            self,
            clip_ratio_low=(lambda v: 0 <= v < 1, "in [0, 1) (the ratio's lower bound is 1 - clip_ratio_low > 0)"),
            clip_ratio_high=NON_NEGATIVE,
            clip_ratio_c=(lambda v: v > 1, "> 1 (dual-clip bound on the loss of negative advantages)"),
            entropy_coeff=NON_NEGATIVE,
            kl_loss_coef=NON_NEGATIVE,
            expert_capacity_factor=POSITIVE_OR_NULL,
            router_aux_loss_coef=NON_NEGATIVE,
            images_per_step=NON_NEGATIVE,
        )
        warn_low_precision_master("actor", self.param_dtype)


@dataclasses.dataclass
class CriticConfig:
    """The value model (a causal-LM checkpoint gets a fresh value head) and its update settings."""

    model_path: str = ""
    dtype: Dtype = "float32"  # compute
    param_dtype: Dtype = "float32"  # storage of the trained master copy (optimizer state is always float32)
    layout: dict[str, Any] | None = None
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 16
    micro_batch_size: int = 8
    cliprange_value: float = 0.5
    trim_padding: bool = True  # as `ActorConfig.trim_padding`
    packed_row_tokens: int = 0  # as `ActorConfig.packed_row_tokens`
    remat: Literal["none", "full", "dots"] = "none"  # as `ActorConfig.remat`
    expert_capacity_factor: float | None = None  # as `ActorConfig.expert_capacity_factor`
    loss_agg_mode: Literal[
        "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    # as `ActorConfig.lora`: the base frozen in `dtype`, float32 adapters, and the value head trained in float32
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        check_batch_sizes(self)
        check_fields(self, cliprange_value=POSITIVE, expert_capacity_factor=POSITIVE_OR_NULL)
        warn_low_precision_master("critic", self.param_dtype)


@dataclasses.dataclass
class RewardModelConfig:
    """A sequence-score model (reward or cost); disabled when `model_path` is empty."""

    model_path: str = ""
    dtype: Dtype = "float32"
    layout: dict[str, Any] | None = None
    micro_batch_size: int = 8

    def __post_init__(self) -> None:
        check_fields(self, micro_batch_size=AT_LEAST_1)

    @property
    def enabled(self) -> bool:
        return bool(self.model_path)
