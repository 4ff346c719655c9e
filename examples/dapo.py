"""DAPO (Yu et al. 2025, arXiv 2503.14476) written over hfjax's step API, in a file of its own: nothing here is
built into hfjax. A run points at it from its config (see examples/dapo.yaml and docs/algorithms.md):

    algorithm.program: examples/dapo.py:program              dynamic sampling: only groups with varied rewards train
    algorithm.adv_estimator: examples/dapo.py:overlong_grpo  soft overlong punishment, then GRPO advantages
    actor.policy_loss: examples/dapo.py:clip_higher_loss     clip-higher, token-level loss, no KL

Set `actor.clip_ratio_high` above `actor.clip_ratio_low` (DAPO: 0.28 and 0.2) and leave `actor.use_kl_loss` off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from hfjax.algos import agg_loss, compute_advantage, group_ids, token_share

if TYPE_CHECKING:
    from hfjax.trainer.step import Step

ROLES: list[str] = []  # the roles this program calls besides the actor: none (no critic, no cost model)
OVERLONG_BUFFER = 0.5  # the last half of rollout.response_length is punished softly (DAPO: 4096 of 20480 tokens)
OVERLONG_PENALTY = 1.0  # the punishment of a response that reaches rollout.response_length


def varied_groups(scores: np.ndarray, uids: np.ndarray) -> np.ndarray:
    """Rows whose prompt group's scores are not all equal: a group that all solved, or all failed, has advantage 0
    for every response and teaches nothing."""
    ids, groups = group_ids(uids)
    low, high = np.full(groups, np.inf), np.full(groups, -np.inf)
    np.minimum.at(low, ids, scores)
    np.maximum.at(high, ids, scores)
    return (high > low)[ids]


def program(step: Step) -> None:
    """GRPO's dataflow with DAPO's dynamic sampling as a filter: the update learns from the groups whose rewards
    differ, and their tokens alone set the loss's token count. (DAPO also samples more prompts until the batch is
    full of such groups; here the batch shrinks instead.)"""
    step.generate()
    step.score()
    keep = varied_groups(step.batch.batch["scores"], step.batch.non_tensor_batch["uid"])
    step.metrics["dapo/kept_groups_fraction"] = float(keep.mean())
    step.old_log_prob()
    step.ref_log_prob()
    step.advantages()  # algorithm.adv_estimator: overlong_grpo below
    if keep.any():
        step.update_actor(rows=keep)


def overlong_grpo(
    token_level_rewards: jax.Array, response_mask: jax.Array, index: np.ndarray, norm_adv_by_std: bool
) -> tuple[jax.Array, jax.Array]:
    """DAPO's soft overlong punishment, then GRPO's group-relative advantages. A response of L tokens loses
    OVERLONG_PENALTY * (L - (T - C)) / C once L passes T - C (T: the rollout's response length, the batch's width;
    C: OVERLONG_BUFFER of T), taken on its last token."""
    mask = jnp.asarray(response_mask, jnp.float32)
    width = mask.shape[-1]
    buffer = max(1, round(OVERLONG_BUFFER * width))
    lengths = mask.sum(-1)
    penalty = OVERLONG_PENALTY * jnp.clip((lengths - (width - buffer)) / buffer, 0.0, 1.0)
    last_token = jax.nn.one_hot(lengths.astype(jnp.int32) - 1, width) * (lengths > 0)[:, None]
    shaped = jnp.asarray(token_level_rewards, jnp.float32) - penalty[:, None] * last_token
    return compute_advantage(
        "grpo", token_level_rewards=shaped, response_mask=mask, index=index, norm_adv_by_std=norm_adv_by_std
    )


def clip_higher_loss(
    old_log_prob: jax.Array,
    log_prob: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    loss_agg_mode: str = "token-mean",
    global_tokens: jax.Array | None = None,
    global_seqs: jax.Array | None = None,
    norm_length: int | None = None,
    token_weights: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """PPO's clipped loss with decoupled bounds: the ratio r is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high],
    so a larger clip_ratio_high lets unlikely tokens with positive advantages grow (clip-higher); no dual clip. Every
    token weighs the same whatever its response's length: token-level aggregation over the mini-batch's tokens,
    whatever `actor.loss_agg_mode` says. Returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)."""
    del loss_agg_mode, global_seqs, norm_length  # token-level by definition
    log_ratio = jnp.clip(log_prob - old_log_prob, -20.0, 20.0)
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    token_losses = jnp.maximum(unclipped, clipped)
    if token_weights is not None:  # off-policy rollout correction
        token_losses = token_losses * token_weights
    pg_loss = agg_loss(token_losses, response_mask, "token-mean", global_tokens=global_tokens)
    clipfrac = token_share((clipped > unclipped).astype(ratio.dtype), response_mask, global_tokens)
    ppo_kl = token_share(-log_ratio, response_mask, global_tokens)
    return pg_loss, clipfrac, ppo_kl, jnp.zeros((), ratio.dtype)
