"""Generation one host at a time inside a group of many processes: each process's share of a global generation
layout as a layout of its own devices, and process-local views of global parameters (no copy, no communication).

A generation layout runs one loop per host when each data-parallel replica (the devices at one index of the mesh's
`data` axis) lies inside one process: each process then holds whole replicas of the parameters, and its
continuous-batching loop runs on a local mesh of `data / processes` replicas with no per-token cross-host traffic.
Imports `hfjax.parallel.layout` only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from hfjax.parallel.layout import Layout, LayoutError


def check_per_host_generation(layout: Layout, hosts: int, where: str = "rollout.gen_layout") -> None:
    """Raises unless `layout`'s data axis splits evenly over `hosts` (one loop per host needs whole replicas)."""
    data = layout.axis_size("data")
    if data % hosts:
        raise LayoutError(
            f"{where}: {layout.describe()} has data={data}, which {hosts} hosts cannot share; generation runs one "
            f"continuous-batching loop per host, so each host must hold whole data-parallel replicas: make mesh.data "
            f"a multiple of {hosts} and the other axes (tensor, fsdp) fit in one host's devices. A tensor-parallel "
            "group spanning hosts would need every decode step in lockstep across hosts, which hfjax does not run"
        )


def process_layout(layout: Layout, where: str = "rollout.gen_layout") -> Layout:
    """This process's part of the (device-ordered) global `layout`: the same axes and rules with `data` divided by
    the process count, over this process's devices in mesh order. Raises if a replica spans processes."""
    processes = jax.process_count()
    if processes == 1:
        return layout
    check_per_host_generation(layout, processes, where)
    names = [name for name, _ in layout.axes]
    data_axis = names.index("data")
    devices = np.moveaxis(layout.mesh.devices, data_axis, 0)
    owners = [{d.process_index for d in replica.reshape(-1)} for replica in devices]
    split = [sorted(o) for o in owners if len(o) > 1]
    if split:
        raise LayoutError(
            f"{where}: {layout.describe()} with device order {list(layout.device_ids or ())}: a data-parallel replica "
            f"spans processes {split[0]}; each replica's devices must be on one host (tensor-parallel groups inside "
            "a host)"
        )
    mine = [replica for replica, o in zip(devices, owners, strict=True) if o == {jax.process_index()}]
    local = np.moveaxis(np.stack(mine), 0, data_axis)
    axes = tuple((name, len(mine) if name == "data" else size) for name, size in layout.axes)
    return dataclasses.replace(layout, axes=axes, device_ids=tuple(int(d.id) for d in local.reshape(-1)))


def local_view(tree: Any, local: Layout) -> Any:
    """Each global array of `tree` as an array over `local`'s mesh made of this process's shards (same spec; the
    spec must not split the `data` axis, which `local` shrinks). Zero-copy: the views share the global buffers."""
    if jax.process_count() == 1:
        return tree

    def view(array: jax.Array) -> jax.Array:
        spec = array.sharding.spec
        if any(e == "data" or (isinstance(e, tuple) and "data" in e) for e in spec):
            raise LayoutError(f"local_view: an array sharded over 'data' ({spec}) has no whole copy on each host")
        sharding = NamedSharding(local.mesh, spec)
        shards = {shard.device.id: shard.data for shard in array.addressable_shards}
        ordered = [shards[d.id] for d in sharding.addressable_devices_indices_map(array.shape)]
        return jax.make_array_from_single_device_arrays(array.shape, sharding, ordered)

    return jax.tree.map(view, tree)
