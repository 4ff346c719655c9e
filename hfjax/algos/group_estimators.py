"""verl's other outcome estimators with a group baseline: GPG, GRPO for Pass@k and GDPO, registered under verl's names.

Like GRPO they score a row by its summed token rewards, group rows by `index` on the host, and give every valid
token of a row the row's scalar advantage (returns = advantages); call them on the controller, outside `jit`.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from hfjax.algos.advantages import (
    GROUP_STD_EPS,
    float_mask,
    group_ids,
    group_stats,
    grpo_scores,
    outcome_advantages,
    register_advantage_estimator,
)
from hfjax.algos.masked import masked_whiten


@register_advantage_estimator("gpg")
def gpg_advantage(token_level_rewards, response_mask, index):
    """GPG (arXiv 2504.02546): alpha * (score - group mean), alpha = rows / rows with a non-zero score (at least 1).

    No division by the group std; a group of one has mean 0 (it keeps alpha * score). verl's `f_norm` is 1.
    """
    g = group_stats(token_level_rewards, response_mask, index)
    rows = g.scores.shape[0]
    alpha = rows / jnp.maximum(jnp.count_nonzero(g.scores), 1)
    return outcome_advantages(alpha * (g.scores - g.mean), response_mask)


@partial(jax.jit, static_argnames=("num_groups", "norm_adv_by_std"))
def _passk_scores(
    scores: jax.Array, std: jax.Array, ids: jax.Array, num_groups: int, norm_adv_by_std: bool
) -> jax.Array:
    def per_row(reduce, per_row_values):
        return reduce(per_row_values, ids, num_segments=num_groups)[ids]

    rows = jnp.arange(scores.shape[0])
    best = per_row(jax.ops.segment_max, scores)
    first_best = per_row(jax.ops.segment_min, jnp.where(scores == best, rows, scores.shape[0]))
    chosen = rows == first_best
    runner_up = per_row(jax.ops.segment_max, jnp.where(chosen, -jnp.inf, scores))
    gap = best - runner_up
    return jnp.where(chosen, gap / (std + GROUP_STD_EPS) if norm_adv_by_std else gap, 0).astype(scores.dtype)


@register_advantage_estimator("grpo_passk")
def grpo_passk_advantage(token_level_rewards, response_mask, index, norm_adv_by_std):
    """GRPO for Pass@k (arXiv 2503.19595): only the best response of a group gets an advantage, best score minus
    the second best, divided by (unbiased group std + 1e-6) when `norm_adv_by_std`; every other row gets 0.

    The first of tied best rows is the chosen one (the gap is then 0 anyway). Every group needs at least two rows.
    """
    ids, num_groups = group_ids(index)
    sizes = np.bincount(ids, minlength=num_groups)
    if (sizes < 2).any():
        key = index[int(np.flatnonzero(sizes[ids] < 2)[0])]
        raise ValueError(f"grpo_passk needs at least 2 responses per prompt group (index), got 1 for group {key!r}")
    g = group_stats(token_level_rewards, response_mask, index)
    scores = _passk_scores(g.scores, g.std, jnp.asarray(ids), num_groups, norm_adv_by_std)
    return outcome_advantages(scores, response_mask)


@register_advantage_estimator("gdpo")
def gdpo_advantage(
    token_level_rewards, response_mask, index, norm_adv_by_std, reward_components=None, reward_component_weights=None
):
    """GDPO (arXiv 2601.05242): GRPO advantages of each reward component separately (group mean and std of that
    component), summed with `reward_component_weights` (default all 1), then whitened over the valid tokens of the
    batch (verl's `masked_whiten`) and masked.

    `reward_components` (bs, K) holds one score per row and component (verl: the `algorithm.gdpo_reward_keys` of
    the reward function's output); without it the single component is the row's summed token rewards.
    """
    mask = float_mask(token_level_rewards, response_mask)
    if reward_components is None:
        components = jnp.sum(token_level_rewards, axis=-1, keepdims=True)
    else:
        components = jnp.asarray(reward_components, token_level_rewards.dtype)
    count = components.shape[-1]
    weights = np.ones(count) if reward_component_weights is None else np.asarray(reward_component_weights, np.float64)
    ones = jnp.ones_like(components[:, :1])
    combined = sum(
        weights[k] * grpo_scores(group_stats(components[:, k : k + 1], ones, index), norm_adv_by_std)
        for k in range(count)
    )
    advantages = masked_whiten(combined[:, None] * mask, mask) * mask
    return advantages, advantages
