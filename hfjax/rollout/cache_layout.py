"""`CacheLayout`: the shapes, shardings and size of a `JaxEngine`'s decode state over a generation `Layout`.

A slot's cache is its prompt's blocks in the shared prompt pool plus its own blocks for the response (and appended
observations). Positions are cut into blocks of `block` (`kv_block_size` of prompt + response); a slot has `blocks`
own blocks (max_new_tokens) and reads up to `prompt_blocks` pool blocks (max_prefill_length). Slots are sharded over
the layout's batch mesh axes and kv heads over its tensor axis; the pool is split into as many parts as the slots
(one when the slots do not divide), each part's pool sharded with its slots. The pool holds `prompt_cache_tokens`
positions (all parts together; default: a prompt of max_prefill_length per slot, the copied layout's memory).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from hfjax.models.config import ModelConfig
from hfjax.parallel.layout import Layout
from hfjax.rollout.interface import DecodeState, kv_block_size
from hfjax.rollout.sampling import SamplingError


def batch_sharded(layout: Layout, shape: tuple[int, ...], logical: tuple[str | None, ...]) -> NamedSharding:
    """Sharding by `layout` of each dimension that divides evenly; a dimension that does not is replicated."""
    entries = []
    used: set[str] = set()
    for size, axis in zip(shape, logical, strict=True):
        mesh_axes = tuple(a for a in dict(layout.rules).get(axis, ()) if a not in used and layout.axis_size(a) > 1)
        parts = int(np.prod([layout.axis_size(a) for a in mesh_axes])) if mesh_axes else 1
        if not mesh_axes or size % parts:
            entries.append(None)
            continue
        used.update(mesh_axes)
        entries.append(mesh_axes if len(mesh_axes) > 1 else mesh_axes[0])
    return NamedSharding(layout.mesh, PartitionSpec(*entries))


class CacheLayout:
    """The decode state of `slots` slots of a `cfg` model in `dtype` over `layout` (module docstring)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layout: Layout,
        dtype: jnp.dtype,
        *,
        slots: int,
        max_prefill_length: int,
        max_new_tokens: int,
        prompt_cache_tokens: int | None = None,
    ):
        self.config, self.slots, self.dtype = cfg, slots, jnp.dtype(dtype)
        self.capacity = max_prefill_length + max_new_tokens
        self.block = block = kv_block_size(self.capacity, layout.platform)
        self.blocks = -(-max_new_tokens // block)
        self.prompt_blocks = -(-max_prefill_length // block)
        parts = layout.batch_parts
        self.pool_parts = parts if slots % parts == 0 else 1
        least = self.prompt_blocks * block * self.pool_parts  # one longest prompt per part
        if prompt_cache_tokens is None:
            per_part = self.prompt_blocks * (slots // self.pool_parts)
        elif not isinstance(prompt_cache_tokens, int) or prompt_cache_tokens < least:
            raise SamplingError(
                f"rollout.prompt_cache_tokens: {prompt_cache_tokens!r}; expected an integer >= {least} (a prompt of"
                f" max_prefill_length {max_prefill_length} in {self.prompt_blocks} blocks of {block} positions for"
                f" each of {self.pool_parts} data shards)"
            )
        else:
            per_part = -(-prompt_cache_tokens // (block * self.pool_parts))
        self.pool_blocks = per_part  # per part
        kv, hd = cfg.num_kv_heads, cfg.head_dim
        self.key_shape, self.value_shape = (slots, kv, hd, block), (slots, kv, block, hd)
        self.pool_key_shape = (self.pool_parts, per_part, kv, hd, block)
        self.pool_value_shape = (self.pool_parts, per_part, kv, block, hd)
        key = batch_sharded(layout, self.key_shape, ("batch", "kv_heads", "head_dim", "length"))
        value = batch_sharded(layout, self.value_shape, ("batch", "kv_heads", "length", "head_dim"))
        pool_key = batch_sharded(layout, self.pool_key_shape, ("batch", None, "kv_heads", "head_dim", "length"))
        pool_value = batch_sharded(layout, self.pool_value_shape, ("batch", None, "kv_heads", "length", "head_dim"))
        per_slot = batch_sharded(layout, (slots,), ("batch",))
        self.readers_shape = (self.pool_parts, per_part, slots // self.pool_parts)  # a copy's readers: its part's slots
        layers = cfg.num_layers
        self.sharding = DecodeState(
            ((key,) * self.blocks,) * layers,
            ((value,) * self.blocks,) * layers,
            (pool_key,) * layers,
            (pool_value,) * layers,
            batch_sharded(layout, (slots, self.prompt_blocks), ("batch", None)),
            per_slot,
            batch_sharded(layout, self.readers_shape, ("batch", None, None)),
            batch_sharded(layout, self.readers_shape[:2], ("batch", None)),
            per_slot,
            per_slot,
            per_slot,
            batch_sharded(layout, (slots, 2), ("batch", None)),
            per_slot,
            per_slot,
            per_slot,
            per_slot,
        )

    @property
    def own_capacity(self) -> int:
        """Positions of a slot's own blocks (past its prompt)."""
        return self.blocks * self.block

    def empty(self) -> DecodeState:
        """Zero caches, tables and lengths (an empty slot computes harmlessly until something is inserted)."""
        layers, slots = range(self.config.num_layers), self.slots

        def zeros(shape: tuple[int, ...]) -> jnp.ndarray:
            return jnp.zeros(shape, self.dtype)

        return DecodeState(
            tuple(tuple(zeros(self.key_shape) for _ in range(self.blocks)) for _ in layers),
            tuple(tuple(zeros(self.value_shape) for _ in range(self.blocks)) for _ in layers),
            tuple(zeros(self.pool_key_shape) for _ in layers),
            tuple(zeros(self.pool_value_shape) for _ in layers),
            jnp.zeros((slots, self.prompt_blocks), jnp.int32),
            jnp.zeros(slots, jnp.int32),
            jnp.full(self.readers_shape, self.readers_shape[-1], jnp.int32),  # no reader
            jnp.zeros(self.readers_shape[:2], jnp.int32),
            jnp.zeros(slots, jnp.int32),
            jnp.zeros(slots, jnp.int32),
            jnp.zeros(slots, jnp.int32),
            jnp.zeros((slots, 2), jnp.uint32),
            jnp.zeros(slots, jnp.int32),
            jnp.zeros(slots, jnp.float32),
            jnp.zeros(slots, jnp.int32),
            jnp.ones(slots, jnp.float32),
        )

    def bytes_per_device(self) -> int:
        """Bytes of the KV caches (own blocks and prompt pool) on each device: the largest shard of each, summed."""
        s = self.sharding
        own = self.blocks * sum(
            math.prod(sharding.shard_shape(shape))
            for sharding, shape in ((s.keys[0][0], self.key_shape), (s.values[0][0], self.value_shape))
        )
        pool = sum(
            math.prod(sharding.shard_shape(shape))
            for sharding, shape in ((s.pool_keys[0], self.pool_key_shape), (s.pool_values[0], self.pool_value_shape))
        )
        return self.config.num_layers * (own + pool) * self.dtype.itemsize

    def copied_bytes(self) -> int:
        """Bytes of the KV cache of the copied layout (every slot holds a copy of its prompt: capacity positions in
        blocks of `block`, no pool), all devices together."""
        kv, hd = self.config.num_kv_heads, self.config.head_dim
        positions = -(-self.capacity // self.block) * self.block
        return 2 * self.config.num_layers * self.slots * kv * hd * positions * self.dtype.itemsize
