"""Shard arithmetic of a train -> gen transition: block indices, containment, bytes moved, and the device order of
the generation mesh that puts every device's training shard inside its generation shard (HybridFlow §5).

Works from `NamedSharding`s and shapes only; moves no data.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from hfjax.parallel.layout import Layout
from hfjax.parallel.transfer import block_bounds


def _size(block: list[tuple[int, int]]) -> int:
    return math.prod(max(0, hi - lo) for lo, hi in block)


def _intersection(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(max(lo1, lo2), min(hi1, hi2)) for (lo1, hi1), (lo2, hi2) in zip(a, b, strict=True)]


@dataclasses.dataclass(frozen=True)
class TransitionAccount:
    """Per-device element counts of one train -> gen transition, summed over parameters, in bytes."""

    train_bytes: dict[int, int]  # device id -> bytes of its train shards
    gen_bytes: dict[int, int]  # device id -> bytes of its gen shards
    received_bytes: dict[int, int]  # device id -> gen bytes not already held in its train shard
    uncontained_bytes: dict[int, int]  # device id -> train bytes not inside its gen shard (to_train must fetch)

    @property
    def contained(self) -> bool:
        return not any(self.uncontained_bytes.values())

    def max(self, field: str) -> int:
        return max(getattr(self, field).values())


def account(
    shapes: Sequence[Sequence[int]],
    itemsizes: Sequence[int],
    train: Sequence[NamedSharding],
    gen: Sequence[NamedSharding],
    gen_itemsizes: Sequence[int] | None = None,
) -> TransitionAccount:
    """Counts, from the shardings' index maps, what each device holds and receives when params move train -> gen
    (gen and received bytes at `gen_itemsizes` when the generation copy is cast, e.g. float32 -> bfloat16)."""
    totals = {name: {} for name in ("train", "gen", "received", "uncontained")}
    gen_itemsizes = itemsizes if gen_itemsizes is None else gen_itemsizes
    for shape, itemsize, gen_itemsize, ts, gs in zip(shapes, itemsizes, gen_itemsizes, train, gen, strict=True):
        train_map, gen_map = ts.devices_indices_map(tuple(shape)), gs.devices_indices_map(tuple(shape))
        for device, train_index in train_map.items():
            t_block = block_bounds(train_index, shape)
            g_block = block_bounds(gen_map[device], shape)
            overlap = _size(_intersection(t_block, g_block))
            for name, nbytes in (
                ("train", _size(t_block) * itemsize),
                ("gen", _size(g_block) * gen_itemsize),
                ("received", (_size(g_block) - overlap) * gen_itemsize),
                ("uncontained", (_size(t_block) - overlap) * itemsize),
            ):
                totals[name][device.id] = totals[name].get(device.id, 0) + nbytes
    return TransitionAccount(totals["train"], totals["gen"], totals["received"], totals["uncontained"])


def local_train_bounds(
    shape: Sequence[int], train: NamedSharding, gen: NamedSharding
) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """For each device: (start, limit) of its train shard within its gen shard, static indices for
    `jax.lax.slice`. Raises if a train shard is not contained in the gen shard of the same device."""
    train_map, gen_map = train.devices_indices_map(tuple(shape)), gen.devices_indices_map(tuple(shape))
    out = {}
    for device, train_index in train_map.items():
        t_block, g_block = block_bounds(train_index, shape), block_bounds(gen_map[device], shape)
        if any(tlo < glo or thi > ghi for (tlo, thi), (glo, ghi) in zip(t_block, g_block, strict=True)):
            raise ValueError(f"train shard {t_block} of device {device.id} is not inside its gen shard {g_block}")
        pairs = [(tlo - glo, thi - glo) for (tlo, thi), (glo, _) in zip(t_block, g_block, strict=True)]
        out[device.id] = (tuple(lo for lo, _ in pairs), tuple(hi for _, hi in pairs))
    return out


def _flat(coords: dict[str, int], axes: Sequence[str], sizes: dict[str, int]) -> int:
    flat = 0
    for axis in axes:
        flat = flat * sizes[axis] + coords[axis]
    return flat


def _spec_axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def containing_order(
    train: Layout, gen: Layout, train_specs: Sequence[tuple], gen_specs: Sequence[tuple]
) -> list[int] | None:
    """Device ids, row-major over the gen mesh, such that every device's train block lies inside its gen block for
    every parameter dimension; None when no order can achieve that.

    A dimension cut into `a` train blocks (flat index over its train mesh axes) and `b` gen blocks is contained iff
    `b` divides `a` and the gen block index is the train index // (a/b). Each device thus has required gen block
    indices; gen positions are matched to devices with the same requirements, in train-mesh order (so that
    micro-DP groups are consecutive and gen-TP groups sit at stride a/b: HybridFlow's grouping)."""
    return _matched_order(train, gen, train_specs, gen_specs, finer_gen=False)


def aligned_order(
    train: Layout, gen: Layout, train_specs: Sequence[tuple], gen_specs: Sequence[tuple]
) -> list[int] | None:
    """`containing_order`, also where generation cuts a dimension finer than training (`a` divides `b`): there each
    device's gen block lies inside its train block (gen index // (b/a) = train index), so it keeps the most of its
    training shard that any order can, and the rest moves in `to_gen` and back in `to_train`. None where a dimension
    is cut by counts of which neither divides the other."""
    return _matched_order(train, gen, train_specs, gen_specs, finer_gen=True)


def _matched_order(
    train: Layout, gen: Layout, train_specs: Sequence[tuple], gen_specs: Sequence[tuple], finer_gen: bool
) -> list[int] | None:
    train_sizes, gen_sizes = dict(train.axes), dict(gen.axes)
    pairs = set()  # (train axes, gen axes, train ratio, gen ratio): device key train // ratio = gen // gen ratio
    for t_spec, g_spec in zip(train_specs, gen_specs, strict=True):
        for t_entry, g_entry in zip(t_spec, g_spec, strict=True):
            a_axes, b_axes = _spec_axes(t_entry), _spec_axes(g_entry)
            a, b = math.prod(train_sizes[x] for x in a_axes), math.prod(gen_sizes[x] for x in b_axes)
            if b > 1:
                if a % b == 0:
                    pairs.add((a_axes, b_axes, a // b, 1))
                elif finer_gen and b % a == 0:
                    pairs.add((a_axes, b_axes, 1, b // a))
                else:
                    return None
    pairs_list = sorted(pairs)
    train_devices = train.mesh.devices
    need: dict[tuple, list[int]] = {}
    for index in np.ndindex(train_devices.shape):
        coords = dict(zip((n for n, _ in train.axes), index, strict=True))
        key = tuple(_flat(coords, a_axes, train_sizes) // ratio for a_axes, _, ratio, _ in pairs_list)
        need.setdefault(key, []).append(train_devices[index].id)
    positions: dict[tuple, list[int]] = {}
    gen_shape = [size for _, size in gen.axes]
    for flat_pos, index in enumerate(np.ndindex(*gen_shape)):
        coords = dict(zip((n for n, _ in gen.axes), index, strict=True))
        key = tuple(_flat(coords, b_axes, gen_sizes) // ratio for _, b_axes, _, ratio in pairs_list)
        positions.setdefault(key, []).append(flat_pos)
    if need.keys() != positions.keys() or any(len(need[k]) != len(positions[k]) for k in need):
        return None
    order = [0] * gen.size
    for key, devices in need.items():
        for pos, device in zip(positions[key], devices, strict=True):
            order[pos] = device
    return order


def candidate_orders(train: Layout) -> list[list[int]]:
    """Fallback gen device orders: the train mesh flattened with its axes in every permutation."""
    devices = np.vectorize(lambda d: d.id)(train.mesh.devices)
    seen, out = set(), []
    for perm in itertools.permutations(range(devices.ndim)):
        order = tuple(int(i) for i in np.transpose(devices, perm).reshape(-1))
        if order not in seen:
            seen.add(order)
            out.append(list(order))
    default = tuple(d.id for d in jax.devices()[: train.size])
    if default not in seen:
        out.append(list(default))
    return out
