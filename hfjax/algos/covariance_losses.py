"""verl's covariance-based policy losses, Clip-Cov and KL-Cov (arXiv 2505.22617, "The Entropy Mechanism of
Reinforcement Learning for Reasoning Language Models"), registered under verl's names `clip_cov` and `kl_cov`.

Both score each valid token by the covariance term (A - mean A) * (logp - mean logp) over the micro-batch's valid
tokens and treat a small share of tokens differently: Clip-Cov takes a random subset of tokens whose covariance
lies in (clip_cov_lb, clip_cov_ub) out of the gradient; KL-Cov adds a |log ratio| penalty to the tokens of largest
covariance. The ratio r = exp(logp - old_logp) is not clamped (as in verl). The signature is that of the built-in
losses (`hfjax.algos.losses`). Pure `jax.numpy`, differentiable; the token selection carries no gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hfjax.algos.losses import PolicyLossOutput, aggregate_token_losses, register_policy_loss, token_share
from hfjax.algos.masked import masked_mean, masked_sum

Counts = jax.Array | float | None


def _lowest(priority: jax.Array, eligible: jax.Array, count: jax.Array) -> jax.Array:
    """Boolean mask of the `count` eligible positions of lowest `priority` (all eligible ones when fewer)."""
    flat = jnp.where(eligible, priority, jnp.inf).ravel()
    ranks = jnp.zeros(flat.shape, jnp.int32).at[jnp.argsort(flat)].set(jnp.arange(flat.size, dtype=jnp.int32))
    return eligible & (ranks.reshape(priority.shape) < count)


def _share_of_tokens(ratio: float, valid: jax.Array) -> jax.Array:
    """max(floor(ratio * valid tokens), 1): how many tokens the covariance losses select (verl's int() of it)."""
    return jnp.maximum(jnp.floor(ratio * jnp.sum(valid)), 1)


def batch_key(old_log_prob: jax.Array, valid: jax.Array) -> jax.Array:
    """A PRNG key derived from the bits of the batch's summed old log probs: a different draw for every batch, the
    same draw for the same batch (reproducible; verl draws from torch's global generator)."""
    total = jnp.sum(jnp.where(valid, old_log_prob, 0)).astype(jnp.float32)
    return jax.random.key(jax.lax.bitcast_convert_type(total, jnp.int32))


@register_policy_loss("clip_cov")
def clip_cov_policy_loss(
    old_log_prob: jax.Array,
    log_prob: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    loss_agg_mode: str = "token-mean",
    global_tokens: Counts = None,
    global_seqs: Counts = None,
    norm_length: int | None = None,
    token_weights: jax.Array | None = None,
) -> PolicyLossOutput:
    """Clip-Cov: PPO's clipped token loss max(-A r, -A clip(r, 1 - low, 1 + high)) (no dual clip), with
    max(floor(clip_cov_ratio * valid tokens), 1) tokens set to 0: drawn uniformly (`batch_key`) among the valid
    tokens that PPO's clip leaves unclipped and whose covariance (A - mean A) * (logp - mean logp) lies strictly
    between clip_cov_lb and clip_cov_ub (means: `masked_mean` over the valid tokens).

    pg_clipfrac: share of the tokens set to 0; pg_clipfrac_lower: 0 (verl reports none).
    """
    if not clip_cov_ratio > 0:
        raise ValueError(f"clip_cov_ratio (share of tokens Clip-Cov detaches) must be > 0, got {clip_cov_ratio}")
    mask = jnp.asarray(response_mask).astype(log_prob.dtype)
    valid = mask != 0
    log_ratio = log_prob - old_log_prob
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    logp = jax.lax.stop_gradient(log_prob)
    covariance = (advantages - masked_mean(advantages, mask)) * (logp - masked_mean(logp, mask))
    candidate = valid & ~(clipped > unclipped) & (covariance > clip_cov_lb) & (covariance < clip_cov_ub)
    draw = jax.random.uniform(batch_key(old_log_prob, valid), log_prob.shape)
    detached = _lowest(draw, candidate, _share_of_tokens(clip_cov_ratio, valid))
    keep = 1 - detached.astype(log_prob.dtype)
    pg_loss = aggregate_token_losses(
        jnp.maximum(unclipped, clipped) * keep,
        mask,
        token_weights,
        loss_agg_mode,
        global_tokens,
        global_seqs,
        norm_length,
    )
    pg_clipfrac = token_share(1 - keep, mask, global_tokens)
    return pg_loss, pg_clipfrac, token_share(-log_ratio, mask, global_tokens), jnp.zeros((), pg_loss.dtype)


@register_policy_loss("kl_cov")
def kl_cov_policy_loss(
    old_log_prob: jax.Array,
    log_prob: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
    loss_agg_mode: str = "token-mean",
    global_tokens: Counts = None,
    global_seqs: Counts = None,
    norm_length: int | None = None,
    token_weights: jax.Array | None = None,
) -> PolicyLossOutput:
    """KL-Cov: token loss -A r, plus ppo_kl_coef * |logp - old_logp| on the max(floor(kl_cov_ratio * valid tokens),
    1) valid tokens of largest covariance (A - mean A) * (logp - mean logp) (plain means over the valid tokens).

    ppo_kl: the token mean of |logp - old_logp| (verl reports the absolute value here); clip fractions are 0.
    """
    if not kl_cov_ratio > 0:
        raise ValueError(f"kl_cov_ratio (share of tokens KL-Cov penalises) must be > 0, got {kl_cov_ratio}")
    mask = jnp.asarray(response_mask).astype(log_prob.dtype)
    valid = mask != 0
    log_ratio = log_prob - old_log_prob
    ratio = jnp.exp(log_ratio)
    logp = jax.lax.stop_gradient(log_prob)
    count = jnp.maximum(jnp.sum(mask), 1)
    covariance = (advantages - masked_sum(advantages, mask) / count) * (logp - masked_sum(logp, mask) / count)
    penalised = _lowest(-covariance, valid, _share_of_tokens(kl_cov_ratio, valid)).astype(log_prob.dtype)
    token_losses = -advantages * ratio + penalised * ppo_kl_coef * jnp.abs(log_ratio)
    pg_loss = aggregate_token_losses(
        token_losses, mask, token_weights, loss_agg_mode, global_tokens, global_seqs, norm_length
    )
    zero = jnp.zeros((), pg_loss.dtype)
    return pg_loss, zero, token_share(jnp.abs(log_ratio), mask, global_tokens), zero
