"""RL math as pure functions of arrays: masked statistics, advantage estimators, KL penalties and controllers, policy
and value losses, loss aggregation, off-policy rollout correction. Estimators and policy losses are chosen by
registered name or as user code `path/to/file.py:function`. Imports `hfjax.user_code` and `hfjax.typed_config` (for
the registries) and nothing else from hfjax outside this package."""

from hfjax.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    ESTIMATOR_INPUTS,
    advantage_estimators,
    compute_advantage,
    group_ids,
    register_advantage_estimator,
)
from hfjax.algos.kl import AdaptiveKLController, FixedKLController, kl_penalty, make_kl_controller
from hfjax.algos.losses import (
    AGG_MODES,
    POLICY_LOSSES,
    actor_options,
    agg_loss,
    entropy_from_logits,
    gspo_policy_loss,
    logprobs_from_logits,
    mask_counts,
    pg_policy_loss,
    policy_loss,
    policy_losses,
    ppo_policy_loss,
    register_policy_loss,
    token_share,
    value_loss,
)
from hfjax.algos.masked import masked_mean, masked_seq_mean, masked_sum, masked_var, masked_whiten
from hfjax.algos.rollout_correction import CORRECTION_LEVELS, rollout_correction

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "CORRECTION_LEVELS",
    "ESTIMATOR_INPUTS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "actor_options",
    "advantage_estimators",
    "agg_loss",
    "compute_advantage",
    "entropy_from_logits",
    "group_ids",
    "gspo_policy_loss",
    "kl_penalty",
    "logprobs_from_logits",
    "make_kl_controller",
    "mask_counts",
    "masked_mean",
    "masked_seq_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "pg_policy_loss",
    "policy_loss",
    "policy_losses",
    "ppo_policy_loss",
    "register_advantage_estimator",
    "register_policy_loss",
    "rollout_correction",
    "token_share",
    "value_loss",
]
