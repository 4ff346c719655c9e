"""Host allocator policy for CPU devices: keep freed memory in the process, so that each train <-> gen transition
writes its new buffers into memory the previous one freed instead of into memory the kernel must map (and, on a
VM, the hypervisor back) page by page.

glibc's malloc by default gives large blocks their own mappings and returns freed memory at the top of the heap to
the kernel. Resharding on CPU frees and allocates the same few hundred MiB to GiB every transition; kept, a
transition runs about twice as fast with almost no page faults (docs/benchmarks.md, "Host memory policy"). The
price: the process's resident size does not shrink below its high-water mark, which an RL loop reaches every
iteration anyway.
Also: moving arrays between device memory and pinned host memory (`to_memory_kind`), where the backend has it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

import jax

from hfjax.parallel.layout import Layout

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # mallopt parameters of glibc's malloc.h
_M_MMAP_MAX = -4


@functools.cache
def keep_freed_host_memory() -> bool:
    """Sets glibc's malloc (for the whole process, once) to serve every block from its heaps (`M_MMAP_MAX` = 0) and
    never to trim them (`M_TRIM_THRESHOLD` = -1). Returns whether both settings took effect; False where the C
    library is not glibc."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        log.info("keep_freed_host_memory: this C library has no mallopt; freed host memory may be returned")
        return False
    kept = bool(mallopt(_M_TRIM_THRESHOLD, -1)) and bool(mallopt(_M_MMAP_MAX, 0))
    log.info("keep_freed_host_memory: freed host memory stays in the process (%s)", "set" if kept else "refused")
    return kept


def has_separate_host_memory(layout: Layout) -> bool:
    """Whether the layout's devices have pinned host memory apart from their own (not CPU devices)."""
    device = layout.mesh.devices.reshape(-1)[0]
    kinds = {m.kind for m in device.addressable_memories()}
    return device.platform != "cpu" and "pinned_host" in kinds


def to_memory_kind(tree: Any, kind: str) -> Any:
    """The tree's arrays copied to memory `kind`; the sources are deleted once the copies exist."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and x.sharding.memory_kind != kind]
    moved = jax.device_put([leaves[i] for i in arrays], [leaves[i].sharding.with_memory_kind(kind) for i in arrays])
    jax.block_until_ready(moved)
    out = list(leaves)
    for i, copy in zip(arrays, moved, strict=True):
        leaves[i].delete()
        out[i] = copy
    return jax.tree.unflatten(treedef, out)
