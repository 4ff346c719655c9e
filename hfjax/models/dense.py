"""`dense(x, kernel)`: the model's one matrix product, y[..., o] = sum_i x[..., i] kernel[o, i] (kernels stored
[out, in], as Hugging Face stores them), with a hand-written backward.

The kernel gradient is grad^T x summed over every leading dimension: rows and positions merged into one, except
where the program's layout splits the positions (the `sequence` axis), where they stay apart (a merge of a whole row
axis with a split position axis is gathered). Left to itself, XLA:CPU runs it as an Eigen dot on a transposed
operand and fuses the elementwise work that produced the output gradient (the SwiGLU and rotary backward) into that
transposing copy: a strided loop at a fraction of a GB/s (`optimization_barrier` does not stop it: XLA expands the
barrier into control dependencies before fusing). Here the transpose of the output gradient runs inside a
conditional, which no fusion crosses, so it is a plain copy, and the product takes the fast matmul path. Both branches
are the same transpose; the predicate only has to be unknown when compiling. Only on CPU (the program's platform,
`hfjax.models.program.program_platform`, read where `dense` is called, not the tracing machine's): a GPU
conditional reads its predicate on the host, and GPU/TPU compilers handle the plain product well. The backward
casts the output gradient to the compute dtype (float32 logits' gradient to bf16 under a bf16 model) and accumulates
in float32, so no matmul runs on a float32 copy of a bf16 weight (docs/benchmarks.md, "Other measured figures", has
the time it saves). Values are those of autodiff's backward up to summation order.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hfjax.models.program import length_parts, program_platform


def dense(x: jax.Array, kernel: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """x [..., in] times kernel [out, in] transposed -> [..., out], accumulated and returned in `out_dtype` when
    given (e.g. float32 logits from bfloat16 activations), else in the inputs' type."""
    backward = _Backward(x.ndim >= 3 and length_parts(x.shape[1]) > 1, program_platform() == "cpu")
    return _dense(x, kernel, out_dtype, backward)


class _Backward(NamedTuple):
    """How the backward runs, chosen where `dense` is called (traced under the program's layout; the backward may be
    traced outside it, where the tracing machine's backend would answer)."""

    split_positions: bool  # rows and positions kept apart (the layout splits the positions)
    opaque_transpose: bool  # the output gradient transposed inside a conditional (XLA:CPU)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dense(x: jax.Array, kernel: jax.Array, out_dtype: jnp.dtype | None, backward: _Backward) -> jax.Array:
    return jnp.einsum("...i,oi->...o", x, kernel, preferred_element_type=out_dtype)


def _dense_forward(
    x: jax.Array, kernel: jax.Array, out_dtype: jnp.dtype | None, backward: _Backward
) -> tuple[jax.Array, tuple]:
    return _dense(x, kernel, out_dtype, backward), (x, kernel)


def _dense_backward(
    out_dtype: jnp.dtype | None, backward: _Backward, residuals: tuple, grad: jax.Array
) -> tuple[jax.Array, jax.Array]:
    x, kernel = residuals
    grad = grad.astype(x.dtype)  # matmuls in the compute dtype (no float32 copy of a bf16 kernel), float32 sums
    grad_x = jnp.einsum("...o,oi->...i", grad, kernel, preferred_element_type=jnp.float32).astype(x.dtype)
    if not backward.split_positions:  # rows and positions merged: one [out, rows] x [rows, in] product
        grad, x = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    if backward.opaque_transpose:
        first = grad[(0,) * grad.ndim]
        grad_t = jax.lax.cond(first == first, _outputs_first, _outputs_first, grad)
    else:
        grad_t = _outputs_first(grad)
    rows = "abcdefgh"[: grad.ndim - 1]
    grad_kernel = jnp.einsum(f"o{rows},{rows}i->oi", grad_t, x, preferred_element_type=jnp.float32)
    return grad_x, grad_kernel.astype(kernel.dtype)


def _outputs_first(grad: jax.Array) -> jax.Array:
    """[..., out] -> [out, ...]: the rows' dimensions stay as they are."""
    return jnp.moveaxis(grad, -1, 0)


_dense.defvjp(_dense_forward, _dense_backward)
