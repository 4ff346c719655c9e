"""verl's optimal token baselines (`optimal_token_baseline`, `tir_optimal_token_baseline`): a per-position
baseline for each prompt group, weighted by each trajectory's cumulative path variance.

For a token with sampling probability pi_t under the old policy, the squared norm of its score function is
estimated by w_t = 1 - 2 pi_t + sum_v pi(v)^2 (`sum_pi_squared`, from `sum_pi_squared_from_logits`), times the
squared rollout importance weight when one is given. W_t = sum of w_j over the valid tokens up to t. With G_t the
return to go, the baseline of a group at position t is B_t = sum_i G_i,t W_i,t / (sum_i W_i,t + 1e-8) over the
group's rows, and the advantage is G_t - B_t on valid tokens. A group of one has baseline 0; when one row of a
group is strictly the longest, its baseline is 0 past the second-longest row's length ("zero tail", verl's default).

`optimal_token_baseline` lines rows up by column; `tir_optimal_token_baseline` (multi-turn, tool-integrated) lines
them up by valid-token count, skipping the observation tokens between turns, and leaves rows without a valid token
out of their group. Both group rows by `index` on the host: call them on the controller, outside `jit`.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from hfjax.algos.advantages import float_mask, group_ids, register_advantage_estimator

BASELINE_EPS = 1e-8  # added to a position's summed path variance before dividing


@jax.jit
def sum_pi_squared_from_logits(logits: jax.Array) -> jax.Array:
    """sum over the last axis of softmax(logits)^2, in at least float32: the `sum_pi_squared` input of the optimal
    token baselines (verl's actor computes it with `calculate_sum_pi_squared`)."""
    logits = jnp.asarray(logits)
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    return jnp.sum(jnp.square(jax.nn.softmax(logits, axis=-1)), axis=-1)


def _per_row(reduce, values: jax.Array, ids: jax.Array, num_groups: int) -> jax.Array:
    return reduce(values, ids, num_segments=num_groups)[ids]


def _group_baselines(
    returns: jax.Array, path_variance: jax.Array, mask: jax.Array, member: jax.Array, ids: jax.Array, num_groups: int
) -> jax.Array:
    """(bs, T) baselines over aligned positions: the path-variance-weighted mean of the group's returns at each
    position, 0 for a group of one member and on the zero tail. `member` (bs,) marks the rows that belong to their
    group (non-members get baseline 0 and count in no group)."""
    weighted = jax.ops.segment_sum(returns * path_variance * mask, ids, num_segments=num_groups)
    total = jax.ops.segment_sum(path_variance * mask, ids, num_segments=num_groups)
    baselines = (weighted / (total + BASELINE_EPS))[ids]
    size = _per_row(jax.ops.segment_sum, member.astype(returns.dtype), ids, num_groups)
    lengths = jnp.where(member, jnp.sum(mask, axis=-1), -1)
    longest = _per_row(jax.ops.segment_max, lengths, ids, num_groups)
    at_longest = _per_row(jax.ops.segment_sum, (lengths == longest).astype(returns.dtype), ids, num_groups)
    second = _per_row(jax.ops.segment_max, jnp.where(lengths == longest, -1, lengths), ids, num_groups)
    alone_longest = member & (lengths == longest) & (at_longest == 1) & (size > 1)
    tail = alone_longest[:, None] & (jnp.arange(returns.shape[-1])[None, :] >= second[:, None])
    return jnp.where(member[:, None] & (size[:, None] > 1) & ~tail, baselines, 0)


def _returns_and_path_variance(
    rewards: jax.Array,
    mask: jax.Array,
    old_log_probs: jax.Array,
    sum_pi_squared: jax.Array,
    rollout_is_weights: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    returns = jnp.flip(jnp.cumsum(jnp.flip(rewards * mask, -1), -1), -1)
    per_token = 1 - 2 * jnp.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        per_token = per_token * jnp.square(rollout_is_weights)
    return returns, jnp.cumsum(per_token * mask, axis=-1)


@partial(jax.jit, static_argnames="num_groups")
def _column_aligned(rewards, mask, old_log_probs, sum_pi_squared, is_weights, ids, num_groups):
    returns, path_variance = _returns_and_path_variance(rewards, mask, old_log_probs, sum_pi_squared, is_weights)
    member = jnp.ones(rewards.shape[:1], bool)
    baselines = _group_baselines(returns, path_variance, mask, member, ids, num_groups)
    return (returns - baselines) * mask, returns


@partial(jax.jit, static_argnames="num_groups")
def _token_aligned(rewards, mask, old_log_probs, sum_pi_squared, is_weights, ids, num_groups):
    returns, path_variance = _returns_and_path_variance(rewards, mask, old_log_probs, sum_pi_squared, is_weights)
    bs, length = rewards.shape
    valid = mask != 0
    slot = jnp.where(valid, jnp.cumsum(valid, axis=-1) - 1, length)  # a valid token's rank in its row; else a spare
    rows = jnp.arange(bs)[:, None]

    def packed(values):  # valid tokens moved to the front of their row, zeros after them
        return jnp.zeros((bs, length + 1), values.dtype).at[rows, slot].set(values)[:, :length]

    packed_mask = packed(mask)
    member = jnp.any(valid, axis=-1)
    baselines = _group_baselines(packed(returns), packed(path_variance), packed_mask, member, ids, num_groups)
    packed_advantages = (packed(returns) - baselines) * packed_mask
    advantages = jnp.take_along_axis(packed_advantages, jnp.minimum(slot, length - 1), axis=-1)
    return jnp.where(valid, advantages, 0) * mask, returns


def _optimal_baseline(aligned, token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, weights):
    rewards = token_level_rewards
    ids, num_groups = group_ids(index)

    def same_dtype(array):
        return None if array is None else jnp.asarray(array, rewards.dtype)

    return aligned(
        rewards,
        float_mask(rewards, response_mask),
        same_dtype(old_log_probs),
        same_dtype(sum_pi_squared),
        same_dtype(weights),
        jnp.asarray(ids),
        num_groups,
    )


@register_advantage_estimator("optimal_token_baseline")
def optimal_token_baseline_advantage(
    token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, rollout_is_weights=None
):
    """Optimal token baseline, positions aligned by column (see the module docstring); returns = returns to go."""
    return _optimal_baseline(
        _column_aligned, token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, rollout_is_weights
    )


@register_advantage_estimator("tir_optimal_token_baseline")
def tir_optimal_token_baseline_advantage(
    token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, rollout_is_weights=None
):
    """Optimal token baseline, positions aligned by valid-token count (multi-turn; see the module docstring);
    returns = returns to go."""
    return _optimal_baseline(
        _token_aligned, token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, rollout_is_weights
    )
