"""What every layer builds on: parameters annotated with logical axes, their initialisers, and the gated MLPs'
activation functions."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from hfjax.parallel.layout import LOGICAL_AXES

Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]
ACTIVATION_FUNCTIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def logical_param(
    rngs: nnx.Rngs | None, init: Initializer, shape: tuple[int, ...], axes: tuple[str, ...], param_dtype: jnp.dtype
) -> nnx.Param:
    """A parameter annotated with its logical axes (one name per dimension). With `rngs=None` it holds only a
    `jax.ShapeDtypeStruct` (an abstract model, built without tracing any initialiser)."""
    assert len(shape) == len(axes) and all(a in LOGICAL_AXES for a in axes), (shape, axes)
    if rngs is None:
        return nnx.Param(jax.ShapeDtypeStruct(shape, jnp.dtype(param_dtype)), logical_axes=axes)
    return nnx.Param(init(rngs.params(), shape, param_dtype), logical_axes=axes)


def normal_init(std: float) -> Initializer:
    return jax.nn.initializers.normal(stddev=std)
