"""`token_logprobs`: LM-head log probs (and entropies) of given tokens without the [rows, length, vocab] logits.

The logits / temperature of a chunk of `chunk` positions at a time are computed, reduced to the per-token log prob
(z[label] - logsumexp(z)) and entropy (logsumexp(z) - sum softmax(z) z), and dropped, in a `jax.lax.scan` over the
length. The backward is a `jax.custom_vjp` that is chunked the same way, rather than autodiff of a `jax.checkpoint`ed
chunk body, because:
- its residuals are [rows, length] statistics (logsumexp, and the entropy), and each backward chunk recomputes the
  logits once and turns them into d(logits) in one elementwise pass (autodiff of the recomputed logsumexp/softmax
  keeps several float32 [rows, chunk, vocab] intermediates alive: on XLA:CPU, at 8 x 1024 tokens, embed 896 and a
  151,936 vocabulary in bf16, the loss-and-gradient's temporaries are 1.7 / 2.9 / 5.2 GiB at chunks 128 / 256 / 512
  here against 3.8 / 6.9 / 10.7 GiB with `jax.checkpoint`);
- the kernel gradient accumulates over chunks in float32 (autodiff would sum the chunks' kernel cotangents in the
  kernel's compute dtype, bfloat16 at real shapes);
- the collectives stay out of the loops: the kernel is cast to the compute dtype and gathered whole along `embed`
  once, before the forward's loop, and kept for the backward's; each device accumulates the kernel gradient of its
  own rows in a [row parts, vocab, embed] float32 carry split over the `batch` mesh axes, summed once after the loop
  to the kernel's sharding (a reduce-scatter over `fsdp`; libtpu 0.0.42 makes one of a float32 array over ~800 MiB
  an all-reduce and slice). Left to the partitioner, every chunk of both loops gathered the head and every backward
  chunk all-reduced a float32 [vocab, embed] gradient: at Qwen2.5-1.5B's update (fsdp 8, 8 chunks) 14 GiB of
  collectives per micro-batch, 1.3 GiB now (tests/test_lm_head_collectives.py).
Every matmul runs in the compute dtype (that of `hidden`) with float32 accumulation; the float32 cotangent of the
logits is cast to the compute dtype before the two backward matmuls (exact in float32 compute). The entropy is
computed from max-centred logits, log s - sum(e u) / s with u = z - max z, e = exp(u), s = sum e: no large max
cancels (more accurate than `entropy_from_logits` on peaked distributions). An entropy read only as a metric (under
`jax.lax.stop_gradient`) costs the forward's reduction alone: its cotangent is a symbolic zero and the backward
skips its term.

Memory, bytes per device, with T = rows * chunk tokens per chunk (the rows local to the device), V the padded vocab,
E the embed size, c the compute dtype's and k the kernel's item size:
  forward:  4 T V (a chunk's float32 logits; the reductions read them)
  backward: (4 + c) T V (the recomputed float32 logits and d(logits) in the compute dtype)
            + 4 V E (the float32 kernel-gradient accumulator) + k V E (the gradient returned in the kernel dtype)
  plus c V E for the gathered kernel in the compute dtype (from the forward until the backward ends), and
  O(rows * length * E).
XLA:CPU adds its own copies (the logits stored again scaled and masked, d(logits) and the kernel transposed): it
measures about 8 T V + 4 V E (see tests/test_lm_head.py).
Under a program layout (`hfjax.models.program`) the chunk's logits are constrained to rows over the batch axes and
the vocabulary over `tensor`, so the memory above is divided by the tensor size, and `chunk_length` picks the chunk
from a budget of tokens per device.

Where a device's whole float32 logits fit `logits_budget_bytes` (a small vocabulary, few tokens), they are made once
in one chunk and kept from the forward to the backward, which then does not recompute them (one LM-head matmul
less): 4 T V bytes held between the two passes instead of the recomputation.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from hfjax.models.config import MASKED_SCORE
from hfjax.models.program import constrain, constrain_weight, length_parts, split_parts
from hfjax.parallel.layout import TOKENS

LOGITS_CHUNK_TOKENS = 512  # tokens per device in one chunk of logits: 512 x 151,936 float32 is 297 MiB
# a device's whole float32 logits up to this many bytes are made once and kept for the backward (no chunks, no
# recomputed LM-head matmul): the bytes of one chunk at a Qwen2.5 vocabulary
LOGITS_BUDGET_BYTES = 4 * LOGITS_CHUNK_TOKENS * 151_936


def softcap_logits(logits: jax.Array, softcap: float | None) -> jax.Array:
    """cap * tanh(logits / cap) (Gemma 2's final_logit_softcapping), or `logits` unchanged without a cap."""
    return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


def _chunk_logits(hidden: jax.Array, kernel: jax.Array, head: _Head) -> jax.Array:
    """float32 soft-capped logits / temperature [rows, chunk, padded vocab] of one chunk, the padding columns at
    `MASKED_SCORE` (as `mask_vocab_padding`). The one place the per-chunk logits are made: their sharding constraint
    (logical axes: the head's rows, none, vocab) goes here."""
    logits = jnp.einsum("rce,ve->rcv", hidden, kernel, preferred_element_type=jnp.float32)
    logits = constrain(softcap_logits(logits, head.softcap) / head.temperature, (head.rows_axis, None, "vocab"))
    if logits.shape[-1] == head.vocab_size:
        return logits
    return jnp.where(jnp.arange(logits.shape[-1]) < head.vocab_size, logits, MASKED_SCORE)


def chunk_length(tokens_per_device: int, rows: int) -> int:
    """Positions per chunk so that a chunk holds about `tokens_per_device` tokens on each device: the rows are split
    over the traced program's `batch` mesh axes (`hfjax.models.program`), so each device holds rows / parts of them."""
    return max(8, tokens_per_device * split_parts("batch", rows) // max(rows, 1))


def _to_chunks(x: jax.Array, chunk: int) -> jax.Array:
    """[rows, length, ...] -> [length / chunk, rows, chunk, ...], the length zero-padded to a multiple of `chunk`."""
    rows, length = x.shape[:2]
    pad = -length % chunk
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return jnp.swapaxes(x.reshape(rows, (length + pad) // chunk, chunk, *x.shape[2:]), 0, 1)


def _from_chunks(x: jax.Array, length: int) -> jax.Array:
    """[length / chunk, rows, chunk] -> [rows, length] (the padding dropped)."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[1], -1)[:, :length]


def _split_rows(x: jax.Array, parts: int) -> jax.Array:
    """[rows, ...] -> [parts, rows / parts, ...]: a part per device group of the rows' `batch` sharding."""
    return x.reshape(parts, x.shape[0] // parts, *x.shape[1:])


def _add_pairs(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    return a[0] + b[0], a[1] + b[1]


@dataclasses.dataclass(frozen=True)
class _Head:
    """The static settings of one `token_logprobs` call (hashable: the custom VJP's one non-differentiable input)."""

    vocab_size: int
    temperature: float
    softcap: float | None
    chunk: int
    entropy: bool
    rows_axis: str  # the logical axis of the rows: `tokens` where the positions are folded into them
    parts: int  # how many device groups that axis splits the rows into (read in the forward, under the layout)
    keep_logits: bool = False  # the forward's logits kept for the backward (one chunk that fits the budget)


def _forward(
    hidden: jax.Array, kernel: jax.Array, labels: jax.Array, head: _Head, keep: bool = False
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...], jax.Array | None]:
    """((logp[, entropy]), (logsumexp[, entropy]), logits), the first two [rows, length] float32, of the kernel in
    the compute dtype (`_gathered`); `keep`: also the chunks' logits [chunks, rows, chunk, vocab], else None."""

    def body(_: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, tuple[jax.Array, ...]]:
        h, y = xs
        z = _chunk_logits(h, kernel, head)
        top = jnp.max(z, axis=-1, keepdims=True)
        shifted = z - top  # centred: the entropy's difference cancels no large max
        exps = jnp.exp(shifted)
        if head.entropy:  # one two-output reduction, so exps is never stored
            total, weighted = jax.lax.reduce(
                (exps, exps * shifted), (np.float32(0), np.float32(0)), _add_pairs, (exps.ndim - 1,)
            )
        else:
            total = jnp.sum(exps, axis=-1)
        lse = top[..., 0] + jnp.log(total)
        # the label's logit picked from the chunk's logits: over a tensor-sharded vocabulary the partitioner picks
        # it where it lives and sums [rows, chunk] over `tensor`, collecting no logits (tests/test_scaling.py)
        logp = jnp.take_along_axis(z, y[..., None], axis=-1)[..., 0] - lse
        stats = (logp, lse, jnp.log(total) - weighted / total) if head.entropy else (logp, lse)
        return None, (stats, z if keep else None)

    _, (out, logits) = jax.lax.scan(body, None, (_to_chunks(hidden, head.chunk), _to_chunks(labels, head.chunk)))
    out = [_from_chunks(o, hidden.shape[1]) for o in out]
    return ((out[0], out[2]) if head.entropy else (out[0],)), tuple(out[1:]), logits


def _gathered(kernel: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The kernel in the compute dtype, whole along `embed` (its vocabulary over `tensor`, as the logits'): gathered
    once, outside the loops, in the compute dtype."""
    return constrain(kernel.astype(dtype), ("vocab", "embed"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _token_stats(hidden: jax.Array, kernel: jax.Array, labels: jax.Array, head: _Head) -> tuple[jax.Array, ...]:
    return _forward(hidden, _gathered(kernel, hidden.dtype), labels, head)[0]


def _token_stats_fwd(
    hidden: CustomVJPPrimal, kernel: CustomVJPPrimal, labels: CustomVJPPrimal, head: _Head
) -> tuple[tuple[jax.Array, ...], tuple]:
    hidden, kernel, labels = hidden.value, kernel.value, labels.value
    compute = _gathered(kernel, hidden.dtype)
    out, stats, logits = _forward(hidden, compute, labels, head, keep=head.keep_logits)
    return out, (hidden, kernel, compute, labels, stats, logits)


def _token_stats_bwd(head: _Head, residuals: tuple, grads: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array, None]:
    hidden, kernel, compute, labels, stats, logits = residuals
    # an entropy that is a metric only (stop_gradient) has a symbolic zero cotangent: its term is never computed
    entropy_flows = head.entropy and not isinstance(grads[1], SymbolicZero)
    columns = jnp.arange(kernel.shape[0])
    parts = head.parts
    per_part = (head.rows_axis, "vocab", "embed")  # a [parts, vocab, embed] gradient part on each device group's rows

    def body(grad_kernel: jax.Array, xs: tuple) -> tuple[jax.Array, jax.Array]:
        (h, y, lse, g_logp, *rest), kept = xs
        z = _chunk_logits(h, compute, head) if kept is None else kept
        log_p = z - lse[..., None]
        p = jnp.exp(log_p)
        # d logp / dz = onehot(label) - p;  d entropy / dz = p (sum softmax(z) z - z) = -p (log p + entropy)
        dz = g_logp[..., None] * ((columns == y[..., None]) - p)
        if entropy_flows:
            entropy, g_ent = rest
            dz = dz - g_ent[..., None] * p * (log_p + entropy[..., None])
        # d z / d (hidden @ kernel.T): 1 / T, times 1 - tanh^2 = 1 - (z T / cap)^2 under a soft cap
        scale = 1.0 / head.temperature
        if head.softcap is not None:
            scale = scale * (1.0 - jnp.square(z * (head.temperature / head.softcap)))
        dz = jnp.where(columns < head.vocab_size, dz * scale, 0.0).astype(compute.dtype)
        grad_h = jnp.einsum("rcv,ve->rce", dz, compute, preferred_element_type=jnp.float32).astype(hidden.dtype)
        own = jnp.einsum(
            "prcv,prce->pve", _split_rows(dz, parts), _split_rows(h, parts), preferred_element_type=jnp.float32
        )
        return constrain(grad_kernel + own, per_part), grad_h

    g_logp = jnp.zeros_like(stats[0]) if isinstance(grads[0], SymbolicZero) else grads[0]
    per_token = [stats[0], g_logp] + ([stats[1], grads[1]] if entropy_flows else [])
    chunks = (_to_chunks(x, head.chunk) for x in (hidden, labels, *per_token))
    zeros = constrain(jnp.zeros((parts, *kernel.shape), jnp.float32), per_part)
    grad_kernel, grad_h = jax.lax.scan(body, zeros, (tuple(chunks), logits))
    grad_kernel = constrain_weight(jnp.sum(grad_kernel, axis=0), ("vocab", "embed"))
    grad_h = jnp.swapaxes(grad_h, 0, 1).reshape(hidden.shape[0], -1, hidden.shape[2])[:, : hidden.shape[1]]
    return grad_h, grad_kernel.astype(kernel.dtype), None


_token_stats.defvjp(_token_stats_fwd, _token_stats_bwd, symbolic_zeros=True)


def token_logprobs(
    hidden: jax.Array,
    kernel: jax.Array,
    labels: jax.Array,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    softcap: float | None = None,
    chunk: int = 256,
    with_entropy: bool = False,
    logits_budget_bytes: int | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """(log softmax(z)[label], entropy of softmax(z) or None) [rows, length] float32, z = softcap_logits(hidden @
    kernel.T, softcap) / temperature over the first `vocab_size` columns, for `hidden` [rows, length, embed] in the
    compute dtype, the LM head `kernel` [padded vocab, embed] in its stored dtype and integer `labels` [rows, length],
    `chunk` positions at a time (see the module docstring for the memory), or, where a device's whole float32 logits
    take at most `logits_budget_bytes`, all at once and kept for the backward. Differentiable in `hidden` and
    `kernel` through both."""
    if chunk < 1:
        raise ValueError(f"chunk: expected a positive number of positions, got {chunk}")
    rows, length = labels.shape
    parts = length_parts(length)
    if parts > 1:  # positions split over `sequence`: each device's part of a row becomes a row of its own
        hidden = constrain(hidden.reshape(rows * parts, length // parts, hidden.shape[2]), (TOKENS, None, None))
        labels = constrain(labels.reshape(rows * parts, length // parts), (TOKENS, None))
    rows_axis = "batch" if parts == 1 else TOKENS
    row_parts = split_parts(rows_axis, len(hidden))
    local_logits = 4 * len(hidden) // row_parts * hidden.shape[1] * kernel.shape[0] // split_parts("vocab", len(kernel))
    keep = logits_budget_bytes is not None and local_logits <= logits_budget_bytes
    chunk = hidden.shape[1] if keep else max(1, min(chunk, hidden.shape[1]))
    head = _Head(vocab_size, temperature, softcap, chunk, with_entropy, rows_axis, row_parts, keep)
    out = _token_stats(hidden, kernel, labels.astype(jnp.int32), head)
    out = [constrain(o.reshape(rows, length), ("batch", "length")) for o in out]
    return out[0], out[1] if with_entropy else None
