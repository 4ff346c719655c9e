"""`dense(x, kernel)`: the model's one matrix product, y[..., o] = sum_i x[..., i] kernel[o, i] (kernels stored
[out, in], as Hugging Face stores them), with a hand-written backward.

Autodiff's backward recomputes the elementwise work that produced the output gradient (the SwiGLU and rotary
backward) inside each of its two consumers, and XLA:CPU fuses it into the transposed copy that the kernel gradient's
product needs: a strided loop that ran at about 0.2 GB/s, 1.9 s of a 9.5 s micro-batch of the reference model's
actor update. Here the output gradient is materialized once (`optimization_barrier`), then feeds the input gradient
and the kernel gradient; the transpose becomes a plain copy. Values are those of autodiff's backward.
Imports jax only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dense(x: jax.Array, kernel: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """x [..., in] times kernel [out, in] transposed -> [..., out], accumulated and returned in `out_dtype` when
    given (e.g. float32 logits from bfloat16 activations), else in the inputs' type."""
    return jnp.einsum("...i,oi->...o", x, kernel, preferred_element_type=out_dtype)


def _dense_forward(x: jax.Array, kernel: jax.Array, out_dtype: jnp.dtype | None) -> tuple[jax.Array, tuple]:
    return dense(x, kernel, out_dtype), (x, kernel)


def _dense_backward(out_dtype: jnp.dtype | None, residuals: tuple, grad: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, kernel = residuals
    grad = jax.lax.optimization_barrier(grad)
    grad_x = jnp.einsum("...o,oi->...i", grad, kernel, preferred_element_type=out_dtype).astype(x.dtype)
    rows = tuple(range(x.ndim - 1))
    grad_kernel_t = jax.lax.dot_general(x, grad, ((rows, rows), ((), ())), preferred_element_type=out_dtype)
    return grad_x, grad_kernel_t.T.astype(kernel.dtype)


dense.defvjp(_dense_forward, _dense_backward)
