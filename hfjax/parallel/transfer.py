"""Moving arrays to new shardings on the same devices: `reshard(arrays, shardings)`.

GPU/TPU: one batched `jax.device_put` (collectives over NVLink/ICI, pipelined). CPU, one process: each distinct
target block is assembled on the host from zero-copy views of the source shards, together with the copies for the
devices that replicate it (CPU "devices" share host memory, and XLA's in-process CPU collectives spin on rendezvous,
which on a few cores is slow and can deadlock with several resharding programs in flight). CPU, several processes:
`jax.device_put` one array at a time, each finished before the next starts.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding


def block_bounds(index: tuple[slice, ...], shape: Sequence[int]) -> list[tuple[int, int]]:
    """(start, stop) per dimension of a shard index (`None` bounds made explicit)."""
    return [(s.start or 0, shape[d] if s.stop is None else s.stop) for d, s in enumerate(index)]


def aligned_empty(shape: Sequence[int], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """An uninitialised host array whose data is `align`-byte aligned: `jax.device_put` of it to a CPU device is
    then zero-copy (a 16-byte-aligned numpy buffer is copied, at about 1.5 GB/s here)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def _bits(array: np.ndarray) -> np.ndarray:
    """The same bytes as unsigned integers of the same width (numpy copies ml_dtypes types more slowly)."""
    return array.view(np.dtype(f"uint{8 * array.dtype.itemsize}")) if array.dtype.itemsize in (1, 2, 4, 8) else array


def _widening(target: np.ndarray, source: np.ndarray, last_bounds: Sequence[int]) -> int:
    """How many elements of both (C-contiguous, same itemsize) arrays one 8-byte element covers when the copy's
    last-axis bounds `last_bounds` and both arrays' last dimensions allow it, else 1. Copies of blocks cut along the
    last axis move short rows, and numpy's per-element cost there is what limits them."""
    arrays = (target, source)
    if target.itemsize not in (1, 2, 4) or not all(a.flags.c_contiguous for a in arrays):
        return 1
    factor = 8 // target.itemsize
    return 1 if any(b % factor for b in (*last_bounds, *(a.shape[-1] for a in arrays))) else factor


def _fill_block(block: np.ndarray, want: list[tuple[int, int]], pieces: list[tuple[tuple, np.ndarray]]) -> None:
    """Fills `block` (bounds `want`) from the overlapping `pieces`."""
    block_bits, filled = _bits(block), 0
    for have, data in pieces:
        overlap = [(max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(want, have, strict=True)]
        if any(lo >= hi for lo, hi in overlap):
            continue
        dst = [slice(lo - w0, hi - w0) for (lo, hi), (w0, _) in zip(overlap, want, strict=True)]
        src = [slice(lo - h0, hi - h0) for (lo, hi), (h0, _) in zip(overlap, have, strict=True)]
        target, source = block_bits, data
        factor = _widening(target, source, (dst[-1].start, dst[-1].stop, src[-1].start, src[-1].stop)) if dst else 1
        if factor > 1:
            target, source = target.view(np.uint64), source.view(np.uint64)
            dst[-1] = slice(dst[-1].start // factor, dst[-1].stop // factor)
            src[-1] = slice(src[-1].start // factor, src[-1].stop // factor)
        target[tuple(dst)] = source[tuple(src)]
        filled += math.prod(hi - lo for lo, hi in overlap)
    if filled != block.size:
        raise RuntimeError(f"target block {want} is not covered by the source shards")


def _source_pieces(source: jax.Array) -> list[tuple[tuple, np.ndarray]]:
    """(bounds, zero-copy host view) of each distinct block of `source`."""
    pieces, seen = [], set()
    for shard in source.addressable_shards:
        key = tuple(block_bounds(shard.index, source.shape))
        if key not in seen:
            seen.add(key)
            pieces.append((key, _bits(np.asarray(shard.data))))
    return pieces


def _fill_replicas(replicas: list[np.ndarray], want: list[tuple[int, int]], pieces: list) -> None:
    """Fills `replicas[0]` (bounds `want`) from the overlapping `pieces` and copies it into the other replicas, one
    slab of about `_SLAB_BYTES` along the first axis at a time: each slab is gathered once and then read from cache
    for every copy, instead of the whole block being read back from memory once per replica."""
    first, others = replicas[0], replicas[1:]
    if first.ndim == 0 or first.shape[0] == 0:
        _fill_block(first, want, pieces)
        for other in others:
            np.copyto(_bits(other), _bits(first))
        return
    rows = max(1, _SLAB_BYTES // max(1, first[0].nbytes))
    for lo in range(0, first.shape[0], rows):
        hi = min(lo + rows, first.shape[0])
        _fill_block(first[lo:hi], [(want[0][0] + lo, want[0][0] + hi), *want[1:]], pieces)
        for other in others:
            np.copyto(_bits(other[lo:hi]), _bits(first[lo:hi]))


def _assemble_on_host(sources: Sequence[jax.Array], targets: Sequence[NamedSharding]) -> list[jax.Array]:
    """Builds each distinct target block from the source blocks that overlap it, together with its replicas (the
    devices that hold the same block along the target's unsharded axes): a block cut from column shards is gathered
    with short strided rows once, not once per replica. The calling thread first allocates every new block and takes
    every source view, then a thread per core runs one task per distinct block (numpy releases the GIL while it
    copies), then the calling thread places each array zero-copy. Python work done beside the copies, rather than
    before and after them, makes the copying threads wait for the GIL (18-22% slower, measured on 2 cores)."""
    plans, jobs = [], []
    for source, target in zip(sources, targets, strict=True):
        placements = list(target.addressable_devices_indices_map(source.shape).items())
        bounds = [tuple(block_bounds(index, source.shape)) for _, index in placements]
        blocks = [aligned_empty([hi - lo for lo, hi in b], source.dtype) for b in bounds]
        replicas: dict[tuple, list[np.ndarray]] = {}
        for b, block in zip(bounds, blocks, strict=True):
            replicas.setdefault(b, []).append(block)
        pieces = _source_pieces(source)
        jobs += [(group, list(b), pieces) for b, group in replicas.items()]
        plans.append((placements, blocks))
    for task in [_POOL.submit(_fill_replicas, *job) for job in jobs]:
        task.result()
    return [
        _place(source.shape, target, placements, blocks)
        for source, target, (placements, blocks) in zip(sources, targets, plans, strict=True)
    ]


def _place(shape: tuple[int, ...], target: NamedSharding, placements: list, blocks: list[np.ndarray]) -> jax.Array:
    """The global array whose block on device `placements[i][0]` (index `placements[i][1]`) is `blocks[i]`, placed
    zero-copy. `make_array_from_callback` places all blocks in one call (the cheapest), but gives every device the
    same block when the target is fully replicated; then each device gets its own block through a batched
    `device_put`."""
    if target.is_fully_replicated:
        devices = [device for device, _ in placements]
        return jax.make_array_from_single_device_arrays(shape, target, jax.device_put(blocks, devices))
    by_index: dict[tuple, list[np.ndarray]] = {}
    for (_, index), block in zip(placements, blocks, strict=True):
        by_index.setdefault(tuple(block_bounds(index, shape)), []).append(block)
    return jax.make_array_from_callback(shape, target, lambda index: by_index[tuple(block_bounds(index, shape))].pop())


_SLAB_BYTES = 2**20
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="hfjax-reshard")


def reshard(arrays: Sequence[jax.Array], shardings: Sequence[NamedSharding]) -> list[jax.Array]:
    """The arrays moved to `shardings` (same devices, new layout), finished when this returns. An array already laid
    out as its target (`in_place`) is not copied: it comes back as itself, or over the same buffers under the target's
    mesh (one program cannot mix meshes), so a caller that frees what it moved must keep such sources."""
    staying = [in_place(a, s) for a, s in zip(arrays, shardings, strict=True)]
    moving = [(a, s) for a, s, stays in zip(arrays, shardings, staying, strict=True) if not stays]
    moved = iter(_move([a for a, _ in moving], [s for _, s in moving]))
    return [
        _same_buffers(a, s) if stays else next(moved) for a, s, stays in zip(arrays, shardings, staying, strict=True)
    ]


def in_place(array: jax.Array, sharding: NamedSharding) -> bool:
    """Whether every device already holds the block of `array` that `sharding` gives it."""
    return array.sharding.is_equivalent_to(sharding, array.ndim)


def relabel(array: jax.Array, sharding: NamedSharding) -> jax.Array:
    """`array` under `sharding` without a copy where it is `in_place` (the same buffers, the target's mesh), else
    `array` itself."""
    return _same_buffers(array, sharding) if in_place(array, sharding) else array


def _same_buffers(array: jax.Array, sharding: NamedSharding) -> jax.Array:
    if array.sharding == sharding:
        return array
    shards = [shard.data for shard in array.addressable_shards]
    return jax.make_array_from_single_device_arrays(array.shape, sharding, shards)


def _move(arrays: list[jax.Array], shardings: list[NamedSharding]) -> list[jax.Array]:
    if not arrays:
        return []
    platform = arrays[0].sharding.mesh.devices.flat[0].platform
    if platform == "cpu" and jax.process_count() == 1:
        return _assemble_on_host(arrays, shardings)
    if platform == "cpu":
        return [jax.block_until_ready(jax.device_put(a, s)) for a, s in zip(arrays, shardings, strict=True)]
    return jax.block_until_ready(jax.device_put(arrays, shardings))
