"""Off-policy (rollout) correction for asynchronous RL: importance weights pi_old / mu between the proximal policy
pi_old (`old_log_probs`, recomputed by the trainer) and the rollout policy mu (`rollout_log_probs`, from generation),
truncated (TIS) into per-token loss weights and/or used to reject tokens or sequences (MIS) from the loss mask, plus
mismatch metrics.

Pure `jax.numpy`, for jitted training steps; the weights and mask are constants of the loss (no gradient flows
through them). Pass `is_weights` as a policy loss's `token_weights` and `loss_mask` as its `response_mask`. Imports
`hfjax.algos.masked` only; must not import losses, workers, trainer or models.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hfjax.algos.masked import masked_mean, masked_sum

CORRECTION_LEVELS = ("none", "token", "sequence")
LOG_RATIO_CLAMP = 20.0  # log(pi_old / mu) is clamped to [-20, 20] (per token, and per sequence sum) before exp


def _check_level(argument: str, level: str) -> None:
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"{argument} must be one of {list(CORRECTION_LEVELS)}, got {level!r}")


def _positive(argument: str, value: float, meaning: str) -> float:
    value = float(value)
    if not value > 0:  # also rejects NaN
        raise ValueError(f"{argument} ({meaning}) must be > 0, got {value}")
    return value


def _extreme(values: jax.Array, valid: jax.Array, reduce, fill: float) -> jax.Array:
    """max/min of `values` over `valid` positions; 0 when none is valid."""
    picked = reduce(jnp.where(valid, values, fill))
    return jnp.where(jnp.any(valid), picked, 0).astype(values.dtype)


def rollout_correction(
    old_log_probs: jax.Array,
    rollout_log_probs: jax.Array,
    response_mask: jax.Array,
    *,
    is_level: str = "none",
    is_threshold: float = 2.0,
    rs_level: str = "none",
    rs_threshold: float = 2.0,
    rs_threshold_lower: float | None = None,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(is_weights, loss_mask, metrics) for (bs, T) log-probs of pi_old and mu and a 0/1 `response_mask`.

    Ratios pi_old / mu: per token exp(clamp(old - rollout, +-20)); per sequence exp(clamp(sum over valid tokens of
    old - rollout, +-20)), broadcast over the sequence. TIS (`is_level` "token" / "sequence"): is_weights =
    min(ratio, is_threshold) on valid tokens, 0 elsewhere; "none": the mask itself. MIS (`rs_level`): tokens whose
    ratio at that level lies outside [rs_threshold_lower (default 1 / rs_threshold), rs_threshold] leave loss_mask;
    "none": loss_mask = mask. Results are in at least float32; metrics (`rollout_corr/...`) are masked over valid
    tokens and 0, not NaN, for a batch with none.
    """
    _check_level("is_level", is_level)
    _check_level("rs_level", rs_level)
    is_threshold = _positive("is_threshold", is_threshold, "the cap on the importance weights")
    rs_threshold = _positive("rs_threshold", rs_threshold, "the upper bound of the accepted ratios")
    lower = 1.0 / rs_threshold if rs_threshold_lower is None else float(rs_threshold_lower)
    if not 0 < lower <= rs_threshold:
        raise ValueError(
            "rs_threshold_lower (the lower bound of the accepted ratios) must satisfy "
            f"0 < rs_threshold_lower <= rs_threshold = {rs_threshold}, got {lower}"
        )

    old = jax.lax.stop_gradient(jnp.asarray(old_log_probs))
    rollout = jax.lax.stop_gradient(jnp.asarray(rollout_log_probs))
    dtype = jnp.promote_types(jnp.result_type(old, rollout), jnp.float32)
    old, rollout = old.astype(dtype), rollout.astype(dtype)
    mask = jnp.asarray(response_mask).astype(dtype)
    valid = mask != 0

    diff = jnp.where(valid, old - rollout, 0)  # log(pi_old / mu); masked NaN/inf never leak
    log_ratio = jnp.clip(diff, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_ratio = jnp.exp(log_ratio)
    seq_log_ratio = jnp.clip(masked_sum(diff, mask, axis=-1), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    seq_ratio = jnp.exp(seq_log_ratio)
    ratios = {"token": token_ratio, "sequence": jnp.broadcast_to(seq_ratio[:, None], token_ratio.shape)}

    if is_level == "none":
        is_weights, truncated = mask, jnp.zeros_like(valid)
    else:
        ratio = ratios[is_level]
        is_weights = jnp.where(valid, jnp.minimum(ratio, is_threshold), 0).astype(dtype)
        truncated = ratio > is_threshold
    if rs_level == "none":
        loss_mask, rejected = mask, jnp.zeros_like(valid)
    else:
        ratio = ratios[rs_level]
        rejected = (ratio < lower) | (ratio > rs_threshold)
        loss_mask = jnp.where(rejected, 0, mask).astype(dtype)

    abs_diff = jnp.abs(diff)
    has_token = jnp.any(valid, axis=-1)
    metrics = {
        "rollout_corr/log_prob_abs_diff": masked_mean(abs_diff, mask),
        "rollout_corr/log_prob_abs_diff_max": _extreme(abs_diff, valid, jnp.max, -jnp.inf),
        "rollout_corr/kl": masked_mean(-diff, mask),
        "rollout_corr/k3_kl": masked_mean(jnp.expm1(log_ratio) - log_ratio, mask),
        "rollout_corr/ratio_mean": masked_mean(token_ratio, mask),
        "rollout_corr/ratio_max": _extreme(token_ratio, valid, jnp.max, -jnp.inf),
        "rollout_corr/ratio_min": _extreme(token_ratio, valid, jnp.min, jnp.inf),
        "rollout_corr/seq_ratio_mean": masked_mean(seq_ratio, has_token),
        "rollout_corr/is_truncated_frac": masked_mean(truncated.astype(dtype), mask),
        "rollout_corr/rs_masked_frac": masked_mean(rejected.astype(dtype), mask),
    }
    return jax.lax.stop_gradient(is_weights), jax.lax.stop_gradient(loss_mask), metrics
