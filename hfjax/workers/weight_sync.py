"""Weights from the trainer's actor to a rollout group on other devices (disaggregated placement).

The trainer side (`export_shards`) casts each parameter to the rollout's dtype where it lies and takes every block
of it exactly once from the process that holds its first replica (`replica_id == 0`), as host arrays: across all
trainer processes each byte of the rollout's copy is sent once. The blocks travel through Ray's object store (no
trip through the controller). The rollout side (`assemble`) checks that the blocks cover every parameter exactly,
with the shapes and dtypes it expects, before anything replaces its weights: a sync that fails part way leaves the
rollout on its previous version. Cost: `bytes` = the rollout copy's size once; on one machine its floor is one host
memory copy of those bytes (device to host, then host to device on an accelerator).
Imports jax and numpy only.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np


class WeightSyncError(RuntimeError):
    """Blocks that do not make up the rollout's parameters (missing, extra, overlapping, wrong shape or dtype)."""


@dataclasses.dataclass
class WeightShards:
    """One trainer process's share of the weights: per parameter (by tree path) its global shape and dtype, and the
    blocks it sends as `(path, index, array)` with `index` a tuple of `(start, stop)` per dimension (the array's bytes
    as unsigned integers of the dtype's item size, viewed back as the dtype on arrival)."""

    shapes: dict[str, tuple[tuple[int, ...], str]]
    blocks: list[tuple[str, tuple[tuple[int, int], ...], np.ndarray]]
    seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(block.nbytes for _, _, block in self.blocks)


def param_paths(params: Any) -> list[tuple[str, Any]]:
    """(path string, leaf) of every parameter, in tree order."""
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]]


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
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


def assemble(parts: list[WeightShards], expected: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, np.ndarray]:
    """Whole host arrays per parameter path from the trainer processes' blocks; raises `WeightSyncError` naming the
    first parameter that is missing, unexpected, of another shape or dtype, or not covered exactly once."""
    by_path: dict[str, list[tuple[tuple[tuple[int, int], ...], np.ndarray]]] = {}
    for part in parts:
        for path, shape_dtype in part.shapes.items():
            if path not in expected:
                raise WeightSyncError(f"the trainer sent parameter {path}, which the rollout model does not have")
            if tuple(shape_dtype[0]) != tuple(expected[path][0]) or shape_dtype[1] != expected[path][1]:
                raise WeightSyncError(
                    f"parameter {path}: the trainer sent {shape_dtype[1]}{list(shape_dtype[0])}, the rollout holds "
                    f"{expected[path][1]}{list(expected[path][0])}"
                )
        for path, index, block in part.blocks:
            if path in expected and block.dtype.itemsize == np.dtype(expected[path][1]).itemsize:
                block = block.view(expected[path][1])
            by_path.setdefault(path, []).append((index, block))
    out = {}
    for path, (shape, dtype) in expected.items():
        pieces = by_path.get(path)
        if not pieces:
            raise WeightSyncError(f"parameter {path}: no block of it arrived from the trainer")
        if any(block.dtype != np.dtype(dtype) for _, block in pieces):
            raise WeightSyncError(f"parameter {path}: a block is not {dtype}")
        if len(pieces) == 1 and tuple(pieces[0][1].shape) == tuple(shape):
            out[path] = pieces[0][1]  # one block holds it all: no copy
            continue
        whole = np.empty(shape, dtype)
        covered = np.zeros(shape, np.int32)
        for index, block in pieces:
            region = tuple(slice(start, stop) for start, stop in index)
            if whole[region].shape != block.shape:
                raise WeightSyncError(
                    f"parameter {path}: a block of shape {block.shape} does not fit its index {index}"
                )
            whole[region] = block
            covered[region] += 1
        if not np.all(covered == 1):
            raise WeightSyncError(
                f"parameter {path}: {int(np.sum(covered == 0))} elements missing and {int(np.sum(covered > 1))} sent "
                "more than once"
            )
        out[path] = whole
    return out
