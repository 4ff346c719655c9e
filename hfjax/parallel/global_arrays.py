"""Inside a worker process: global `jax.Array`s from this process's rows of a batch, and this process's rows back.

With one process per host, each process holds the chunk of the batch its group call received; `to_global` builds
the global arrays (`jax.make_array_from_process_local_data`, no cross-process traffic) and `to_local` copies this
process's block of each global array back to numpy; `process_reduce` sums or maxes small host values over the
group's processes (loss normalisers, agreed micro-batch widths).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding


def to_global(local: Any, sharding: Sharding | Any) -> Any:
    """A pytree of global arrays from a pytree of process-local arrays; `sharding` is one Sharding for every leaf
    or a pytree of them. The global shape follows from the sharding (e.g. rows x number of processes)."""
    if isinstance(sharding, Sharding):
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), local)
    return jax.tree.map(lambda x, s: jax.make_array_from_process_local_data(s, np.asarray(x)), local, sharding)


def _process_block(array: jax.Array) -> np.ndarray:
    if array.is_fully_addressable:
        return np.asarray(array)
    shards = {}
    for shard in array.addressable_shards:
        bounds = tuple(
            (s.start or 0, dim if s.stop is None else s.stop) for s, dim in zip(shard.index, array.shape, strict=True)
        )
        shards.setdefault(bounds, shard)
    starts = [min(b[d][0] for b in shards) for d in range(array.ndim)]
    stops = [max(b[d][1] for b in shards) for d in range(array.ndim)]
    covered = sum(math.prod(stop - start for start, stop in b) for b in shards)
    if covered != math.prod(b - a for a, b in zip(starts, stops, strict=True)):
        raise ValueError(
            f"to_local: this process's shards {sorted(shards)} of an array of shape {array.shape} are not one block; "
            "order the mesh devices so that each process's devices are adjacent on the sharded axes"
        )
    out = np.empty([b - a for a, b in zip(starts, stops, strict=True)], dtype=array.dtype)
    for bounds, shard in shards.items():
        out[tuple(slice(a - s, b - s) for (a, b), s in zip(bounds, starts, strict=True))] = np.asarray(shard.data)
    return out


def to_local(tree: Any) -> Any:
    """This process's block of every global array in `tree`, as numpy (the inverse of `to_global`)."""
    return jax.tree.map(_process_block, tree)


def process_reduce(values: Any, op: str) -> np.ndarray:
    """`values` (numbers, the same shape in every process of the group) reduced over the processes with `op`
    (`sum` or `max`); the values themselves with one process. A small collective: every process must call it."""
    values = np.asarray(values)
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    gathered = np.asarray(multihost_utils.process_allgather(values))
    return gathered.sum(axis=0) if op == "sum" else gathered.max(axis=0)
