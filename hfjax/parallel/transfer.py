"""Moving arrays to new shardings on the same devices: `reshard(arrays, shardings)`.

GPU/TPU: one batched `jax.device_put` (collectives over NVLink/ICI, pipelined). CPU, one process: each distinct
target block is assembled on the host from zero-copy views of the source shards and copied whole to the devices
that replicate it (one memcpy per received byte: CPU
"devices" share host memory, and XLA's in-process CPU collectives spin on rendezvous, which on a few cores is slow
and can deadlock with several resharding programs in flight). CPU, several processes: `jax.device_put` one array
at a time, each finished before the next starts. Imports nothing from the rest of hfjax.
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


def _fill_block(want: list[tuple[int, int]], pieces: list[tuple[tuple, np.ndarray]], dtype: np.dtype) -> np.ndarray:
    """A new (aligned) block with bounds `want`, copied from the overlapping `pieces`."""
    block = aligned_empty([hi - lo for lo, hi in want], dtype)
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
    return block


def _source_pieces(source: jax.Array) -> list[tuple[tuple, np.ndarray]]:
    """(bounds, zero-copy host view) of each distinct block of `source`."""
    pieces, seen = [], set()
    for shard in source.addressable_shards:
        key = tuple(block_bounds(shard.index, source.shape))
        if key not in seen:
            seen.add(key)
            pieces.append((key, _bits(np.asarray(shard.data))))
    return pieces


def _copy_block(block: np.ndarray) -> np.ndarray:
    """A new (aligned) block with the contents of `block` (one contiguous memcpy)."""
    out = aligned_empty(block.shape, block.dtype)
    np.copyto(_bits(out), _bits(block))
    return out


def _assemble_on_host(sources: Sequence[jax.Array], targets: Sequence[NamedSharding]) -> list[jax.Array]:
    """Builds each distinct target block once from the source blocks that overlap it, then gives every other device
    that holds the same block (its replicas along the target's unsharded axes) a contiguous copy of it: a block cut
    from column shards is gathered with short strided rows once, not once per replica. Copies run on a thread per
    core with all blocks of all arrays in flight (numpy releases the GIL while copying); each array is then placed
    zero-copy."""
    plans = []
    for source, target in zip(sources, targets, strict=True):
        pieces = _source_pieces(source)
        placements = list(target.addressable_devices_indices_map(source.shape).items())
        bounds = [tuple(block_bounds(index, source.shape)) for _, index in placements]
        fills = {b: _POOL.submit(_fill_block, list(b), pieces, source.dtype) for b in dict.fromkeys(bounds)}
        plans.append((placements, bounds, fills))
    pending = []
    for _, bounds, fills in plans:
        blocks, built = [], set()
        for b in bounds:
            blocks.append(_POOL.submit(_copy_block, fills[b].result()) if b in built else fills[b])
            built.add(b)
        pending.append(blocks)
    return [
        _place(source.shape, target, placements, [block.result() for block in blocks])
        for source, target, (placements, _, _), blocks in zip(sources, targets, plans, pending, strict=True)
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


_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="hfjax-reshard")


def reshard(arrays: Sequence[jax.Array], shardings: Sequence[NamedSharding]) -> list[jax.Array]:
    """The arrays moved to `shardings` (same devices, new layout), finished when this returns."""
    if not arrays:
        return []
    platform = arrays[0].sharding.mesh.devices.flat[0].platform
    if platform == "cpu" and jax.process_count() == 1:
        return _assemble_on_host(arrays, shardings)
    if platform == "cpu":
        return [jax.block_until_ready(jax.device_put(a, s)) for a, s in zip(arrays, shardings, strict=True)]
    return jax.block_until_ready(jax.device_put(list(arrays), list(shardings)))
