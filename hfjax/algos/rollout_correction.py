"""Off-policy (rollout) correction, verl's decoupled mode: importance weights between the proximal policy pi_old
(`old_log_probs`, recomputed by the trainer) and the rollout policy mu (`rollout_log_probs`, from generation), and
rejection of tokens or sequences (`hfjax.algos.rollout_rejection`), plus mismatch metrics.

Importance weights (`rollout_is`): per token exp(clamp(log pi_old - log mu, +-20)); per sequence exp(clamp(sum over
valid tokens of the unclamped log ratios, +-20)), repeated over the sequence. `rollout_is_threshold` a number u: TIS,
min(weight, u); "lower_upper": IcePop, weights outside [lower, upper] become 0. `rollout_is_batch_normalize` divides
them by their mean over the batch's valid tokens (per sequence: over its sequences).

Pure `jax.numpy` (options parsed in Python: static under `jit`); the weights and mask are constants of the loss (no
gradient flows through them).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from hfjax.algos.masked import MEAN_EPS, masked_mean, masked_sum
from hfjax.algos.rollout_rejection import LOG_RATIO_CLAMP, parse_bounds, parse_rejection, rejection_mask

IS_LEVELS = ("token", "sequence")
BATCH_NORM_MIN_MEAN = 1e-8  # weights whose batch mean is at most this are left unnormalised (verl's guard)


@dataclasses.dataclass(frozen=True)
class ImportanceBounds:
    """`rollout_is_threshold` parsed: `upper` caps the weights (TIS), or with `lower` bounds them (IcePop)."""

    upper: float
    lower: float | None = None

    @property
    def icepop(self) -> bool:
        return self.lower is not None


def parse_is_threshold(threshold: str | float) -> ImportanceBounds:
    """A number (or numeric string) u: TIS at u; "lower_upper" (e.g. "0.5_5.0"): IcePop. Raises ValueError."""
    lower, upper = parse_bounds(threshold, "rollout_is_threshold")
    return ImportanceBounds(upper, lower)


def _log_ratio(
    old_log_probs: jax.Array, rollout_log_probs: jax.Array, response_mask: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(log pi_old - log mu, 0 where masked; the mask as floats; valid), in at least float32, without gradient."""
    old = jax.lax.stop_gradient(jnp.asarray(old_log_probs))
    rollout = jax.lax.stop_gradient(jnp.asarray(rollout_log_probs))
    dtype = jnp.promote_types(jnp.result_type(old, rollout), jnp.float32)
    mask = jnp.asarray(response_mask).astype(dtype)
    valid = mask != 0
    return jnp.where(valid, old.astype(dtype) - rollout.astype(dtype), 0), mask, valid  # masked NaN/inf never leak


def mismatch_metrics(
    old_log_probs: jax.Array,
    rollout_log_probs: jax.Array,
    response_mask: jax.Array,
    *,
    token_count: jax.Array | float | None = None,
) -> dict[str, jax.Array]:
    """How far pi_old is from mu, per valid token (`rollout_corr/...`): `log_prob_abs_diff` (mean of |log pi_old -
    log mu|) and its `_max`, `kl` (mean of log mu - log pi_old, verl's), `k3_kl` (mean of e^d - 1 - d, d = log pi_old
    - log mu unclamped, verl's), and `ratio_mean`, `ratio_max`, `ratio_min` of the ratios clamped as the weights are.

    With `token_count`, the valid tokens of a whole batch that this one is a part of (a micro-batch of a mini-batch),
    the means are this part's shares (they sum over the parts to the whole batch's means) and a part without valid
    tokens gives -inf / +inf extremes (they vanish in the max / min over the parts); without it, a batch without
    valid tokens gives 0 for every metric."""
    return _mismatch(*_log_ratio(old_log_probs, rollout_log_probs, response_mask), token_count)


def _mismatch(diff: jax.Array, mask: jax.Array, valid: jax.Array, token_count: Any) -> dict[str, jax.Array]:
    part = token_count is not None
    tokens = token_count if part else jnp.sum(mask)

    def mean(values: jax.Array) -> jax.Array:
        return masked_sum(values, mask) / (tokens + MEAN_EPS)

    def extreme(values: jax.Array, reduce: Callable[[jax.Array], jax.Array], identity: float) -> jax.Array:
        picked = reduce(jnp.where(valid, values, identity))
        return jnp.where(jnp.any(valid), picked, identity if part else 0).astype(values.dtype)

    ratio = jnp.exp(jnp.clip(diff, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    abs_diff = jnp.abs(diff)
    metrics = {
        "log_prob_abs_diff": mean(abs_diff),
        "log_prob_abs_diff_max": extreme(abs_diff, jnp.max, -jnp.inf),
        "kl": mean(-diff),
        "k3_kl": mean(jnp.expm1(diff) - diff),
        "ratio_mean": mean(ratio),
        "ratio_max": extreme(ratio, jnp.max, -jnp.inf),
        "ratio_min": extreme(ratio, jnp.min, jnp.inf),
    }
    return {f"rollout_corr/{name}": value for name, value in metrics.items()}


def importance_weights(
    log_ratio: jax.Array, mask: jax.Array, level: str, bounds: ImportanceBounds, batch_normalize: bool
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(weights [bs, T], 0 on invalid tokens; metrics without the `rollout_corr/` prefix) for `log_ratio` = log
    pi_old - log mu, finite on the valid tokens of the float `mask`. Metrics (verl's names): `rollout_is_mean` (token
    mean of the weights before any batch normalisation), `rollout_is_ratio_fraction_high` / `_low` (tokens, or for
    `level` sequence sequences with a valid token, whose ratio is above the upper bound / below the lower one, 1 / upper
    for TIS), `rollout_is_oob_ratio` (IcePop: valid tokens zeroed) and `rollout_is_batch_norm_factor` (the mean
    divided by)."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is: expected one of {list(IS_LEVELS)} or None, got {level!r}")
    valid = mask != 0
    has_token = jnp.any(valid, axis=-1)
    lower = bounds.lower if bounds.icepop else 1.0 / bounds.upper
    if level == "token":
        raw = jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)) * mask
        high = masked_mean(raw > bounds.upper, mask)
        low = masked_mean(raw < lower, mask)
    else:
        seq_log_ratio = masked_sum(log_ratio, mask, axis=-1)
        raw = jnp.exp(jnp.clip(seq_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))[:, None] * mask
        high = masked_mean(seq_log_ratio > math.log(bounds.upper), has_token)
        low = masked_mean(seq_log_ratio < math.log(lower), has_token)
    metrics = {"rollout_is_ratio_fraction_high": high, "rollout_is_ratio_fraction_low": low}
    if bounds.icepop:
        inside = (raw >= bounds.lower) & (raw <= bounds.upper)
        weights = jnp.where(inside, raw, 0)
        metrics["rollout_is_oob_ratio"] = masked_mean(~inside, mask)
    else:
        weights = jnp.minimum(raw, bounds.upper)
    metrics["rollout_is_mean"] = masked_mean(weights, mask)
    if batch_normalize:
        if level == "token":
            mean = metrics["rollout_is_mean"]
        else:
            mean = masked_mean(masked_mean(weights, mask, axis=-1), has_token)
        usable = mean > BATCH_NORM_MIN_MEAN
        weights = jnp.where(usable, weights / jnp.where(usable, mean, 1), weights)
        metrics["rollout_is_batch_norm_factor"] = jnp.where(usable, mean, 1)
    return weights, metrics


def rollout_correction(
    old_log_probs: jax.Array,
    rollout_log_probs: jax.Array,
    response_mask: jax.Array,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: str | float = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
) -> tuple[jax.Array | None, jax.Array, dict[str, jax.Array]]:
    """(is_weights, response_mask, metrics) of verl's `compute_rollout_correction_and_rejection_mask` for (bs, T)
    log probs of pi_old and mu and a 0/1 `response_mask`, with verl's option names and values.

    `is_weights` (None without `rollout_is`) are in at least float32, 0 on invalid tokens (computed on the whole
    `response_mask`, before rejection, as verl does); `response_mask` comes back in its own dtype with the rejected
    tokens zeroed (unchanged without `rollout_rs`). Metrics, named `rollout_corr/...`: `mismatch_metrics`, and those
    of `importance_weights` and `rejection_mask` when they run; means over no valid token are 0, not NaN."""
    diff, mask, valid = _log_ratio(old_log_probs, rollout_log_probs, response_mask)
    metrics = {}
    weights = None
    if rollout_is is not None:
        bounds = parse_is_threshold(rollout_is_threshold)
        weights, is_metrics = importance_weights(diff, mask, rollout_is, bounds, rollout_is_batch_normalize)
        metrics.update(is_metrics)
    kept = jnp.asarray(response_mask)
    if rollout_rs is not None:
        keep, rs_metrics = rejection_mask(diff, mask, parse_rejection(rollout_rs, rollout_rs_threshold))
        kept = jnp.where(keep, kept, jnp.zeros_like(kept))
        metrics.update(rs_metrics)
    metrics = {f"rollout_corr/{name}": value for name, value in metrics.items()}
    metrics.update(_mismatch(diff, mask, valid, None))
    return weights, kept, metrics
