"""RL math as pure functions of arrays: masked statistics, advantage estimators, KL penalties and controllers, policy
and value losses, loss aggregation, off-policy rollout correction, PF-PPO resampling. Estimators and policy losses
are chosen by registered name (verl's names included) or as user code `path/to/file.py:function`; importing this
package registers every built-in one."""

from hfjax.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    ESTIMATOR_INPUTS,
    advantage_estimators,
    compute_advantage,
    group_ids,
    register_advantage_estimator,
)
from hfjax.algos.bypass_loss import bypass_mode_policy_loss
from hfjax.algos.covariance_losses import clip_cov_policy_loss, kl_cov_policy_loss
from hfjax.algos.group_estimators import gdpo_advantage, gpg_advantage, grpo_passk_advantage
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
from hfjax.algos.pf_ppo import PF_PPO_METHODS, pf_ppo_indices, pf_ppo_weights
from hfjax.algos.ratio_losses import (
    cispo_policy_loss,
    dppo_kl_policy_loss,
    dppo_tv_policy_loss,
    dro_policy_loss,
    geo_mean_policy_loss,
    sapo_policy_loss,
)
from hfjax.algos.rollout_correction import IS_LEVELS, mismatch_metrics, rollout_correction
from hfjax.algos.rollout_rejection import REJECTION_OPTIONS
from hfjax.algos.token_baselines import (
    optimal_token_baseline_advantage,
    sum_pi_squared_from_logits,
    tir_optimal_token_baseline_advantage,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "ESTIMATOR_INPUTS",
    "IS_LEVELS",
    "PF_PPO_METHODS",
    "POLICY_LOSSES",
    "REJECTION_OPTIONS",
    "AdaptiveKLController",
    "FixedKLController",
    "actor_options",
    "advantage_estimators",
    "agg_loss",
    "bypass_mode_policy_loss",
    "cispo_policy_loss",
    "clip_cov_policy_loss",
    "compute_advantage",
    "dppo_kl_policy_loss",
    "dppo_tv_policy_loss",
    "dro_policy_loss",
    "entropy_from_logits",
    "gdpo_advantage",
    "geo_mean_policy_loss",
    "gpg_advantage",
    "group_ids",
    "grpo_passk_advantage",
    "gspo_policy_loss",
    "kl_cov_policy_loss",
    "kl_penalty",
    "logprobs_from_logits",
    "make_kl_controller",
    "mask_counts",
    "masked_mean",
    "masked_seq_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mismatch_metrics",
    "optimal_token_baseline_advantage",
    "pf_ppo_indices",
    "pf_ppo_weights",
    "pg_policy_loss",
    "policy_loss",
    "policy_losses",
    "ppo_policy_loss",
    "register_advantage_estimator",
    "register_policy_loss",
    "rollout_correction",
    "sapo_policy_loss",
    "sum_pi_squared_from_logits",
    "tir_optimal_token_baseline_advantage",
    "token_share",
    "value_loss",
]
