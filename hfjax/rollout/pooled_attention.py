"""Decode attention that reads the shared prompt pool in place (the XLA path of a decode step).

A slot's prompt keys and values live in pool blocks that the samples of one prompt share. Gathering every slot's
prompt blocks out of the pool before attending copies them for each layer and step: on CPU the copies cost more
than the attention itself (24 gathers of 2 MiB each took about 26 ms of a 64-slot decode step of the 25.8M
reference model, against about 37 ms for the whole step without them). Here the products run block by block
instead: each pool block meets the queries of the slots that read it (`PoolReaders`, at most R per block), so the
pool is read once where it lies and only per-slot scores, probabilities and outputs ([slots, kv heads, group,
block] or [.., head_dim]) are gathered, in one softmax with the slot's own blocks. Cost: 4 x pool blocks x R x
heads x block x head_dim FLOPs per layer (the gathered path's with R = 1 and a full pool), and one read of the pool.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hfjax.models.attention import MASKED_SCORE, scale_scores


class PoolReaders(NamedTuple):
    """Who reads each pool block: `readers` [parts, pool blocks, R] the reading slots' indices within their part
    (slots per part: none), `columns` [parts, pool blocks] the block's column in its readers' prompt tables, and each
    slot's rank [slots] among its prompt copy's readers (its entry in `readers`)."""

    readers: jax.Array
    columns: jax.Array
    ranks: jax.Array


def pooled_decode_attention(
    q: jax.Array,
    pool_keys: jax.Array,
    pool_values: jax.Array,
    table: jax.Array,
    pool_readers: PoolReaders,
    own_keys: Sequence[jax.Array],
    own_values: Sequence[jax.Array],
    allowed: jax.Array,
    softcap: float | None = None,
) -> jax.Array:
    """Grouped-query attention of one query per slot over its prompt blocks in the pool and its own blocks, scores
    in float32: q [S, 1, heads, d]; pool keys [parts, pool blocks, kv_heads, d, B] and values [parts, pool blocks,
    kv_heads, B, d]; `table` [S, n] each slot's prompt blocks (ids in its part's pool); own key blocks [S, kv_heads, d,
    B] and value blocks [S, kv_heads, B, d]; `allowed` [S, n x B + own blocks x B] (`decode_mask`) -> [S, 1, heads,
    d]. Slots are in the order of the pool's parts (S / parts each)."""
    slots, _, heads, d = q.shape
    parts, _, kv_heads, _, block = pool_keys.shape
    group, columns = heads // kv_heads, table.shape[1]
    q = q.reshape(slots, kv_heads, group, d)
    split = functools.partial(_by_part, parts)
    q_parts, table_parts, rank_parts = split(q), split(table), split(pool_readers.ranks)

    def prompt_scores(q_part: jax.Array, keys: jax.Array, readers: jax.Array, table_part, rank_part) -> jax.Array:
        readers_q = _with_none(q_part)[readers].swapaxes(1, 2)  # [pool blocks, kv, R, group, d]
        scores = jnp.einsum("bkrgd,bkdt->bkrgt", readers_q, keys, preferred_element_type=jnp.float32)
        return scores[table_part, :, rank_part[:, None]]  # [local, n, kv, group, B]

    scores = jax.vmap(prompt_scores)(q_parts, pool_keys, pool_readers.readers, table_parts, rank_parts)
    scores = scores.reshape(slots, columns, kv_heads, group, block).transpose(0, 2, 3, 1, 4)
    own = [jnp.einsum("skgd,skdt->skgt", q, k, preferred_element_type=jnp.float32) for k in own_keys]
    scores = jnp.concatenate([scores.reshape(slots, kv_heads, group, columns * block), *own], axis=-1)
    scores = jnp.where(allowed[:, None, None, :], scale_scores(scores, d, softcap), MASKED_SCORE)
    probs = jax.nn.softmax(scores, axis=-1).astype(own_values[0].dtype)
    prompt_probs = probs[..., : columns * block].reshape(slots, kv_heads, group, columns, block)
    prompt_probs = prompt_probs.transpose(0, 3, 1, 2, 4)  # [S, n, kv, group, B]
    # a column past the slot's prompt names block 0, which other slots read: its output is not the slot's
    used = allowed[:, : columns * block].reshape(slots, columns, block).any(-1)

    def prompt_outputs(probs_part, values, readers, block_columns, table_part, rank_part, used_part) -> jax.Array:
        readers_probs = _with_none(probs_part)[readers, block_columns[:, None]].swapaxes(1, 2)  # [blocks, kv, R, ..]
        out = jnp.einsum("bkrgt,bktd->bkrgd", readers_probs, values)
        out = out[table_part, :, rank_part[:, None]]  # [local, n, kv, group, d]
        return jnp.sum(jnp.where(used_part[:, :, None, None, None], out, jnp.zeros((), out.dtype)), axis=1)

    prompt_out = jax.vmap(prompt_outputs)(
        split(prompt_probs),
        pool_values,
        pool_readers.readers,
        pool_readers.columns,
        table_parts,
        rank_parts,
        split(used),
    )
    own_probs = probs[..., columns * block :]
    parts_out = [
        jnp.einsum("skgt,sktd->skgd", own_probs[..., i * block : (i + 1) * block], v) for i, v in enumerate(own_values)
    ]
    out = functools.reduce(jnp.add, parts_out, prompt_out.reshape(slots, kv_heads, group, d))
    return out.reshape(slots, 1, heads, d)


def _by_part(parts: int, x: jax.Array) -> jax.Array:
    """[S, ...] -> [parts, S / parts, ...]."""
    return x.reshape(parts, x.shape[0] // parts, *x.shape[1:])


def _with_none(x: jax.Array) -> jax.Array:
    """`x` [local slots, ...] with a zero row after the last: the row that index `local slots` (no reader) reads."""
    return jnp.concatenate([x, jnp.zeros_like(x[:1])])
