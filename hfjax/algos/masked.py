"""Masked reductions over response tokens: sum, mean, mean of per-sequence means, unbiased variance and whitening,
with verl's conventions.

Pure `jax.numpy` functions: they run inside jitted training steps and on numpy arrays on the controller. A mask may be
bool, integer or float; positions where it is 0 never reach a result, even when they hold NaN or inf. A mean over
no valid element is 0 (verl's formula, `sum / (count + 1e-8)`, gives 0 too; verl's losses divide by the bare count
and give NaN there).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

MEAN_EPS = 1e-8  # added to the element count of a masked mean (verl's convention)
WHITEN_EPS = 1e-8  # added to the variance before the reciprocal square root when whitening


def _float_mask(values: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    values = jnp.asarray(values)
    if not jnp.issubdtype(values.dtype, jnp.floating):
        values = values.astype(jnp.float32)
    return values, jnp.asarray(mask).astype(values.dtype)


@partial(jax.jit, static_argnames="axis")
def masked_sum(values: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    """Sum of `values * mask` over `axis` (all axes when None); masked-out NaN/inf do not leak into the sum."""
    values, mask = _float_mask(values, mask)
    return jnp.sum(jnp.where(mask != 0, values, 0) * mask, axis=axis)


@partial(jax.jit, static_argnames="axis")
def masked_mean(values: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    """`masked_sum / (mask.sum() + 1e-8)`: an all-masked input gives 0, not NaN."""
    values, mask = _float_mask(values, mask)
    return masked_sum(values, mask, axis) / (jnp.sum(mask, axis=axis) + MEAN_EPS)


@jax.jit
def masked_seq_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean over rows (dimension 0) of each row's masked mean over its last axis; a row without valid elements
    counts as 0 (verl's average of the reward KL penalty, which its adaptive KL controller follows)."""
    return jnp.mean(masked_mean(values, mask, axis=-1))


def _check_variance_defined(mask: jax.Array, caller: str) -> None:
    """Raises ValueError when a concrete `mask` sums to at most 1 (no unbiased variance); a traced one passes."""
    if isinstance(mask, jax.core.Tracer):
        return
    count = float(np.sum(np.asarray(mask, np.float64)))
    if count <= 1:
        raise ValueError(
            f"{caller}: the unbiased variance needs at least 2 valid elements, but the mask sums to {count:g} "
            "(a batch with at most one valid response token)"
        )


@partial(jax.jit, static_argnames="unbiased")
def _masked_var(values: jax.Array, mask: jax.Array, unbiased: bool) -> jax.Array:
    values, mask = _float_mask(values, mask)
    mean = masked_mean(values, mask)
    variance = masked_mean(jnp.square(values - mean), mask)
    if not unbiased:
        return variance
    count = jnp.sum(mask)
    safe_dof = jnp.where(count > 1, count - 1, 1)
    return jnp.where(count > 1, variance * count / safe_dof, jnp.nan)


def masked_var(values: jax.Array, mask: jax.Array, unbiased: bool = True) -> jax.Array:
    """Variance of the valid elements (all axes), Bessel-corrected by `n / (n - 1)` when `unbiased`.

    The unbiased variance of fewer than two valid elements (mask sum <= 1) is undefined: with a concrete mask (the
    controller's advantage estimators) it raises ValueError, as verl does; inside `jit`, where a value cannot
    raise, the result is NaN.
    """
    if unbiased:
        _check_variance_defined(mask, "masked_var")
    return _masked_var(values, mask, unbiased)


@partial(jax.jit, static_argnames="shift_mean")
def _masked_whiten(values: jax.Array, mask: jax.Array, shift_mean: bool) -> jax.Array:
    values, mask = _float_mask(values, mask)
    mean = masked_mean(values, mask)
    whitened = (values - mean) * jax.lax.rsqrt(_masked_var(values, mask, True) + WHITEN_EPS)
    return whitened if shift_mean else whitened + mean


def masked_whiten(values: jax.Array, mask: jax.Array, shift_mean: bool = True) -> jax.Array:
    """`(values - mean) * rsqrt(var + 1e-8)` with the masked mean and unbiased masked variance of all valid elements.

    Every position is transformed (masked ones too, as in verl); with `shift_mean=False` the mean is added back.
    Fewer than two valid elements: ValueError for a concrete mask, NaN inside `jit` (see `masked_var`).
    """
    _check_variance_defined(mask, "masked_whiten")
    return _masked_whiten(values, mask, shift_mean)
