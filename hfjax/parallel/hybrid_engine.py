"""`HybridEngine`: moves the actor's parameters between its training layout and its generation layout on the same
devices (the 3D-HybridEngine of HybridFlow §5).

`zero_redundancy` mode orders the generation mesh so that each device's training shard lies inside its generation
shard. Then `to_gen` is one `jax.device_put` per parameter (an all-gather inside each micro-DP group: a device
receives M/t_g - M/(f*t) bytes for a model of M bytes, train layout fsdp f x tensor t, gen tensor t_g) after which
the training buffers are deleted, so the peak is M/t_g per device; and `to_train` cuts every training shard out of the
device's own generation shard (no cross-device traffic, enforced by a transfer guard). `naive` mode keeps the gen mesh
in its given order and the training buffers alive during generation (HybridFlow-V/DS-Chat-style redundancy), so
`to_train` is free but memory holds both copies.
Over several hosts (processes), generation runs one loop per host, so both modes order the gen mesh so that each
data-parallel replica lies on one host (`hfjax.parallel.host_local`): `zero_redundancy` takes the containing order
with devices swapped among equal gen shards until it is host-local, else the host-local order that moves the fewest
bytes.
Mixed precision (`gen_dtype` below the parameters' dtype, e.g. float32 master weights and bfloat16 compute): `to_gen`
casts each training shard where it lies, then moves the cast copy (half the bytes of float32), and the master copy
stays in its training layout during generation (it cannot be cut back out of a rounded copy); `to_train` frees the
generation copy and returns the master, with no traffic.
Stationary parameters (`stationary`, e.g. a LoRA policy's frozen base) live in the generation layout for good, on the
training mesh's device order (`stationary_layout`), so that the training programs and generation both read the one
copy: they never move, and a transition moves the other parameters (the adapters) alone. That order replaces the
generation mesh's own in both modes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from hfjax.parallel.host_local import device_hosts, host_local_layout, host_local_order, stationary_layout
from hfjax.parallel.host_memory import has_separate_host_memory, keep_freed_host_memory, to_memory_kind
from hfjax.parallel.layout import Layout, is_param_leaf
from hfjax.parallel.shard_math import (
    TransitionAccount,
    account,
    aligned_order,
    candidate_orders,
    containing_order,
    local_train_bounds,
)
from hfjax.parallel.transfer import in_place, relabel, reshard

MODES = ("zero_redundancy", "naive")
log = logging.getLogger(__name__)


@dataclasses.dataclass
class TransitionTimes:
    to_gen_s: list[float] = dataclasses.field(default_factory=list)
    to_train_s: list[float] = dataclasses.field(default_factory=list)


class HybridEngine:
    """Train <-> gen parameter transitions for one parameter tree (e.g. `nnx.state(model, nnx.Param)`).

    `abstract_params` carries shapes, dtypes and `logical_axes` metadata (an abstract or concrete tree).
    `to_gen` consumes its input in `zero_redundancy` mode (the buffers are deleted); keep using what it returns.
    `gen_dtype` (default: each parameter's own dtype) is the dtype of the generation copy; a cast keeps the input
    (in pinned host memory during generation, chunk by chunk, when `offload_optimizer` is on and the backend has it).
    `stationary` (one flag per parameter, in tree order) marks frozen parameters that stay in the generation layout
    for good: the caller places them with `gen_layout`'s shardings (the generation layout on the training device
    order, `stationary_layout`), the training programs read them there, and no transition moves or casts them.
    `kv_cache_bytes_per_device` is set by the owner of the generation engine, for `stats()`.
    On CPU devices, `keep_host_memory` sets the process's malloc to keep freed memory (`keep_freed_host_memory`), so
    that transitions reuse it; pass False to leave the allocator as it is.
    """

    def __init__(
        self,
        train_layout: Layout | Mapping[str, Any],
        gen_layout: Layout | Mapping[str, Any],
        abstract_params: Any,
        mode: str = "zero_redundancy",
        offload_optimizer: bool = False,
        chunk_bytes: int = 64 * 2**20,
        keep_host_memory: bool = True,
        gen_dtype: Any = None,
        stationary: Sequence[bool] | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"HybridEngine(mode={mode!r}): expected one of {MODES}")
        self.mode = mode
        self.chunk_bytes = chunk_bytes
        self.train_layout = Layout.from_config(train_layout, "train_layout")
        gen = Layout.from_config(gen_layout, "gen_layout")
        if gen.size != self.train_layout.size:
            raise ValueError(
                f"gen_layout has {gen.size} devices but train_layout has {self.train_layout.size}; "
                "the HybridEngine reshards within one worker group"
            )
        leaves = jax.tree.leaves(abstract_params, is_leaf=is_param_leaf)
        self.shapes = [tuple(leaf.shape) for leaf in leaves]
        self.dtypes = [np.dtype(leaf.dtype) for leaf in leaves]
        self.stationary = [False] * len(leaves) if stationary is None else [bool(s) for s in stationary]
        if len(self.stationary) != len(leaves):
            raise ValueError(f"stationary: expected one flag per parameter ({len(leaves)}), got {len(self.stationary)}")
        self.gen_dtypes = [
            d if gen_dtype is None or still else np.dtype(gen_dtype)
            for d, still in zip(self.dtypes, self.stationary, strict=True)
        ]
        self.casts = self.gen_dtypes != self.dtypes
        self.keeps_train = mode == "naive" or self.casts
        self.itemsizes = [d.itemsize for d in self.dtypes]
        self.gen_itemsizes = [d.itemsize for d in self.gen_dtypes]
        self.kv_cache_bytes_per_device = 0
        self.train_shardings: list[NamedSharding] = jax.tree.leaves(self.train_layout.shardings(abstract_params))
        train_specs = [
            tuple(s.spec) + (None,) * (len(shape) - len(s.spec))
            for s, shape in zip(self.train_shardings, self.shapes, strict=True)
        ]
        hosts = device_hosts(self.train_layout)
        self.hosts = hosts if len(set(hosts.values())) > 1 else None  # device id -> host, on several hosts
        if any(self.stationary):  # the stationary ones fix the device order: they are read by both programs
            self.gen_layout, self.account = stationary_layout(self.train_layout, gen, hosts), None
        elif mode == "zero_redundancy":
            self.gen_layout, self.account = self._order_gen(gen, abstract_params, train_specs)
        else:
            self.gen_layout, self.account = self._host_local(gen, [d.id for d in gen.mesh.devices.reshape(-1)]), None
        self.gen_shardings: list[NamedSharding] = jax.tree.leaves(self.gen_layout.shardings(abstract_params))
        self.train_shardings = [
            g if still else t
            for t, g, still in zip(self.train_shardings, self.gen_shardings, self.stationary, strict=True)
        ]
        if self.account is None:
            self.account = self._account(self.gen_shardings)
        still = [i for i, flag in enumerate(self.stationary) if flag]
        kept_in_gen = [self.gen_shardings[i] for i in still]  # where they are in both layouts
        shapes, itemsizes = [self.shapes[i] for i in still], [self.itemsizes[i] for i in still]
        self._stationary_bytes = account(shapes, itemsizes, kept_in_gen, kept_in_gen).gen_bytes
        self._local_slices = (
            [
                None if t.is_equivalent_to(g, len(shape)) else local_train_bounds(shape, t, g)
                for shape, t, g in zip(self.shapes, self.train_shardings, self.gen_shardings, strict=True)
            ]
            if not self.keeps_train and self.account.contained
            else None
        )
        self.offload_optimizer = offload_optimizer and has_separate_host_memory(self.train_layout)
        if offload_optimizer and not self.offload_optimizer:
            log.warning(
                "offload_optimizer: the %s backend has no host memory separate from device memory; "
                "optimizer state stays where it is during generation",
                jax.default_backend(),
            )
        self.offloads_master = self.offload_optimizer and self.casts
        platform = self.train_layout.mesh.devices.reshape(-1)[0].platform
        self.keeps_host_memory = keep_host_memory and platform == "cpu" and keep_freed_host_memory()
        self.times = TransitionTimes()
        self._kept_train: Any = None
        self._owned_gen: set[int] = set()

    def _order_gen(
        self, gen: Layout, abstract_params: Any, train_specs: list[tuple]
    ) -> tuple[Layout, TransitionAccount]:
        """Gen layout with the containing device order (host-local on several hosts), else whichever of the order
        that keeps the most in place (`aligned_order`) and the candidate orders moves the fewest bytes."""
        gen_specs = [
            tuple(gen.spec(leaf.get_metadata().get("logical_axes", (None,) * len(leaf.shape))))
            for leaf in jax.tree.leaves(abstract_params, is_leaf=is_param_leaf)
        ]
        gen_specs = [s + (None,) * (len(shape) - len(s)) for s, shape in zip(gen_specs, self.shapes, strict=True)]
        order = containing_order(self.train_layout, gen, train_specs, gen_specs)
        if order is not None and self.hosts is not None:
            order = host_local_order(order, gen, self.hosts, keys=_gen_block_keys(gen, gen_specs))
        if order is None:  # the order that keeps the most in place, beside the mesh's own orders
            aligned = aligned_order(self.train_layout, gen, train_specs, gen_specs)
            orders = ([aligned] if aligned is not None else []) + candidate_orders(self.train_layout)
        else:
            orders = [order]
        if self.hosts is not None:
            orders = list(dict.fromkeys(tuple(self._host_local(gen, o).device_ids) for o in orders))
        best = None
        for candidate in orders:
            layout = dataclasses.replace(gen, device_ids=tuple(candidate))
            acc = self._account(jax.tree.leaves(layout.shardings(abstract_params)))
            if best is None or acc.max("received_bytes") < best[1].max("received_bytes"):
                best = (layout, acc)
        if not best[1].contained:
            log.warning(
                "HybridEngine: no device order of gen layout %s%s contains the training shards of %s; using "
                "the order that moves the fewest bytes (%d bytes per device must come back in to_train)",
                gen.describe(),
                "" if self.hosts is None else " that keeps each data-parallel replica on one host",
                self.train_layout.describe(),
                best[1].max("uncontained_bytes"),
            )
        return best

    def _host_local(self, gen: Layout, order: list[int]) -> Layout:
        """`gen` in `order`, made host-local on several hosts (one generation loop per host)."""
        if self.hosts is None:
            return gen
        return host_local_layout(dataclasses.replace(gen, device_ids=tuple(order)), self.hosts)

    def _account(self, gen_shardings: list[NamedSharding], cast: bool = True) -> TransitionAccount:
        gen_itemsizes = self.gen_itemsizes if cast else self.itemsizes
        return account(self.shapes, self.itemsizes, self.train_shardings, gen_shardings, gen_itemsizes)

    def _flatten(self, params: Any, what: str) -> list[jax.Array]:
        leaves = jax.tree.leaves(params)
        if len(leaves) != len(self.shapes):
            raise ValueError(f"{what}: expected {len(self.shapes)} parameter arrays, got {len(leaves)}")
        return leaves

    def _unflatten(self, params: Any, leaves: list[jax.Array]) -> Any:
        return jax.tree.unflatten(jax.tree.structure(params), leaves)

    def _chunks(self, moving: list[int]) -> list[list[int]]:
        """Consecutive groups of leaf indices whose train shards per device add up to about `chunk_bytes`."""
        chunks: list[list[int]] = [[]]
        used = 0
        for i in moving:
            nbytes = math.prod(self.shapes[i]) * self.itemsizes[i] // block_count(self.train_shardings[i])
            if chunks[-1] and used + nbytes > self.chunk_bytes:
                chunks.append([])
                used = 0
            chunks[-1].append(i)
            used += nbytes
        return [c for c in chunks if c]

    def to_gen(self, train_params: Any) -> Any:
        """Parameters in the generation layout (and `gen_dtype`), moved a chunk of parameters at a time.
        Zero-redundancy mode without a cast deletes a chunk's training buffers once its gen copies exist, so only
        one chunk (`chunk_bytes` per device) is ever held twice; naive mode and a cast keep the training arrays. A
        parameter already laid out (and typed) for generation is not copied: its gen array shares its buffers."""
        start = time.perf_counter()
        train = self._flatten(train_params, "to_gen")
        moving = [
            i
            for i, leaf in enumerate(train)
            if self.gen_dtypes[i] != leaf.dtype or leaf.sharding != self.gen_shardings[i]
        ]
        if (i := next((i for i in moving if self.stationary[i]), None)) is not None:
            raise ValueError(
                f"HybridEngine.to_gen: stationary parameter {i} {self.shapes[i]} is laid out as {train[i].sharding}; "
                f"it must stay in the generation layout ({self.gen_shardings[i]})"
            )
        out, kept = list(train), list(train)
        self._owned_gen = set()  # the gen arrays that own their buffers (copies), which to_train may free
        for chunk in self._chunks(moving):
            targets = [self.gen_shardings[i] for i in chunk]
            sources = [out[i] for i in chunk]
            if self.casts:
                sources = _cast(tuple(sources), tuple(self.gen_dtypes[i].name for i in chunk))
            moved = reshard(sources, targets)
            for i, source, target in zip(chunk, sources, targets, strict=True):
                copied = source is not train[i]  # a cast copy
                if not in_place(source, target):  # moved: `moved[i]` is a new copy
                    if copied or not self.keeps_train:  # a cast copy, or zero redundancy
                        source.delete()
                    copied = True
                if copied:
                    self._owned_gen.add(i)
            if self.offloads_master:  # chunk by chunk, so the device never holds the whole master beside the copy
                hosting = [i for i in chunk if i in self._owned_gen]  # a master that generation reads stays
                for i, hosted in zip(hosting, to_memory_kind([train[i] for i in hosting], "pinned_host"), strict=True):
                    kept[i] = hosted
            for i, array in zip(chunk, moved, strict=True):
                out[i] = array
        jax.block_until_ready(out)
        self.times.to_gen_s.append(time.perf_counter() - start)
        if self.keeps_train:
            self._kept_train = self._unflatten(train_params, kept) if self.offloads_master else train_params
        return self._unflatten(train_params, out)

    def to_train(self, gen_params: Any) -> Any:
        """Parameters back in the training layout. Zero-redundancy mode with containment cuts each device's train
        shard out of its own gen shard (one compiled multi-slice per device and chunk; a transfer guard forbids any
        cross-device copy) and frees the gen buffers; without containment it device_puts back. Naive mode returns
        the training arrays it kept (the gen ones are dropped), and so does a cast (the gen copies are freed)."""
        start = time.perf_counter()
        leaves = self._flatten(gen_params, "to_train")
        if self.keeps_train:
            if self._kept_train is None:
                raise RuntimeError("HybridEngine.to_train: no training parameters kept; call to_gen first")
            result = self._kept_train
            self._kept_train = None
            if self.offloads_master:
                result = to_memory_kind(result, "device")
            if self.casts:  # the generation copies are ours alone: free them now
                for i in self._owned_gen:
                    leaves[i].delete()
        else:
            out = [relabel(leaf, target) for leaf, target in zip(leaves, self.train_shardings, strict=True)]
            moving = [i for i, leaf in enumerate(leaves) if not in_place(leaf, self.train_shardings[i])]
            for chunk in self._chunks(moving):
                sources = [out[i] for i in chunk]
                if self._local_slices is None:  # no containing order exists: fetch back across devices
                    back = reshard(sources, [self.train_shardings[i] for i in chunk])
                else:
                    back = self._slice_locally(chunk, sources)
                jax.block_until_ready(back)
                for source in sources:
                    source.delete()  # even sharding: train blocks are strictly smaller copies, never aliases
                for i, array in zip(chunk, back, strict=True):
                    out[i] = array
            result = self._unflatten(gen_params, out)
        self._owned_gen = set()
        self.times.to_train_s.append(time.perf_counter() - start)
        return result

    def _slice_locally(self, chunk: list[int], sources: list[jax.Array]) -> list[jax.Array]:
        per_device: dict[int, list[jax.Array]] = {}
        devices: dict[int, jax.Device] = {}
        for source in sources:
            for shard in source.addressable_shards:
                per_device.setdefault(shard.device.id, []).append(shard.data)
                devices[shard.device.id] = shard.device
        pieces: dict[int, list[jax.Array]] = {}
        with jax.transfer_guard_device_to_device("disallow"):
            for device_id, arrays in per_device.items():
                bounds = tuple(self._local_slices[i][device_id] for i in chunk)
                pieces[device_id] = _multi_slice(tuple(arrays), bounds)
        return [
            jax.make_array_from_single_device_arrays(
                self.shapes[i], self.train_shardings[i], [pieces[d][k] for d in per_device]
            )
            for k, i in enumerate(chunk)
        ]

    def stats(self) -> dict[str, Any]:
        """Per-device bytes (max over devices) of the layouts and transitions, and transition wall times."""
        acc = self.account
        stationary = self._stationary_bytes
        # the training copies kept through generation: of the parameters that move (stationary ones are the gen copy)
        kept = max(acc.train_bytes[d] - stationary.get(d, 0) for d in acc.train_bytes) if self.keeps_train else 0
        redundant = kept if self.mode == "naive" and not self.casts else 0
        on_device = 0 if self.offloads_master else kept  # during generation
        return {
            "mode": self.mode,
            "param_dtype": "/".join(sorted({d.name for d in self.dtypes})),
            "gen_dtype": "/".join(sorted({d.name for d in self.gen_dtypes})),
            "train_layout": self.train_layout.describe(),
            "gen_layout": self.gen_layout.describe(),
            "gen_device_order": list(self.gen_layout.device_ids or ()),
            "contained": acc.contained,
            "keeps_host_memory": self.keeps_host_memory,
            "train_bytes_per_device": acc.max("train_bytes"),
            "gen_bytes_per_device": acc.max("gen_bytes"),
            "gen_bytes_total": sum(acc.gen_bytes.values()),
            "received_bytes_per_device": acc.max("received_bytes"),
            "received_bytes_total": sum(acc.received_bytes.values()),
            "uncast_received_bytes_per_device": self._account(self.gen_shardings, cast=False).max("received_bytes"),
            "master_bytes_per_device": kept if self.casts else 0,
            "master_offloaded": self.offloads_master,
            "kv_cache_bytes_per_device": self.kv_cache_bytes_per_device,
            "peak_param_bytes_per_device": acc.max("gen_bytes") + on_device,
            "peak_gen_bytes_per_device": acc.max("gen_bytes") + on_device + self.kv_cache_bytes_per_device,
            "redundant_bytes_per_device": redundant,
            "uncontained_bytes_per_device": acc.max("uncontained_bytes"),
            "stationary_bytes_per_device": max(stationary.values(), default=0),
            "to_gen_s": list(self.times.to_gen_s),
            "to_train_s": list(self.times.to_train_s),
        }

    def offload(self, tree: Any) -> Any:
        """Moves a tree (e.g. optimizer state) to pinned host memory during generation, when enabled and the
        backend has it, and frees its device buffers (keep using what it returns); otherwise returns it unchanged."""
        return to_memory_kind(tree, "pinned_host") if self.offload_optimizer else tree

    def reload(self, tree: Any) -> Any:
        """Brings an offloaded tree back to device memory and frees the host copies."""
        return to_memory_kind(tree, "device") if self.offload_optimizer else tree


@functools.partial(jax.jit, static_argnums=1)
def _cast(arrays: tuple[jax.Array, ...], dtypes: tuple[str, ...]) -> list[jax.Array]:
    """Each array in its dtype, where it lies (elementwise: the output keeps the input's sharding)."""
    return [x.astype(d) for x, d in zip(arrays, dtypes, strict=True)]


@functools.partial(jax.jit, static_argnums=1)
def _multi_slice(arrays: tuple[jax.Array, ...], bounds: tuple) -> list[jax.Array]:
    """Static slices of arrays on one device: one compiled program, no index data sent to the device."""
    return [jax.lax.slice(x, start, limit) for x, (start, limit) in zip(arrays, bounds, strict=True)]


def block_count(sharding: NamedSharding) -> int:
    """Number of distinct blocks a sharding cuts an array into."""
    axes = [a for e in sharding.spec if e for a in ((e,) if isinstance(e, str) else e)]
    return math.prod(sharding.mesh.shape[a] for a in axes)


def _gen_block_keys(gen: Layout, gen_specs: list[tuple]) -> list[tuple[int, ...]]:
    """Per flat gen mesh position, its coordinates on the mesh axes that shard some parameter: positions with equal
    keys hold the same gen shard of every parameter, so devices may swap between them and stay contained."""
    sharding = {
        a for spec in gen_specs for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)
    }
    shape = [size for _, size in gen.axes]
    coords = np.unravel_index(np.arange(gen.size), shape)
    kept = [c for c, (name, _) in zip(coords, gen.axes, strict=True) if name in sharding]
    return [tuple(int(c[p]) for c in kept) for p in range(gen.size)]
