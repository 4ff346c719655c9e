"""Weights from the trainer's actor to a rollout group on other devices (disaggregated placement): the blocks.

The trainer side (`export_shards`) casts each parameter to the rollout's dtype where it lies and takes every block
of it exactly once from the process that holds its first replica (`replica_id == 0`), as host arrays: across all
trainer processes each byte of the rollout's copy is sent once. The blocks travel through Ray's object store (no
trip through the controller). The rollout side first checks them from their metadata alone (`check_blocks`: every
parameter it holds and no other, its shape and dtype, each block inside its parameter with the shape of its index,
the blocks of a parameter pairwise disjoint and their sizes summing to the parameter's: an exact cover), then
builds each of its devices' shards straight from the blocks that intersect it (`place_param`): never a whole
parameter on the host, at most one device shard beyond the received blocks at a time, none where one block holds
the shard's whole region (a view of it). Staging, switching and the two phases across a rollout group are in
`hfjax.workers.weight_swap`. Cost: `bytes` = the rollout copy's size once; on one machine its floor is one host
memory copy of those bytes (device to host, then host to device on an accelerator).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
import numpy as np

Bounds = tuple[tuple[int, int], ...]  # (start, stop) per dimension
Block = tuple[Bounds, np.ndarray]


class WeightSyncError(RuntimeError):
    """Blocks that do not make up the rollout's parameters (missing, extra, overlapping, wrong shape or dtype), or
    a sync that could not be placed or agreed on."""


@dataclasses.dataclass
class WeightShards:
    """One trainer process's share of the weights: per parameter (by tree path) its global shape and dtype, and the
    blocks it sends as `(path, index, array)` with `index` a tuple of `(start, stop)` per dimension (the array's bytes
    as unsigned integers of the dtype's item size, viewed back as the dtype on arrival)."""

    shapes: dict[str, tuple[tuple[int, ...], str]]
    blocks: list[tuple[str, Bounds, np.ndarray]]
    seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(block.nbytes for _, _, block in self.blocks)


def param_paths(params: Any) -> list[tuple[str, Any]]:
    """(path string, leaf) of every parameter, in tree order."""
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]]


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> Bounds:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def _raw(block: np.ndarray) -> np.ndarray:
    """The block's bytes as unsigned integers of its item size: numpy pickles arrays of extension dtypes (bfloat16)
    into the pickle stream, plain ones as out-of-band buffers that Ray's object store passes without a copy."""
    return block.view(f"u{block.dtype.itemsize}")


def export_shards(params: Any, dtype: Any) -> WeightShards:
    """This process's blocks of `params` cast to `dtype` (on the devices, one parameter at a time), each block of
    each parameter from the one process holding its replica 0."""
    started = time.perf_counter()
    dtype = np.dtype(dtype)
    shapes, blocks = {}, []
    for path, leaf in param_paths(params):
        shapes[path] = (tuple(leaf.shape), dtype.name)
        cast = leaf if leaf.dtype == dtype else leaf.astype(dtype)
        for shard in cast.addressable_shards:
            if shard.replica_id == 0:
                blocks.append((path, _bounds(shard.index, leaf.shape), _raw(np.asarray(shard.data))))
        del cast
    return WeightShards(shapes, blocks, time.perf_counter() - started)


def _typed(path: str, block: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`block` as `dtype` (it arrives as unsigned integers of the item size, see `_raw`), without a copy."""
    if block.dtype == dtype:
        return block
    if block.dtype == np.dtype(f"u{dtype.itemsize}"):
        return block.view(dtype)
    raise WeightSyncError(f"parameter {path}: a block is {block.dtype}, expected {dtype.name}")


def check_cover(path: str, shape: tuple[int, ...], blocks: list[Block]) -> None:
    """Raises `WeightSyncError` naming `path` unless the blocks cover the parameter of `shape` exactly once: each
    index inside the shape with its block's shape as its extent, no two blocks sharing an element, and their sizes
    summing to the parameter's. Reads the indices and shapes only (memory: blocks squared booleans)."""
    for index, block in blocks:
        if len(index) != len(shape) or any(not 0 <= lo <= hi <= n for (lo, hi), n in zip(index, shape, strict=False)):
            raise WeightSyncError(f"parameter {path}: block index {list(index)} lies outside its shape {list(shape)}")
        if tuple(block.shape) != tuple(hi - lo for lo, hi in index):
            raise WeightSyncError(
                f"parameter {path}: a block of shape {list(block.shape)} does not fit its index {list(index)}"
            )
    bounds = np.array([index for index, _ in blocks], np.int64).reshape(len(blocks), len(shape), 2)
    lo, hi = bounds[..., 0], bounds[..., 1]
    sizes = np.prod(hi - lo, axis=1)
    full = np.flatnonzero(sizes > 0)  # an empty block shares no element, whatever its index
    lo, hi = lo[full], hi[full]
    overlap = np.all((lo[:, None] < hi[None]) & (lo[None] < hi[:, None]), axis=-1)
    np.fill_diagonal(overlap, False)
    if overlap.any():
        i, j = np.argwhere(overlap)[0]
        first, second = (list(blocks[full[k]][0]) for k in (i, j))
        raise WeightSyncError(f"parameter {path}: blocks {first} and {second} overlap (elements sent twice)")
    missing = math.prod(shape) - int(sizes.sum())
    if missing:
        raise WeightSyncError(f"parameter {path}: {missing} of {math.prod(shape)} elements missing")


def check_blocks(parts: list[WeightShards], expected: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, list[Block]]:
    """Each expected parameter's blocks (viewed as its dtype, no copy) from the trainer processes' `parts`, after
    checking them from their metadata alone; raises `WeightSyncError` naming the first parameter that is missing,
    unexpected, of another shape or dtype, or not covered exactly once (`check_cover`). Allocates nothing of a
    parameter's size."""
    by_path: dict[str, list[Block]] = {path: [] for path in expected}
    for part in parts:
        for path, (shape, dtype) in part.shapes.items():
            if path not in expected:
                raise WeightSyncError(f"the trainer sent parameter {path}, which the rollout model does not have")
            want_shape, want_dtype = expected[path]
            if tuple(shape) != tuple(want_shape) or dtype != want_dtype:
                raise WeightSyncError(
                    f"parameter {path}: the trainer sent {dtype}{list(shape)}, the rollout holds "
                    f"{want_dtype}{list(want_shape)}"
                )
        for path, index, block in part.blocks:
            if path not in expected:
                raise WeightSyncError(f"the trainer sent a block of {path}, which the rollout model does not have")
            bounds = tuple((int(lo), int(hi)) for lo, hi in index)
            by_path[path].append((bounds, _typed(path, block, np.dtype(expected[path][1]))))
    for path, (shape, _) in expected.items():
        if not by_path[path]:
            raise WeightSyncError(f"parameter {path}: no block of it arrived from the trainer")
        check_cover(path, tuple(shape), by_path[path])
    return by_path


def _slices(bounds: Bounds, origin: Bounds) -> tuple[slice, ...]:
    """`bounds` (global) as slices of an array whose first element lies at `origin`'s starts."""
    return tuple(slice(lo - start, hi - start) for (lo, hi), (start, _) in zip(bounds, origin, strict=True))


def shard_region(blocks: list[Block], region: Bounds, dtype: Any) -> np.ndarray:
    """The elements of `region` of a parameter from its `blocks` (an exact cover, `check_cover`): a view of the
    block that holds all of `region` where one does, else a new array of the region's size filled from the blocks
    that intersect it."""
    for index, block in blocks:
        if all(lo <= start and stop <= hi for (lo, hi), (start, stop) in zip(index, region, strict=True)):
            return block[_slices(region, index)]
    out = np.empty([stop - start for start, stop in region], dtype)
    for index, block in blocks:
        common = tuple((max(lo, start), min(hi, stop)) for (lo, hi), (start, stop) in zip(index, region, strict=True))
        if all(lo < hi for lo, hi in common):
            out[_slices(common, region)] = block[_slices(common, index)]
    return out


def place_param(blocks: list[Block], like: jax.Array) -> jax.Array:
    """The parameter of `blocks` as an array of `like`'s shape, dtype and sharding: each distinct shard region of
    this process's devices built once on the host (`shard_region`), put on every device holding it and released
    before the next is built."""
    shape, sharding = tuple(like.shape), like.sharding
    devices_of: dict[Bounds, list[Any]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        devices_of.setdefault(_bounds(index, shape), []).append(device)
    arrays = []
    for region, devices in devices_of.items():
        host = shard_region(blocks, region, like.dtype)
        placed = [jax.device_put(host, device) for device in devices]
        jax.block_until_ready(placed)  # the host copy (if any) is freed before the next region's
        arrays += placed
        del host
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
