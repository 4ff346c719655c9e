"""CPU resharding (`hfjax.parallel.transfer`) against numpy slicing, and the host allocator policy."""

import subprocess
import sys
import textwrap

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hfjax.parallel import transfer

# (shape, dtype, source spec, target spec) on a (4, 2) mesh of axes ("a", "b").
CASES = [
    ((1024, 768), np.float32, P("a", "b"), P(None, "b")),  # 1.5 MiB target blocks, 4 replicas each
    ((8, 96, 1024), ml_dtypes.bfloat16, P("b", None, "a"), P("b", None, None)),  # gathered from last-axis shards
    ((512, 256), ml_dtypes.bfloat16, P(None, ("a", "b")), P("a", None)),  # short strided rows into row blocks
    ((2048,), np.int32, P(("a", "b")), P()),  # fully replicated target
    ((), np.float32, P(), P()),  # a scalar
    ((0, 16), np.float32, P(None, "b"), P(None, None)),  # empty
]


@pytest.mark.parametrize("slab_bytes", [2**20, 1000])
def test_reshard_equals_numpy_slices(monkeypatch, slab_bytes):
    """Every device's block of every resharded array equals the numpy slice of the original, bit for bit; with
    the default slab size and with slabs of a few rows (many slabs per block, ragged last slab)."""
    monkeypatch.setattr(transfer, "_SLAB_BYTES", slab_bytes)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    rng = np.random.default_rng(0)
    hosts, sources, targets = [], [], []
    for shape, dtype, source_spec, target_spec in CASES:
        host = rng.integers(0, 2**15, size=shape).astype(dtype)
        hosts.append(host)
        sources.append(jax.device_put(host, NamedSharding(mesh, source_spec)))
        targets.append(NamedSharding(mesh, target_spec))
    moved = transfer.reshard(sources, targets)
    for host, source, out, target in zip(hosts, sources, moved, targets, strict=True):
        assert out.sharding == target
        for shard in out.addressable_shards:
            got, want = np.asarray(shard.data), host[shard.index]
            assert got.shape == want.shape and got.tobytes() == want.tobytes()
        if source.sharding.is_equivalent_to(target, source.ndim):
            assert out is source  # already in place: not copied (the scalar)
            continue
        pointers = [shard.data.unsafe_buffer_pointer() for shard in out.addressable_shards]
        assert len(set(pointers)) == len(pointers)  # replicas are copies, not one buffer shared by devices


def test_reshard_returns_arrays_already_in_place_untouched():
    """An array already in its target layout comes back as the same object, beside one that moves: callers free
    what moved (`source is not result`), and on GPUs a device_put to the same sharding returns a new array over the
    same buffers, so freeing the source deleted the result (the first GRPO step on an H200 failed so)."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    staying = jax.device_put(np.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("a", "b")))
    moving = jax.device_put(np.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("a", None)))
    same_layout = NamedSharding(Mesh(mesh.devices, ("a", "b")), P("a", "b"))  # equivalent, not the same object
    out = transfer.reshard([staying, moving], [same_layout, NamedSharding(mesh, P(None, "b"))])
    assert out[0] is staying
    assert out[1] is not moving and out[1].sharding.spec == P(None, "b")
    assert np.array_equal(np.asarray(out[1]), np.arange(64.0).reshape(8, 8))


def test_keep_freed_host_memory_keeps_and_reuses_freed_memory():
    """Under glibc's default policy a freed 64 MiB block goes back to the kernel (resident size drops by it); once
    freed memory is kept, it stays resident and the next block of that size reuses it (resident size flat)."""
    script = textwrap.dedent(
        """
        import os, numpy as np
        from hfjax.parallel.host_memory import keep_freed_host_memory

        def resident():
            return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

        def drop_on_free():
            block = np.empty(64 * 2**20, np.uint8); block[...] = 1
            before = resident(); del block
            return before - resident()

        default = drop_on_free()
        kept = keep_freed_host_memory()
        drop_on_free()
        start = resident()
        drops = [drop_on_free() for _ in range(3)]
        print(default, kept, max(drops), resident() - start)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    default, kept, kept_drop, growth = int(out[0]), out[1] == "True", int(out[2]), int(out[3])
    assert kept
    assert default >= 60 * 2**20, default
    assert kept_drop < 2**20 and abs(growth) < 2**20, (kept_drop, growth)
