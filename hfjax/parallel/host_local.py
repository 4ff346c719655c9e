"""Generation one host at a time inside a group of many processes: each process's share of a global generation
layout as a layout of its own devices, and process-local views of global parameters (no copy, no communication).

A generation layout runs one loop per host when each data-parallel replica (the devices at one index of the mesh's
`data` axis) lies inside one process: each process then holds whole replicas of the parameters, and its
continuous-batching loop runs on a local mesh of `data / processes` replicas with no per-token cross-host traffic.
Such a device order exists exactly when the hosts can share the data axis (`data` a multiple of the hosts, each host
having as many devices): `check_per_host_generation` is that test, run before any worker starts (config preflight,
automap), and `host_local_order` finds such an order (the HybridEngine's, keeping its shards contained where it can;
`host_local_layout` for a rollout group of its own).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from hfjax.parallel.layout import Layout, LayoutError


def check_per_host_generation(layout: Layout, hosts: int, where: str = "rollout.gen_layout") -> None:
    """Raises unless `layout`'s data axis splits evenly over `hosts` (one loop per host needs whole replicas): the
    test that a device order keeping each replica on one host exists, for hosts of equal device counts."""
    data = layout.axis_size("data")
    if data % hosts:
        raise LayoutError(
            f"{where}: {layout.describe()} has data={data}, which {hosts} hosts cannot share; generation runs one "
            f"continuous-batching loop per host, so each host must hold whole data-parallel replicas: make "
            f"{where}.mesh.data a multiple of {hosts} (the hosts of its worker group: trainer.hosts, split over "
            "the groups of trainer.placement), so that the other axes (tensor, fsdp) fit in one host's devices "
            "(trainer.devices_per_host). A tensor-parallel group spanning hosts would need every decode step in "
            "lockstep across hosts, which hfjax does not run"
        )


def check_stationary_generation(layout: Layout, per_host: int, where: str = "rollout.lora_base_layout") -> None:
    """Raises unless each data-parallel replica of `layout` lies on one host in the training device order (hosts of
    `per_host` consecutive devices): the order a LoRA base kept in the generation layout must use
    (`stationary_layout`), checked before any device exists."""
    if any(len({p // per_host for p in replica}) > 1 for replica in replica_positions(layout)):
        raise LayoutError(_spread_message(layout.describe(), f"hosts of {per_host} consecutive devices", where))


def _spread_message(gen: str, order: str, where: str) -> str:
    return (
        f"{where}: generation layout {gen} on the training device order ({order}) spreads a data-parallel replica "
        "over several hosts, and a base kept in the generation layout cannot be reordered; keep the frozen base in "
        "the training layout (`train`), or put the generation mesh's data axis first so that each replica's devices "
        "are consecutive"
    )


def replica_positions(layout: Layout) -> np.ndarray:
    """The flat (row-major) mesh positions of each data-parallel replica of `layout`: [data, devices per replica]."""
    names = [name for name, _ in layout.axes]
    positions = np.arange(layout.size).reshape([size for _, size in layout.axes])
    return np.moveaxis(positions, names.index("data"), 0).reshape(layout.axis_size("data"), -1)


def device_hosts(layout: Layout) -> dict[int, int]:
    """The process (host) of each device of `layout`'s mesh, by device id."""
    return {int(d.id): int(d.process_index) for d in layout.mesh.devices.reshape(-1)}


def host_local_order(
    order: Sequence[int], layout: Layout, hosts: Mapping[int, int], keys: Sequence[Hashable] | None = None
) -> list[int] | None:
    """`order` (device ids by flat mesh position of `layout`) with devices moved only between positions of equal
    `keys` (default: all equal) so that each data-parallel replica lies on one host (`hosts`: device id -> host);
    a device stays at its position where it can. None when no such order exists."""
    keys = [0] * len(order) if keys is None else list(keys)
    replicas = replica_positions(layout)
    key_of = dict(zip(order, keys, strict=True))
    left = collections.defaultdict(collections.Counter)  # host -> key -> devices not yet given to a replica
    for device in order:
        left[hosts[device]][key_of[device]] += 1
    needs = [collections.Counter(keys[p] for p in replica) for replica in replicas]
    chosen: list[int] = []

    def assign(r: int) -> bool:
        """Gives replicas r.. a host each (backtracking; hosts left in the same state are tried once)."""
        if r == len(replicas):
            return True
        current = collections.Counter(hosts[order[p]] for p in replicas[r])
        tried = set()
        for host in sorted(left, key=lambda h: (-current[h], h)):  # the replica's own host first
            state = frozenset((+left[host]).items())
            if state in tried or any(left[host][k] < n for k, n in needs[r].items()):
                continue
            tried.add(state)
            left[host].subtract(needs[r])
            chosen.append(host)
            if assign(r + 1):
                return True
            chosen.pop()
            left[host].update(needs[r])
        return False

    if not assign(0):
        return None
    host_of_position = {int(p): chosen[r] for r, replica in enumerate(replicas) for p in replica}
    out: list[int | None] = [d if hosts[d] == host_of_position[p] else None for p, d in enumerate(order)]
    spare = collections.defaultdict(list)  # (host, key) -> devices that must move
    for p, d in enumerate(order):
        if out[p] is None:
            spare[hosts[d], keys[p]].append(d)
    for p in range(len(out)):
        if out[p] is None:
            out[p] = spare[host_of_position[p], keys[p]].pop(0)
    return out


def host_local_layout(
    layout: Layout, hosts: Mapping[int, int] | None = None, where: str = "rollout.gen_layout"
) -> Layout:
    """`layout` in a device order that keeps each data-parallel replica on one host (its own order when it does);
    `hosts`: device id -> host (default: the devices' processes). Raises, naming `where`, when the hosts cannot
    share its data axis."""
    hosts = device_hosts(layout) if hosts is None else hosts
    if len(set(hosts.values())) == 1:
        return layout
    check_per_host_generation(layout, len(set(hosts.values())), where)
    order = [int(d.id) for d in layout.mesh.devices.reshape(-1)]
    local = host_local_order(order, layout, hosts)
    if local is None:  # hosts with unequal device counts
        raise LayoutError(f"{where}: {layout.describe()}: no device order keeps each replica on one host")
    return layout if local == order else dataclasses.replace(layout, device_ids=tuple(local))


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


def stationary_layout(
    train: Layout, gen: Layout, hosts: Mapping[int, int] | None = None, where: str = "rollout.lora_base_layout"
) -> Layout:
    """`gen` on the device order of `train`'s mesh: the layout of parameters that stay in the generation layout and
    that the training programs read too (a jitted program takes arrays of one device order). On several hosts
    (`hosts`: device id -> host; default: the devices' processes) that order must keep each generation replica on
    one host; raises, naming `where`, when it does not."""
    order = tuple(int(d.id) for d in train.mesh.devices.reshape(-1))
    layout = dataclasses.replace(gen, device_ids=order)
    local = host_local_layout(layout, hosts, where=where)
    if local.device_ids != order:
        raise LayoutError(_spread_message(gen.describe(), f"that of {train.describe()}", where))
    return layout
