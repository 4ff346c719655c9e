"""Shared inputs and tolerances of the attention tests: random q/k/v and caches, left-padded validity, a float64
numpy reference, and the comparison every implementation is held to."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BF16 = jnp.bfloat16
# Float32: both sides compute float32 scores and softmax and differ only in summation order (eps 1.2e-7, sums of a
# few dozen O(1) terms: differences of a few 1e-7), so 1e-5. Bfloat16 has an 8-bit significand: a value x is stored
# to within 2^-8 |x|, one unit in its last place is at most 2^-7 |x|. The implementations round at different points
# (the reference rounds normalised probabilities and each block's product to bf16, splash rounds the pre-scaled
# query, the decode kernel accumulates in float32), and each output or gradient is a sum of terms as large as the
# array's largest values, so results may differ by up to two units of their own (rtol 2^-6) plus one unit of the
# array's largest value (atol 2^-7 max|x|), which is what near-zero sums of large terms carry.
F32 = dict(atol=1e-5, rtol=1e-5)


def tolerance(dtype, want: np.ndarray) -> dict:
    return F32 if dtype == jnp.float32 else dict(atol=2**-7 * float(np.abs(want).max()), rtol=2**-6)


# (heads, kv_heads, dtype, window): each GQA ratio 1, 2, 4 in both dtypes, with and without a sliding window.
CASES = [
    (4, 4, jnp.float32, None),
    (4, 2, jnp.float32, 5),
    (4, 1, jnp.float32, 3),
    (4, 4, BF16, 5),
    (4, 2, BF16, None),
    (4, 1, BF16, 3),
]
CASE_IDS = [f"h{h}kv{kv}-{jnp.dtype(dt).name}-w{w}" for h, kv, dt, w in CASES]


def qkv_inputs(seed: int, b: int, t: int, heads: int, kv_heads: int, d: int, dtype) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    shapes = [(b, t, heads, d), (b, t, kv_heads, d), (b, t, kv_heads, d)]
    return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)


def left_padded(t: int, lengths: list[int]) -> jax.Array:
    return jnp.asarray(np.arange(t)[None, :] >= t - np.asarray(lengths)[:, None])


def numpy_attention(q, k, v, allowed: np.ndarray, softcap: float | None = None) -> np.ndarray:
    """Float64 attention, one (row, head, query) at a time over its allowed keys (scores soft-capped to
    cap * tanh(s / cap) when `softcap` is set); NaN where none is allowed."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, heads, d = q.shape
    group = heads // k.shape[2]
    out = np.full(q.shape, np.nan)
    for row, query, head in np.ndindex(b, t, heads):
        seen = allowed[row, query]
        if seen.any():
            scores = k[row, seen, head // group] @ q[row, query, head] / np.sqrt(d)
            if softcap is not None:
                scores = softcap * np.tanh(scores / softcap)
            probs = np.exp(scores - scores.max())
            out[row, query, head] = probs @ v[row, seen, head // group] / probs.sum()
    return out


def assert_close(got, want, real: np.ndarray, dtype) -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[real], want[real], **tolerance(dtype, want[real]))


def output_and_grads(fn, q, k, v, real: jax.Array):
    """The output and the gradients w.r.t. q, k, v of a random weighting of the output's real rows."""
    weights = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape), jnp.float32) * real[:, :, None, None]

    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * weights), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def cache_blocks(seed: int, slots: int, kv_heads: int, d: int, block: int, blocks: int, dtype):
    rng = np.random.default_rng(seed)
    keys = [jnp.asarray(rng.standard_normal((slots, kv_heads, d, block)), dtype) for _ in range(blocks)]
    values = [jnp.asarray(rng.standard_normal((slots, kv_heads, block, d)), dtype) for _ in range(blocks)]
    return keys, values
