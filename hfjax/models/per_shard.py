"""`per_shard`: an attention kernel (the Pallas TPU kernels, cuDNN under a sequence axis) run per shard inside a
`jax.shard_map` over a multi-device layout, and the logical axes of the kernels' operands.

XLA cannot partition a Pallas (Mosaic) kernel over devices, nor cuDNN's over the positions a sequence axis splits, so
over a layout of several devices `per_shard` gives each device whole batch rows (split over the mesh axes of the
layout's `batch` rule) and whole groups of query heads with their kv head (split over those of its `heads` and
`kv_heads` rules: the tensor axis in the presets), so that no shard needs another's data (under a sequence axis the
queries split by position too, the keys and values gathered whole). Where a dimension does not divide, or query and
kv heads would split differently, it declines (logged once per reason) and the caller runs xla.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax

from hfjax.parallel.layout import Layout, LayoutError

logger = logging.getLogger(__name__)

# Logical axes (`hfjax.parallel.layout.LOGICAL_AXES`) of the kernels' operands, in argument order; a sequence of
# arrays (cache blocks) has one entry for all its arrays. The output is split like the queries, the first operand.
Axes = tuple[str | None, ...]
QUERY_AXES: Axes = ("batch", None, "heads", None)  # q [b, t, heads, d] and the output
KV_AXES: Axes = ("batch", None, "kv_heads", None)  # k, v [b, t, kv_heads, d]
BLOCK_AXES: Axes = ("batch", "kv_heads", None, None)  # keys [S, kv_heads, d, B] and values [S, kv_heads, B, d]
CAUSAL_AXES = (QUERY_AXES, KV_AXES, KV_AXES, ("batch", None))  # q, k, v, valid
# q and its segment ids split by position (over the `length` rule's axes), k, v and theirs whole
SPLIT_CAUSAL_AXES = (("batch", "length", "heads", None), KV_AXES, KV_AXES, ("batch", "length"), ("batch", None))
POOL_AXES: Axes = ("batch", None, "kv_heads", None, None)  # a shared prompt pool [parts, pool blocks, kv_heads, ..]
# q, own blocks, lengths, prompt lengths, and the shared prompt pool's keys, values and table (or None each)
DECODE_AXES = (QUERY_AXES, BLOCK_AXES, BLOCK_AXES, ("batch",), ("batch",), POOL_AXES, POOL_AXES, ("batch", None))


def shard_specs(layout: Layout, operands: Sequence[Any], axes: Sequence[Axes]) -> tuple[Any, ...]:
    """The `PartitionSpec`s (a tree per operand) that split each operand by `layout`'s rules for its logical `axes`.
    Raises LayoutError where a dimension does not divide by its mesh axes, or where one logical axis (query heads and
    kv heads counting as one: a shard must hold whole groups) would split differently in two operands."""
    specs = tuple(
        jax.tree.map(lambda x, a=a: layout.spec(a, x.shape, "attention operand"), operand)
        for operand, a in zip(operands, axes, strict=True)
    )
    splits: dict[str, set[Any]] = {}
    for tree, names in zip(specs, axes, strict=True):
        for spec in jax.tree.leaves(tree):
            for entry, name in zip(spec, names, strict=True):
                if name is not None:
                    splits.setdefault("heads" if name == "kv_heads" else name, set()).add(entry)
    uneven = {name: sorted(map(str, entries)) for name, entries in splits.items() if len(entries) > 1}
    if uneven:
        raise LayoutError(f"attention operands split differently over {layout.describe()}: {uneven}")
    return specs


@functools.cache
def _log_fallback(reason: str) -> None:
    logger.info("%s; that attention runs as xla instead of a kernel per shard", reason)


def per_shard(
    kernel: Callable[..., jax.Array], operands: Sequence[Any], axes: Sequence[Axes], layout: Layout | None
) -> jax.Array | None:
    """`kernel(*operands)`; under a `layout` of several devices, per shard inside a `jax.shard_map` over its mesh, the
    operands split by `shard_specs` and the output like the first operand. None (logged once per reason) where the
    operands cannot split so: the caller then runs xla. Without a layout, or on one device, the kernel runs as is."""
    if layout is None or layout.size == 1:
        return kernel(*operands)
    try:
        specs = shard_specs(layout, operands, axes)
    except LayoutError as error:
        _log_fallback(str(error))
        return None
    # check_vma=False: the kernels' outputs (splash, cuDNN) carry no varying-axes annotation. q, k, v and the output
    # split over the same mesh axes, so the transpose (which divides the output's cotangent by the size of the other
    # axes and sums the operands' cotangents over them) gives exact gradients.
    return jax.shard_map(kernel, mesh=layout.mesh, in_specs=specs, out_specs=specs[0], check_vma=False)(*operands)
