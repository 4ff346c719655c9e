"""Causal-LM forwards with a KV cache: the prefill of a batch of prompts and one decode step over all slots.

A slot's cache is left-aligned with no padding inside it: the prompt's token i sits at cache position i and has rope
position i, and decoding writes the next token at position `lengths[slot]`. In the decode caches a slot's prompt sits
in blocks of a shared prompt pool (`PromptBlocks`: the samples of one prompt read the same blocks) and the positions
from its prompt length on in the slot's own blocks. The decode cache of a layer is a tuple of
blocks of consecutive positions, so that a step attends only over the blocks its longest slot has reached (a block
is its own array: slicing one big cache array would copy it on CPU). Blocks keep positions as the last axis of the
keys ([slots, kv_heads, head_dim, block]) and the next-to-last of the values ([slots, kv_heads, block, head_dim]):
both products of decode attention then run along contiguous memory, about 3x faster on CPU than the prefill layout
[batch, positions, kv_heads, head_dim]. Both forwards run the model's own residual blocks (`DecoderLayer.block`) with
the attention step replaced by the model's attention functions (`causal_attention` over the prompts,
`decode_attention` over the cache blocks, each implementation chosen by backend), so their numerics are the model's.
`extend_forward` appends tokens to sequences already in a cache (an environment's observation after a model turn):
only the new tokens run through the model, attending over the cached history, so a turn costs its own tokens, not a
re-prefill of everything before it.
Cost of a decode step: every parameter is read once (2 FLOPs per parameter per slot) plus the KV cache blocks in use
(slots x positions x kv heads x head_dim x 2 per layer; both the XLA attention and the Pallas kernel read the
prompt pool in place; `extend_slots_forward` copies the prompt and own blocks of the slots it extends, not of all).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from hfjax.models.attention import attention_mask, causal_attention, extend_attention
from hfjax.models.decode_attention import (
    decode_attention,
    decode_kernel,
    decode_mask,
    extend_blocks_attention,
    gather_prompt_blocks,
)
from hfjax.models.transformer import CausalLM
from hfjax.models.vision_lm import VisionLanguageLM, language_model
from hfjax.rollout.pooled_attention import PoolReaders, pooled_decode_attention


class Prefix(NamedTuple):
    """The result of prefilling B prompts (right-padded to a bucket length P): per-layer keys and values
    [B, P, kv_heads, head_dim], the prompt lengths [B] and the logits at each prompt's last token [B, vocab]."""

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    lengths: jax.Array
    last_logits: jax.Array


def prefill_forward(
    model: CausalLM | VisionLanguageLM, tokens: jax.Array, lengths: jax.Array, images: jax.Array | None = None
) -> Prefix:
    """Runs prompts tokens [B, P] (right-padded; `lengths` [B] real tokens each) and keeps their keys and values.
    Real tokens never attend to the padding after them (causal), so padding does not change their results. A
    vision-language model reads each prompt's `images` [B, images per row, channels, height, width] in place of its
    placeholders (in order; a row's images past its placeholders are padding, never read), and the tokens of an
    image see the whole image (`VisionLanguageLM.hidden`)."""
    batch, length = tokens.shape
    lm = language_model(model)
    decoder = lm.model
    index = jnp.arange(length, dtype=jnp.int32)
    tables = decoder.rotary(jnp.broadcast_to(index, (batch, length)))
    masks: dict[int | None, jax.Array] = {}
    if images is None:
        x = decoder.embed(tokens)
    else:
        x, blocks = model.embed_with_images(tokens, images)
        valid = (index[None, :] < lengths[:, None]).astype(jnp.int32)
        masks = {w: attention_mask(valid, index, index, w, blocks) for w in {layer.window for layer in decoder.layers}}
    keys, values = [], []
    for layer in decoder.layers:

        def attend(q: jax.Array, k: jax.Array, v: jax.Array, layer: Any = layer) -> jax.Array:
            keys.append(k)
            values.append(v)
            return causal_attention(
                q, k, v, lengths=lengths, mask=masks.get(layer.window), window=layer.window, softcap=layer.softcap,
                sees_ahead=bool(masks),
            )  # fmt: skip

        x = layer.block(x, *tables[layer.rope], attend)
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return Prefix(tuple(keys), tuple(values), lengths, lm.logits(decoder.norm(last)))


def _new_tokens_forward(model: CausalLM, tokens: jax.Array, starts: jax.Array, counts: jax.Array, attend_of: Any
                        ) -> jax.Array:  # fmt: skip
    """Runs tokens [B, T] at positions `starts + i` through the model's blocks, each layer's attention step given by
    `attend_of(index, layer, positions)`; returns the logits at each row's last real token (`counts` [B])."""
    model = language_model(model)
    decoder = model.model
    positions = starts[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    tables = decoder.rotary(positions)
    x = decoder.embed(tokens)
    for index, layer in enumerate(decoder.layers):
        x = layer.block(x, *tables[layer.rope], attend_of(index, layer, positions))
    last = jnp.take_along_axis(x, jnp.maximum(counts - 1, 0)[:, None, None], axis=1)[:, 0]
    return model.logits(decoder.norm(last))


def extend_forward(
    model: CausalLM,
    tokens: jax.Array,
    starts: jax.Array,
    counts: jax.Array,
    cache_keys: tuple[jax.Array, ...],
    cache_values: tuple[jax.Array, ...],
) -> Prefix:
    """Appends tokens [B, T] (right-padded; `counts` [B] real tokens each) to sequences whose first `starts` [B]
    positions are in the caches (per layer, prefill layout [B, L, kv_heads, head_dim]): the new tokens get positions
    `starts + i`, their keys and values are written there (padding positions past L are dropped) and they attend
    over the history and each other. Returns the caches with them, lengths `starts + counts` and the logits at each
    row's last real token. Cost: the new tokens' forward plus attention over L positions; the history is only read."""
    keys, values = [], []

    def attend_of(index: int, layer: Any, positions: jax.Array) -> Any:
        def write(cache: jax.Array, update: jax.Array) -> jax.Array:
            return jax.vmap(lambda c, u, p: c.at[p].set(u.astype(c.dtype), mode="drop"))(cache, update, positions)

        def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            ck, cv = write(cache_keys[index], k), write(cache_values[index], v)
            keys.append(ck)
            values.append(cv)
            return extend_attention(q, ck, cv, starts, layer.window, softcap=layer.softcap)

        return attend

    logits = _new_tokens_forward(model, tokens, starts, counts, attend_of)
    return Prefix(tuple(keys), tuple(values), starts + counts, logits)


class PromptBlocks(NamedTuple):
    """The shared-prompt part of the decode caches: per layer the prompt pool's keys [parts, pool blocks, kv_heads,
    head_dim, B] and values [parts, pool blocks, kv_heads, B, head_dim] (each part of the batch mesh axes holds its
    own pool, for its own slots), each slot's `table` [S, n] of block ids in its part's pool (prompt block j holds
    positions j*B..) and its prompt length [S]; a slot's own blocks hold the positions from its prompt length on.
    With `readers` (which slots read each block) a decode step's XLA attention reads the pool in place."""

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    table: jax.Array
    lengths: jax.Array
    readers: PoolReaders | None = None


def extend_slots_forward(
    model: CausalLM,
    tokens: jax.Array,
    starts: jax.Array,
    counts: jax.Array,
    slots: jax.Array,
    cache_keys: tuple[tuple[jax.Array, ...], ...],
    cache_values: tuple[tuple[jax.Array, ...], ...],
    live: int,
    prompt: PromptBlocks,
) -> tuple[jax.Array, tuple[tuple[jax.Array, ...], ...], tuple[tuple[jax.Array, ...], ...]]:
    """`extend_forward` onto running decode slots: row i's tokens go to slot `slots[i]` (out of range: computed,
    never written) at positions `starts[i]`.. (at or past the slot's prompt length), in place in the slot's own
    cache blocks (per layer; the first `live` own blocks hold every position the rows reach). They attend over the
    slot's shared-prompt blocks and its own. Only the new positions are written and only the rows' blocks are read,
    so a call costs the new tokens' forward and one read of their history. Returns (logits at each row's last real
    token, new own key blocks, new own value blocks)."""
    block = cache_keys[0][0].shape[-1]
    rows = jnp.minimum(slots, cache_keys[0][0].shape[0] - 1)
    prompt_lengths = prompt.lengths[rows]
    new_keys, new_values = [], []

    def attend_of(index: int, layer: Any, positions: jax.Array) -> Any:
        own = positions - prompt_lengths[:, None]

        def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            kb = [_write_block(cache_keys[index][i], k, slots, own - i * block, 3) for i in range(live)]
            vb = [_write_block(cache_values[index][i], v, slots, own - i * block, 2) for i in range(live)]
            new_keys.append((*kb, *cache_keys[index][live:]))
            new_values.append((*vb, *cache_values[index][live:]))
            pk = gather_prompt_blocks(prompt.keys[index], prompt.table, rows)
            pv = gather_prompt_blocks(prompt.values[index], prompt.table, rows)
            return extend_blocks_attention(
                q,
                [*pk, *(b[rows] for b in kb)],
                [*pv, *(b[rows] for b in vb)],
                starts,
                layer.window,
                prompt_lengths=prompt_lengths,
                prompt_blocks=len(pk),
                softcap=layer.softcap,
            )

        return attend

    logits = _new_tokens_forward(model, tokens, starts, counts, attend_of)
    return logits, tuple(new_keys), tuple(new_values)


def _write_block(block: jax.Array, update: jax.Array, slots: jax.Array, positions: jax.Array, axis: int) -> jax.Array:
    """`block` (keys [S, kv_heads, head_dim, B] with `axis` 3, values [S, kv_heads, B, head_dim] with `axis` 2) with
    update [R, T, kv_heads, head_dim] written at (slots [R], positions [R, T] within the block); positions outside
    the block and slots out of range are dropped."""
    size = block.shape[axis]
    positions = jnp.where((positions >= 0) & (positions < size), positions, size)  # negative ones would wrap
    where = jnp.broadcast_to(slots[:, None], positions.shape)
    index = (where, slice(None), slice(None), positions) if axis == 3 else (where, slice(None), positions, slice(None))
    return block.at[index].set(update.astype(block.dtype), mode="drop")


def write_positions(cache: jax.Array, update: jax.Array, positions: jax.Array, axis: int) -> jax.Array:
    """`cache` [slots, ...] with each slot's `update` (the cache's shape without `axis`) written at `positions`
    [slots] along `axis` (dropped outside [0, size)). The scatter is vmapped over slots, so the slots are a batching
    dimension and a slots-sharded cache is written shard by shard (indexing every slot in one scatter makes the
    partitioner all-gather the updates)."""
    size = cache.shape[axis]
    positions = jnp.where((positions >= 0) & (positions < size), positions, size)  # negative indices would wrap

    def one(slot_cache: jax.Array, slot_update: jax.Array, position: jax.Array) -> jax.Array:
        return slot_cache.at[(slice(None),) * (axis - 1) + (position,)].set(slot_update, mode="drop")

    return jax.vmap(one)(cache, update.astype(cache.dtype), positions)


def decode_forward(
    model: CausalLM,
    tokens: jax.Array,
    lengths: jax.Array,
    cache_keys: tuple[tuple[jax.Array, ...], ...],
    cache_values: tuple[tuple[jax.Array, ...], ...],
    prompt: PromptBlocks,
) -> tuple[jax.Array, tuple[tuple[jax.Array, ...], ...], tuple[tuple[jax.Array, ...], ...]]:
    """One token per slot: tokens [S] at positions `lengths` [S]; per layer, the first of each slot's own cache
    blocks in the decode layout (keys [S, kv_heads, head_dim, B], values [S, kv_heads, B, head_dim]; own position i
    is position prompt length + i), enough to hold every slot's position, and its shared-prompt blocks (`prompt`).
    Writes each slot's key and value in its own blocks (dropped past the blocks given) and attends over the prompt
    blocks and its own in one softmax (XLA attention with `prompt.readers` reads the pool in place:
    `pooled_decode_attention`). Returns (logits [S, vocab] float32, new own key blocks, new own value blocks)."""
    block = cache_keys[0][0].shape[-1]
    model = language_model(model)
    decoder = model.model
    own = lengths - prompt.lengths
    tables = decoder.rotary(lengths[:, None])
    x = decoder.embed(tokens[:, None])
    new_keys, new_values = [], []
    for index, (layer, key_blocks, value_blocks) in enumerate(
        zip(decoder.layers, cache_keys, cache_values, strict=True)
    ):

        def attend(q: jax.Array, k: jax.Array, v: jax.Array, kb=key_blocks, vb=value_blocks, index=index,
                   layer=layer):  # fmt: skip
            starts = [i * block for i in range(len(kb))]
            kb = tuple(write_positions(c, k[:, 0], own - s, axis=3) for c, s in zip(kb, starts, strict=True))
            vb = tuple(write_positions(c, v[:, 0], own - s, axis=2) for c, s in zip(vb, starts, strict=True))
            new_keys.append(kb)
            new_values.append(vb)
            columns = prompt.table.shape[1]
            if prompt.readers is not None and columns and decode_kernel(layer.softcap, q.shape[-1]) is None:
                allowed = decode_mask(
                    lengths, block * len(kb), layer.window, prompt_lengths=prompt.lengths,
                    prompt_positions=block * columns,
                )  # fmt: skip
                return pooled_decode_attention(
                    q, prompt.keys[index], prompt.values[index], prompt.table, prompt.readers, kb, vb, allowed,
                    layer.softcap,
                )  # fmt: skip
            return decode_attention(
                q, kb, vb, lengths, layer.window, prompt_lengths=prompt.lengths,
                prompt_pool=(prompt.keys[index], prompt.values[index], prompt.table), softcap=layer.softcap,
            )  # fmt: skip

        x = layer.block(x, *tables[layer.rope], attend)
    logits = model.logits(decoder.norm(x[:, 0]))
    return logits, tuple(new_keys), tuple(new_values)
