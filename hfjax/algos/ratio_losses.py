"""verl's policy losses that reshape the importance ratio r = pi / pi_old: SAPO, CISPO, DPPO (TV and KL trust
regions), GMPO (`geo_mean`) and DRO, registered under verl's names.

Each has the signature of the built-in losses (`hfjax.algos.losses`): the four (bs, T) arrays, then keyword-only
`loss_agg_mode`, the mini-batch counts (`global_tokens`, `global_seqs`, `norm_length`), its own settings with verl's
defaults, and `token_weights`; it returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower), the metrics being
`token_share`s (0 where verl reports none). Pure `jax.numpy`, differentiable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hfjax.algos.losses import (
    LOG_RATIO_CLAMP,
    PolicyLossOutput,
    aggregate_token_losses,
    mask_counts,
    register_policy_loss,
    safe_divide,
    token_share,
)
from hfjax.algos.masked import masked_sum

Counts = jax.Array | float | None
DPPO_PROB_EPS = 1e-8  # keeps log((1 - p_old) / (1 - p)) finite in DPPO's binary KL
GMPO_LENGTH_EPS = 1e-8  # added to a sequence's token count in GMPO's per-sequence means
GMPO_WEIGHT_EPS = 1e-10  # added to an importance weight before its log in GMPO's geometric mean


def _clamped_log_ratio(old_log_prob: jax.Array, log_prob: jax.Array) -> jax.Array:
    return jnp.clip(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


@register_policy_loss("sapo")
def sapo_policy_loss(
    old_log_prob: jax.Array,
    log_prob: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    loss_agg_mode: str = "seq-mean-token-mean",
    global_tokens: Counts = None,
    global_seqs: Counts = None,
    norm_length: int | None = None,
    token_weights: jax.Array | None = None,
) -> PolicyLossOutput:
    """SAPO (arXiv 2511.20347): token loss -A * sigmoid(tau (r - 1)) * 4 / tau, a smooth gate instead of a clip,
    tau = tau_pos where A > 0 and tau_neg elsewhere; r = exp(clamp(logp - old_logp, -20, 20)).

    Always aggregated seq-mean-token-mean, whatever `loss_agg_mode` says (as verl does); clip fractions are 0.
    """
    del loss_agg_mode  # SAPO is defined with sequence-level aggregation
    log_ratio = _clamped_log_ratio(old_log_prob, log_prob)
    ratio = jnp.exp(log_ratio)
    tau = jnp.where(advantages > 0, tau_pos, tau_neg).astype(ratio.dtype)
    gates = jax.nn.sigmoid(tau * (ratio - 1)) * 4 / tau
    pg_loss = aggregate_token_losses(
        -gates * advantages,
        response_mask,
        token_weights,
        "seq-mean-token-mean",
        global_tokens,
        global_seqs,
        norm_length,
    )
    zero = jnp.zeros((), pg_loss.dtype)
    return pg_loss, zero, token_share(-log_ratio, response_mask, global_tokens), zero


@register_policy_loss("cispo")
def cispo_policy_loss(
    old_log_prob: jax.Array,
    log_prob: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: str = "token-mean",
    global_tokens: Counts = None,
    global_seqs: Counts = None,
    norm_length: int | None = None,
    token_weights: jax.Array | None = None,
) -> PolicyLossOutput:
    """CISPO (arXiv 2506.13585): token loss -sg[clip(r, 1 - low, 1 + high)] * A * logp: the clipped ratio weighs a
    REINFORCE term, so every token keeps a gradient. pg_clipfrac: share of tokens whose ratio was clipped."""
    log_ratio = _clamped_log_ratio(old_log_prob, log_prob)
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_loss = aggregate_token_losses(
        -jax.lax.stop_gradient(clipped) * advantages * log_prob,
        response_mask,
        token_weights,
        loss_agg_mode,
        global_tokens,
        global_seqs,
        norm_length,
    )
    pg_clipfrac = token_share((ratio != clipped).astype(ratio.dtype), response_mask, global_tokens)
    return pg_loss, pg_clipfrac, token_share(-log_ratio, response_mask, global_tokens), jnp.zeros((), ratio.dtype)


def _dppo_loss(
    old_log_prob: jax.Array,
    log_prob: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    inside: jax.Array,
    clip_ratio_c: float,
    agg: tuple[str, Counts, Counts, int | None],
    token_weights: jax.Array | None,
) -> PolicyLossOutput:
    """DPPO's token loss -A * sg[min(r, clip_ratio_c)] * logp on the tokens `inside` the trust region (0 outside).
    pg_clipfrac: share of tokens outside; pg_clipfrac_lower: share inside whose ratio exceeds clip_ratio_c."""
    loss_agg_mode, global_tokens, global_seqs, norm_length = agg
    log_ratio = _clamped_log_ratio(old_log_prob, log_prob)
    ratio = jnp.exp(log_ratio)
    inside = jax.lax.stop_gradient(inside.astype(ratio.dtype))
    truncated = jax.lax.stop_gradient(jnp.minimum(ratio, clip_ratio_c))
    pg_loss = aggregate_token_losses(
        -advantages * truncated * log_prob * inside,
        response_mask,
        token_weights,
        loss_agg_mode,
        global_tokens,
        global_seqs,
        norm_length,
    )
    pg_clipfrac = token_share(1 - inside, response_mask, global_tokens)
    pg_clipfrac_lower = token_share((ratio > clip_ratio_c).astype(ratio.dtype) * inside, response_mask, global_tokens)
    return pg_loss, pg_clipfrac, token_share(-log_ratio, response_mask, global_tokens), pg_clipfrac_lower


@register_policy_loss("dppo_tv")
def dppo_tv_policy_loss(
    old_log_prob: jax.Array,
    log_prob: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 20.0,
    loss_agg_mode: str = "token-mean",
    global_tokens: Counts = None,
    global_seqs: Counts = None,
    norm_length: int | None = None,
    token_weights: jax.Array | None = None,
) -> PolicyLossOutput:
    """DPPO-Binary-TV (arXiv 2602.04879): a token stays in the loss while its probability moved by at most
    `clip_ratio_high` up (A > 0) or `clip_ratio_low` down (A <= 0), p - p_old; its loss is then -A * sg[min(r,
    clip_ratio_c)] * logp (truncated IS; the actor passes `actor.clip_ratio_c`, 3.0 by default as in verl)."""
    moved = jnp.exp(log_prob) - jnp.exp(old_log_prob)
    inside = jnp.where(advantages > 0, moved <= clip_ratio_high, moved >= -clip_ratio_low)
    agg = (loss_agg_mode, global_tokens, global_seqs, norm_length)
    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, inside, clip_ratio_c, agg, token_weights)


@register_policy_loss("dppo_kl")
def dppo_kl_policy_loss(
    old_log_prob: jax.Array,
    log_prob: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 20.0,
    loss_agg_mode: str = "token-mean",
    global_tokens: Counts = None,
    global_seqs: Counts = None,
    norm_length: int | None = None,
    token_weights: jax.Array | None = None,
) -> PolicyLossOutput:
    """DPPO-Binary-KL (arXiv 2602.04879): as `dppo_tv` with the trust region the binary KL
    p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8)) <= `clip_ratio_high` (A > 0) or
    `clip_ratio_low` (A <= 0); a token whose probability moved against its advantage's direction always stays."""
    prob, old_prob = jnp.exp(log_prob), jnp.exp(old_log_prob)
    binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * jnp.log(
        (1 - old_prob + DPPO_PROB_EPS) / (1 - prob + DPPO_PROB_EPS)
    )
    inside = jnp.where(
        advantages > 0,
        (binary_kl <= clip_ratio_high) | (prob <= old_prob),
        (binary_kl <= clip_ratio_low) | (prob >= old_prob),
    )
    agg = (loss_agg_mode, global_tokens, global_seqs, norm_length)
    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, inside, clip_ratio_c, agg, token_weights)


@register_policy_loss("geo_mean")
def geo_mean_policy_loss(
    old_log_prob: jax.Array,
    log_prob: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: str = "token-mean",
    global_tokens: Counts = None,
    global_seqs: Counts = None,
    norm_length: int | None = None,
    token_weights: jax.Array | None = None,
) -> PolicyLossOutput:
    """GMPO (arXiv 2507.20673): sequence loss -mean(A) * exp(mean of the clipped log ratios), means over the
    sequence's valid tokens (+1e-8). Each token's log ratio is clipped to [-low, high] only where that lowers the
    objective's value for its advantage's sign (the pessimistic side, as PPO's min).

    The loss is the mean of the sequence losses over the mini-batch's rows (`global_seqs`, else this batch's rows),
    whatever `loss_agg_mode` says (verl: `torch.mean` over the rows); `token_weights` enter as their geometric mean
    per sequence. pg_clipfrac / pg_clipfrac_lower: share of tokens whose log ratio was clipped, with A > 0 / A < 0.
    """
    del loss_agg_mode, norm_length  # GMPO is defined as a mean over sequences
    mask = jnp.asarray(response_mask).astype(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    sign = jnp.sign(advantages)
    clipped = jnp.clip(log_ratio, -clip_ratio_low, clip_ratio_high)
    pessimistic = sign * jnp.minimum(sign * log_ratio, sign * clipped)
    lengths = jnp.sum(mask, axis=-1) + GMPO_LENGTH_EPS
    seq_ratio = jnp.exp(masked_sum(pessimistic, mask, axis=-1) / lengths)
    seq_advantage = masked_sum(advantages, mask, axis=-1) / lengths
    seq_losses = -seq_advantage * seq_ratio
    if token_weights is not None:
        seq_losses = seq_losses * jnp.exp(masked_sum(jnp.log(token_weights + GMPO_WEIGHT_EPS), mask, axis=-1) / lengths)
    rows = mask_counts(mask)[1] if global_seqs is None else global_seqs
    pg_loss = safe_divide(jnp.sum(seq_losses), rows)
    was_clipped = (log_ratio != clipped).astype(mask.dtype)
    pg_clipfrac = token_share(was_clipped * (advantages > 0), mask, global_tokens)
    pg_clipfrac_lower = token_share(was_clipped * (advantages < 0), mask, global_tokens)
    return pg_loss, pg_clipfrac, token_share(-log_ratio, mask, global_tokens), pg_clipfrac_lower


@register_policy_loss("dro")
def dro_policy_loss(
    old_log_prob: jax.Array,
    log_prob: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    dro_beta: float,
    loss_agg_mode: str = "token-mean",
    global_tokens: Counts = None,
    global_seqs: Counts = None,
    norm_length: int | None = None,
    token_weights: jax.Array | None = None,
) -> PolicyLossOutput:
    """DRO (Direct Reward Optimisation, as verl defines it): token loss -(A * logp - dro_beta / 2 * (logp -
    old_logp)^2), a policy gradient with a quadratic penalty on the log ratio. `dro_beta` (> 0) has no default, as
    in verl; clip fractions are 0."""
    if not dro_beta > 0:
        raise ValueError(f"dro_beta (DRO's quadratic log-ratio penalty) must be > 0, got {dro_beta}")
    log_ratio = log_prob - old_log_prob
    pg_loss = aggregate_token_losses(
        -(advantages * log_prob - 0.5 * dro_beta * jnp.square(log_ratio)),
        response_mask,
        token_weights,
        loss_agg_mode,
        global_tokens,
        global_seqs,
        norm_length,
    )
    zero = jnp.zeros((), pg_loss.dtype)
    return pg_loss, zero, token_share(-log_ratio, response_mask, global_tokens), zero
