"""Pallas TPU kernels of the model's attention (`hfjax.models.attention` picks them): causal self-attention through the
splash attention kernels shipped with JAX (forward and backward), and a decode kernel written here.

Splash attention takes the real keys as segment ids: a row's real positions are segment 1 and its padding segment 0,
so real queries see only real keys, and padding queries see padding keys (at least themselves: no row is ever empty).
Its sequence blocks are multiples of the TPU's 128 lanes, so the sequence is padded up to one (extra positions are
padding, after every real query, and are cut from the output).
The decode kernel runs a grid of (slot, kv head, step): the query heads of that kv head against each cache block in
turn (the slot's shared-prompt blocks, then its own, placed by its prompt length), a sub-block of at most
`SUB_BLOCK` positions per step, with an online softmax in float32, skipping (and not fetching) the sub-blocks that
hold no position the slot may see: its VMEM does not grow with the context.
XLA cannot partition a Pallas (Mosaic) kernel over devices: over a layout of several devices the kernels run per
shard (`hfjax.models.per_shard`).
With `interpret=True` the kernels run on any backend in Pallas interpret mode (what CPU tests use).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from hfjax.models.config import MASKED_SCORE

LANES = 128


@functools.lru_cache(maxsize=64)
def _splash_kernel(
    queries: int, keys: int, heads: int, window: int | None, offset: int, interpret: bool
) -> splash.SplashAttentionKernel:
    """The splash kernel for causal attention (within `window` when set) of `heads` query heads at positions
    offset..offset + queries - 1 over `keys` positions from 0 (both multiples of 128). Built once per shape, with its
    block tables as concrete arrays."""
    shape = (queries, keys)
    if window is None:
        mask = splash.CausalMask(shape, offset=offset)
    else:
        mask = splash.LocalMask(shape, (window - 1, 0), offset=offset)
    block = next(size for size in (512, 256, LANES) if queries % size == 0 and keys % size == 0)
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    with jax.ensure_compile_time_eval():  # concrete block tables, safe to cache across traces
        return splash.make_splash_mha(
            splash.MultiHeadMask([mask] * heads), block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
        )


def _splash(
    q: jax.Array, k: jax.Array, v: jax.Array, q_valid: jax.Array, valid: jax.Array, window: int | None, offset: int,
    interpret: bool,
) -> jax.Array:  # fmt: skip
    """Splash attention of queries q [b, tq, heads, d] at positions offset.. over keys k, v [b, t, kv_heads, d] from
    position 0; `q_valid` [b, tq] and `valid` [b, t] their segment ids (0: padding). Each length is padded up to a
    multiple of 128 with padding positions after the real ones (cut from the output)."""
    _, tq, heads, d = q.shape
    q_pad, kv_pad = -tq % LANES, -k.shape[1] % LANES

    def heads_major(x: jax.Array, pad: int) -> jax.Array:
        return jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    q_segments = jnp.pad(q_valid.astype(jnp.int32), ((0, 0), (0, q_pad)))
    kv_segments = jnp.pad(valid.astype(jnp.int32), ((0, 0), (0, kv_pad)))
    kernel = _splash_kernel(tq + q_pad, k.shape[1] + kv_pad, heads, window, offset, interpret)

    def one_row(q: jax.Array, k: jax.Array, v: jax.Array, q_segment: jax.Array, kv_segment: jax.Array) -> jax.Array:
        return kernel(q, k, v, segment_ids=splash.SegmentIds(q_segment, kv_segment))

    scaled = q * jnp.asarray(d**-0.5, q.dtype)  # splash attention does not scale the scores
    out = jax.vmap(one_row)(
        heads_major(scaled, q_pad), heads_major(k, kv_pad), heads_major(v, kv_pad), q_segments, kv_segments
    )
    return out.transpose(0, 2, 1, 3)[:, :tq]


def splash_causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array, window: int | None, *, interpret: bool
) -> jax.Array:
    """Causal self-attention by splash attention: q [b, t, heads, d]; k, v [b, t, kv_heads, d]; valid [b, t] (real
    keys 1, or the segment ids of packed sequences; padding 0) -> [b, t, heads, d]. Differentiable (splash
    attention's own backward kernels)."""
    return _splash(q, k, v, valid, valid, window, 0, interpret)


def splash_split_positions_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_valid: jax.Array,
    valid: jax.Array,
    window: int | None,
    *,
    axes: tuple[str, ...],
    parts: int,
    interpret: bool,
) -> jax.Array:
    """Splash attention of one device's share of the positions (inside a `shard_map` whose mesh axes `axes` split
    the positions into N = `parts`): q [b, t / N, heads, d] and `q_valid` [b, t / N] are this device's positions,
    k, v [b, t, kv_heads, d] and `valid` [b, t] every position. The device's place along `axes` picks one of N
    kernels, each with its queries' offset in its mask (splash masks are static), so each skips the key blocks past
    its queries."""
    local = q.shape[1]
    kernels = [functools.partial(_splash, window=window, offset=i * local, interpret=interpret) for i in range(parts)]
    return jax.lax.switch(jax.lax.axis_index(axes), kernels, q, k, v, q_valid, valid)


_KERNEL_PRECISION = jax.lax.Precision.DEFAULT
SUB_BLOCK = 512  # the most positions of a cache block the decode kernel holds in VMEM at once (per operand)


def sub_block(block: int, most: int = SUB_BLOCK) -> int:
    """Positions per step of the decode kernel's grid through a cache block of `block` positions: the largest
    divisor of `block` up to `most` that is a multiple of the TPU's 128 lanes, else the largest divisor up to `most`
    (a block under 128 positions, as CPU tests use: the block itself)."""
    fitting = [size for size in range(min(block, most), 0, -1) if block % size == 0]
    return next((size for size in fitting if size % LANES == 0), fitting[0])


class _DecodeBlocks:
    """Where the decode kernel's grid step `step` is for a slot: block `i` of `blocks` (the first `prompt_blocks`
    the slot's shared-prompt blocks, the rest its own) covers steps i * subs .. (i + 1) * subs - 1, one sub-block of
    `sub` positions each."""

    def __init__(self, blocks: int, block: int, sub: int, prompt_blocks: int):
        self.blocks, self.block, self.sub, self.prompt_blocks = blocks, block, sub, prompt_blocks
        self.subs = block // sub

    def start(self, i: int, prompt: jax.Array) -> jax.Array:
        """The first position of block `i`: prompt block i holds positions i * block..; own block i -
        prompt_blocks holds positions prompt + (i - prompt_blocks) * block.. ."""
        own = i - self.prompt_blocks
        return jnp.int32(i * self.block) if own < 0 else prompt + own * self.block

    def end(self, i: int, length: jax.Array, prompt: jax.Array) -> jax.Array:
        """The first position past block `i`'s visible ones: the prompt's end, or the slot's position + 1."""
        return prompt if i < self.prompt_blocks else length + 1

    def fetched(self, i: int, step: jax.Array, length: jax.Array, prompt: jax.Array) -> jax.Array:
        """The sub-block of block `i` that the grid holds at `step`: its own while the grid is in block `i`, else
        the nearest; never past the last that holds a visible position, so that a step there fetches nothing new
        (the pipeline copies a block only when its index changes)."""
        last = jax.lax.div(self.end(i, length, prompt) - 1 - self.start(i, prompt), jnp.int32(self.sub))
        last = jax.lax.max(jax.lax.min(last, jnp.int32(self.subs - 1)), jnp.int32(0))  # lax: index maps take scalars
        return jax.lax.max(jax.lax.min(step - i * self.subs, last), jnp.int32(0))


def _decode_kernel(
    lengths_ref: jax.Array,
    prompt_ref: jax.Array,
    table_ref: jax.Array,
    q_ref: jax.Array,
    *refs: jax.Array,
    where: _DecodeBlocks,
    window: int | None,
) -> None:
    keys, values = refs[: where.blocks], refs[where.blocks : 2 * where.blocks]
    out_ref, max_ref, sum_ref, acc_ref = refs[2 * where.blocks :]
    step = pl.program_id(2)
    length, prompt = lengths_ref[pl.program_id(0)], prompt_ref[pl.program_id(0)]

    @pl.when(step == 0)
    def _() -> None:
        max_ref[...] = jnp.full(max_ref.shape, MASKED_SCORE, jnp.float32)
        sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    q = q_ref[...]  # [group, d]
    scale = q.shape[-1] ** -0.5
    for i in range(where.blocks):
        part = step - i * where.subs  # this step's sub-block of block i (outside 0..subs-1: another block's step)
        start = where.start(i, prompt) + part * where.sub
        end = where.end(i, length, prompt)
        seen = (part >= 0) & (part < where.subs) & (start < end)  # a visible position (and one in the window)
        if window is not None:
            seen &= length - (start + where.sub - 1) < window

        @pl.when(seen)
        def _(i: int = i, start: jax.Array = start, end: jax.Array = end) -> None:
            key = keys[i][...].astype(q.dtype)  # exact: a float32 query only widens the products
            # the dots' precision is explicit: Mosaic takes no HIGHEST for bf16 operands (a process-wide
            # jax_default_matmul_precision would otherwise reach them)
            scores = jnp.dot(q, key, precision=_KERNEL_PRECISION, preferred_element_type=jnp.float32) * scale
            position = start + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
            allowed = position < end
            if window is not None:
                allowed &= length - position < window
            scores = jnp.where(allowed, scores, MASKED_SCORE)
            previous = max_ref[...]
            new_max = jnp.maximum(previous, jnp.max(scores, axis=-1, keepdims=True))
            probs = jnp.exp(scores - new_max)
            decay = jnp.exp(previous - new_max)
            sum_ref[...] = decay * sum_ref[...] + jnp.sum(probs, axis=-1, keepdims=True)
            value = values[i][...]
            acc_ref[...] = decay * acc_ref[...] + jnp.dot(
                probs.astype(value.dtype), value, precision=_KERNEL_PRECISION, preferred_element_type=jnp.float32
            )
            max_ref[...] = new_max

    @pl.when(step == pl.num_programs(2) - 1)
    def _() -> None:
        total = sum_ref[...]  # 0 only when no block was seen (a slot with nothing to see): the output is then 0
        out_ref[...] = (acc_ref[...] / jnp.where(total > 0, total, 1.0)).astype(out_ref.dtype)


def decode_attention(
    q: jax.Array,
    key_blocks: Sequence[jax.Array],
    value_blocks: Sequence[jax.Array],
    lengths: jax.Array,
    window: int | None,
    prompt_lengths: jax.Array | None = None,
    *,
    prompt_blocks: int = 0,
    pool: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    interpret: bool,
    most_positions: int = SUB_BLOCK,
) -> jax.Array:
    """One query per slot at position `lengths` [S] over its cache blocks, scores and softmax in float32:
    q [S, 1, heads, d]; key blocks [S, kv_heads, d, B]; value blocks [S, kv_heads, B, d] -> [S, 1, heads, d]. The
    first `prompt_blocks` blocks are the slot's shared-prompt blocks (real below `prompt_lengths` [S]), the others
    its own, from position prompt length on (`hfjax.models.decode_attention.decode_key_positions`).

    The grid runs (slot, kv head, step): the steps stream the blocks through VMEM `sub_block(B, most_positions)`
    positions at a time, so the kernel's scoped VMEM does not grow with the context (the block size), only with
    the number of blocks (bounded by the engine); a step past a slot's last visible position fetches nothing.

    With `pool` (pool keys [parts, pool blocks, kv_heads, d, B], pool values [parts, pool blocks, kv_heads, B, d],
    `table` [S, n]: each slot's prompt blocks, ids in its part's pool; slots in the order of the parts) the n prompt
    blocks are read where they lie in the shared pool, through the grid's index maps (no per-slot copy), and
    `key_blocks` / `value_blocks` are the slot's own blocks only."""
    slots, _, heads, d = q.shape
    kv_heads, block = key_blocks[0].shape[1], key_blocks[0].shape[3]
    prompt_lengths = jnp.zeros_like(lengths) if prompt_lengths is None else prompt_lengths
    if pool is not None:
        pool_keys, pool_values, table = pool
        parts, pool_blocks = pool_keys.shape[:2]
        prompt_blocks, per_part = table.shape[1], slots // parts
        pool_keys, pool_values = (x.reshape(parts * pool_blocks, *x.shape[2:]) for x in (pool_keys, pool_values))
        table = (table + (jnp.arange(slots, dtype=jnp.int32) // per_part * pool_blocks)[:, None]).reshape(-1)
        key_blocks, value_blocks = (
            (pool_keys,) * prompt_blocks + tuple(key_blocks),
            ((pool_values,) * prompt_blocks + tuple(value_blocks)),
        )
    else:
        table = jnp.zeros((1,), jnp.int32)
    group, count = heads // kv_heads, len(key_blocks)
    where = _DecodeBlocks(count, block, sub_block(block, most_positions), prompt_blocks)
    pooled = pool is not None

    def whole(*shape: int | None) -> pl.BlockSpec:
        return pl.BlockSpec((None, *shape), lambda slot, head, step, lengths, prompts, table: (slot, head, 0, 0))

    def streamed(i: int, keys: bool) -> pl.BlockSpec:
        def index(slot, head, step, lengths, prompts, table):
            part = where.fetched(i, step, lengths[slot], prompts[slot])
            row = table[slot * prompt_blocks + i] if pooled and i < prompt_blocks else slot  # a pool block, or own
            return (row, head, 0, part) if keys else (row, head, part, 0)

        return pl.BlockSpec((None, None, d, where.sub) if keys else (None, None, where.sub, d), index)

    if group % 8:  # as JAX's paged attention does: a [.., 1, d] float32 query, else XLA tiles it 8 rows deep
        queries, query_spec = q.reshape(slots, heads, 1, d).astype(jnp.float32), whole(group, None, d)
    else:
        queries, query_spec = q.reshape(slots, kv_heads, group, d), whole(None, group, d)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(slots, kv_heads, count * where.subs),
        in_specs=[
            query_spec,
            *[streamed(i, keys=True) for i in range(count)],
            *[streamed(i, keys=False) for i in range(count)],
        ],
        out_specs=query_spec,
        scratch_shapes=[
            pltpu.VMEM((group, 1), jnp.float32),
            pltpu.VMEM((group, 1), jnp.float32),
            pltpu.VMEM((group, d), jnp.float32),
        ],
    )
    kernel = functools.partial(_decode_kernel, where=where, window=window)
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(queries.shape, queries.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(lengths.astype(jnp.int32), prompt_lengths.astype(jnp.int32), table, queries, *key_blocks, *value_blocks)
    return out.reshape(slots, 1, heads, d).astype(value_blocks[0].dtype)
