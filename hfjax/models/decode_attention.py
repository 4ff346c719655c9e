"""Decode attention: one query per slot over the blocked KV cache of `hfjax.rollout.cached_forward` (its own blocks
and its shared-prompt blocks), and the extend step's queries over it (`extend_blocks_attention`), each with the
implementations of `hfjax.models.attention` (xla, or the Pallas decode kernel of `hfjax.models.attention_pallas`
where `decode_kernel` says)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from hfjax.models.attention import PALLAS, configured_implementation, fall_back, resolve_implementation, scale_scores
from hfjax.models.config import MASKED_SCORE
from hfjax.models.per_shard import DECODE_AXES, per_shard
from hfjax.models.program import current_layout


def decode_key_positions(
    own_positions: int, prompt_lengths: jax.Array | None = None, prompt_positions: int = 0
) -> tuple[jax.Array, jax.Array]:
    """The absolute positions [slots, prompt_positions + own_positions] of the keys of decode blocks laid out as a
    slot's shared-prompt blocks (`prompt_positions` of them, key j at position j, real below `prompt_lengths` [slots])
    then its own blocks (key i at position prompt length + i), and which of them are real (a bool of that shape).
    Without `prompt_lengths` there are no prompt blocks: own key i is at position i."""
    own = jnp.arange(own_positions, dtype=jnp.int32)[None, :]
    if prompt_lengths is None:
        return own, jnp.ones_like(own, dtype=bool)
    prompt = jnp.arange(prompt_positions, dtype=jnp.int32)[None, :]
    lengths = prompt_lengths.astype(jnp.int32)[:, None]
    positions = jnp.concatenate([jnp.broadcast_to(prompt, (len(lengths), prompt_positions)), lengths + own], axis=1)
    real = jnp.concatenate([prompt < lengths, jnp.ones((len(lengths), own_positions), bool)], axis=1)
    return positions, real


def visible_keys(
    query_positions: jax.Array, key_positions: jax.Array, real: jax.Array, window: int | None
) -> jax.Array:
    """Boolean [rows, queries, keys]: which keys (absolute `key_positions` [rows or 1, keys], `real` likewise) each
    query at `query_positions` [rows, queries] sees: real keys at or before it, within `window` when set."""
    keys, queries = key_positions[:, None, :], query_positions[:, :, None]
    allowed = real[:, None, :] & (keys <= queries)
    if window is not None:
        allowed &= queries - keys < window
    return allowed


def decode_mask(
    lengths: jax.Array,
    positions: int,
    window: int | None,
    *,
    prompt_lengths: jax.Array | None = None,
    prompt_positions: int = 0,
) -> jax.Array:
    """Boolean [slots, prompt_positions + positions]: the keys a query at position `lengths` [slots] sees among its
    shared-prompt blocks and its own blocks (`decode_key_positions`)."""
    key_positions, real = decode_key_positions(positions, prompt_lengths, prompt_positions)
    return visible_keys(lengths[:, None], key_positions, real, window)[:, 0]


def attend_blocks(
    q: jax.Array,
    key_blocks: Sequence[jax.Array],
    value_blocks: Sequence[jax.Array],
    allowed: jax.Array,
    softcap: float | None = None,
) -> jax.Array:
    """The xla decode: grouped-query attention of one query per slot over its cache blocks, scores in float32:
    q [S, 1, heads, d], key blocks [S, kv_heads, d, B], value blocks [S, kv_heads, B, d], allowed [S, blocks x B]
    -> [S, 1, heads, d]."""
    slots, _, heads, d = q.shape
    kv_heads = key_blocks[0].shape[1]
    q = q.reshape(slots, kv_heads, heads // kv_heads, d)
    scores = [jnp.einsum("skgd,skdt->skgt", q, k, preferred_element_type=jnp.float32) for k in key_blocks]
    scores = scale_scores(jnp.concatenate(scores, axis=-1), d, softcap)
    scores = jnp.where(allowed[:, None, None, :], scores, MASKED_SCORE)
    probs = jax.nn.softmax(scores, axis=-1).astype(value_blocks[0].dtype)
    block = value_blocks[0].shape[2]
    parts = [
        jnp.einsum("skgt,sktd->skgd", probs[..., i * block : (i + 1) * block], v) for i, v in enumerate(value_blocks)
    ]
    return functools.reduce(jnp.add, parts).reshape(slots, 1, heads, d)


def extend_blocks_attention(
    q: jax.Array,
    key_blocks: Sequence[jax.Array],
    value_blocks: Sequence[jax.Array],
    starts: jax.Array,
    window: int | None = None,
    *,
    prompt_lengths: jax.Array | None = None,
    prompt_blocks: int = 0,
    softcap: float | None = None,
) -> jax.Array:
    """`extend_attention` over decode-layout cache blocks that already hold the new keys: queries q [R, T, heads, d]
    at positions `starts` [R] + 0..T-1; key blocks [R, kv_heads, d, B], value blocks [R, kv_heads, B, d]: the first
    `prompt_blocks` are the rows' shared-prompt blocks (real below `prompt_lengths` [R]), the others their own blocks
    (`decode_key_positions`; without prompt lengths block i holds positions i*B..); each query sees the positions up
    to its own (within `window`). Scores in float32."""
    rows, length, heads, d = q.shape
    kv_heads, block = key_blocks[0].shape[1], key_blocks[0].shape[-1]
    q = q.reshape(rows, length, kv_heads, heads // kv_heads, d)
    scores = [jnp.einsum("rtkgd,rkdb->rkgtb", q, k, preferred_element_type=jnp.float32) for k in key_blocks]
    scores = scale_scores(jnp.concatenate(scores, axis=-1), d, softcap)
    query_index = starts[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]
    own_positions = block * (len(key_blocks) - prompt_blocks)
    key_index, real = decode_key_positions(own_positions, prompt_lengths, block * prompt_blocks)
    allowed = visible_keys(query_index, key_index, real, window)
    scores = jnp.where(allowed[:, None, None], scores, MASKED_SCORE)
    probs = jax.nn.softmax(scores, axis=-1).astype(value_blocks[0].dtype)
    parts = [
        jnp.einsum("rkgtb,rkbd->rtkgd", probs[..., i * block : (i + 1) * block], v) for i, v in enumerate(value_blocks)
    ]
    return functools.reduce(jnp.add, parts).reshape(rows, length, heads, d)


# Heads narrower than this run the TPU decode step as xla when the kernel was not asked for by name: a chip keeps a
# value block [.., positions, head_dim] with head_dim under 128 lanes positions-minor, the kernel reads it row-major,
# so XLA relaid out every cache block, every layer, every step (Llama-3.2-1B, head_dim 64, v5e-8 with 384 slots: the
# step's temporaries 2.76 GiB with the kernel, 0.07 as xla, compiled lean)
KERNEL_MIN_HEAD_DIM = 128


def decode_kernel(
    softcap: float | None = None, head_dim: int = KERNEL_MIN_HEAD_DIM, implementation: str | None = None
) -> str | None:
    """The Pallas kernel that `decode_attention` runs for `implementation` (`resolve_implementation`), or None where
    it runs xla: with `softcap`, which the kernel lacks, and, unless the kernel is named (`implementation` or
    `HFJAX_ATTENTION`), for heads narrower than `KERNEL_MIN_HEAD_DIM`."""
    name = resolve_implementation(implementation)
    if name not in PALLAS:
        return None
    if softcap is not None:
        fall_back(name, "score soft-capping (Gemma 2's attn_logit_softcapping) is not in its decode kernel")
        return None
    chosen = implementation is None and configured_implementation() == "auto"
    if chosen and head_dim < KERNEL_MIN_HEAD_DIM:
        return None
    return name


def gather_prompt_blocks(pool: jax.Array, table: jax.Array, rows: jax.Array | None = None) -> list[jax.Array]:
    """The prompt blocks [S, ...] of every slot (`table` [S, n], slots in the order of the pool's parts) from a
    layer's `pool` [parts, pool blocks, ...]: n arrays, one per table column, each a block of the decode layout.
    Vmapped over the parts, so a part reads only its own pool (a parts-sharded pool is gathered shard by shard).
    With `rows` [R] (slot indices) only those slots' blocks, [R, ...] each: a copy of R slots, not of all S, indexed
    across the parts (over a parts-sharded pool the partitioner moves the rows' blocks between devices)."""
    parts, slots = pool.shape[0], table.shape[0]
    if rows is not None:
        part, ids = rows // (slots // parts), table[rows]
        return [pool[part, ids[:, j]] for j in range(table.shape[1])]
    local = table.reshape(parts, slots // parts, table.shape[1])
    take = jax.vmap(lambda part_pool, ids: part_pool[ids])
    return [take(pool, local[..., j]).reshape(slots, *pool.shape[2:]) for j in range(table.shape[1])]


def decode_attention(
    q: jax.Array,
    key_blocks: Sequence[jax.Array],
    value_blocks: Sequence[jax.Array],
    lengths: jax.Array,
    window: int | None = None,
    *,
    prompt_lengths: jax.Array | None = None,
    prompt_blocks: int = 0,
    prompt_pool: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    softcap: float | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """One query per slot at position `lengths` [S] over the slot's cache blocks: q [S, 1, heads, d]; key blocks
    [S, kv_heads, d, B]; value blocks [S, kv_heads, B, d] -> [S, 1, heads, d]. The first `prompt_blocks` blocks are
    the slot's shared-prompt blocks (prompt block j holds positions j*B.., real below `prompt_lengths` [S]), the
    others its own (own block i holds positions prompt length + i*B..; without prompt lengths, i*B..). A slot sees
    the real positions <= its length (and within `window`). With `prompt_pool` (a layer's pool keys, pool values and
    the slots' prompt table, `gather_prompt_blocks`) the blocks given are the own ones and the prompt blocks are the
    table's: the Pallas kernel reads them in the pool, the xla path gathers them. Under an `program_layout` of
    several devices the Pallas kernel runs per shard (xla where the operands do not split by the layout); with
    `softcap` it runs as xla."""
    name = decode_kernel(softcap, q.shape[-1], implementation)
    if name is not None:
        from hfjax.models import attention_pallas  # Pallas loads only when it runs

        def kernel(q, keys, values, lengths, prompt_lengths, pool_keys, pool_values, table) -> jax.Array:
            pool = None if table is None else (pool_keys, pool_values, table)  # the operands split by DECODE_AXES
            return attention_pallas.decode_attention(
                q, keys, values, lengths, window, prompt_lengths, prompt_blocks=prompt_blocks, pool=pool,
                interpret=name == "pallas_interpret",
            )  # fmt: skip

        starts = jnp.zeros_like(lengths) if prompt_lengths is None else prompt_lengths
        operands = (q, tuple(key_blocks), tuple(value_blocks), lengths, starts, *(prompt_pool or (None,) * 3))
        out = per_shard(kernel, operands, DECODE_AXES, current_layout())
        if out is not None:
            return out
    if prompt_pool is not None:
        pool_keys, pool_values, table = prompt_pool
        prompt_blocks = table.shape[1]
        key_blocks = (*gather_prompt_blocks(pool_keys, table), *key_blocks)
        value_blocks = (*gather_prompt_blocks(pool_values, table), *value_blocks)
    block = key_blocks[0].shape[-1]
    own_positions = block * (len(key_blocks) - prompt_blocks)
    allowed = decode_mask(
        lengths, own_positions, window, prompt_lengths=prompt_lengths, prompt_positions=block * prompt_blocks
    )
    return attend_blocks(q, key_blocks, value_blocks, allowed, softcap)
