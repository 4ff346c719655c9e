"""`HybridEngine`: moves the actor's parameters between its training layout and its generation layout on the same
devices (the 3D-HybridEngine of HybridFlow §5).

`zero_redundancy` mode orders the generation mesh so that each device's training shard lies inside its generation
shard. Then `to_gen` is one `jax.device_put` per parameter (an all-gather inside each micro-DP group: a device
receives M/t_g - M/(f*t) bytes for a model of M bytes, train layout fsdp f x tensor t, gen tensor t_g) after which
the training buffers are deleted, so the peak is M/t_g per device; and `to_train` cuts every training shard out of the
device's own generation shard (no cross-device traffic, enforced by a transfer guard). `naive` mode keeps the gen mesh
in its given order and the training buffers alive during generation (HybridFlow-V/DS-Chat-style redundancy), so
`to_train` is free but memory holds both copies. Imports `hfjax.parallel.layout` and `hfjax.parallel.shard_math`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from hfjax.parallel.layout import Layout, is_param_leaf
from hfjax.parallel.shard_math import (
    TransitionAccount,
    account,
    candidate_orders,
    containing_order,
    local_train_slices,
)

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
    """

    def __init__(
        self,
        train_layout: Layout | Mapping[str, Any],
        gen_layout: Layout | Mapping[str, Any],
        abstract_params: Any,
        mode: str = "zero_redundancy",
        offload_optimizer: bool = False,
    ):
        if mode not in MODES:
            raise ValueError(f"HybridEngine(mode={mode!r}): expected one of {MODES}")
        self.mode = mode
        self.train_layout = Layout.from_config(train_layout, "train_layout")
        gen = Layout.from_config(gen_layout, "gen_layout")
        if gen.size != self.train_layout.size:
            raise ValueError(
                f"gen_layout has {gen.size} devices but train_layout has {self.train_layout.size}; "
                "the HybridEngine reshards within one worker group"
            )
        leaves = jax.tree.leaves(abstract_params, is_leaf=is_param_leaf)
        self._shapes = [tuple(leaf.shape) for leaf in leaves]
        self._itemsizes = [np.dtype(leaf.dtype).itemsize for leaf in leaves]
        self._treedef = jax.tree.structure(abstract_params, is_leaf=is_param_leaf)
        self.train_shardings: list[NamedSharding] = jax.tree.leaves(self.train_layout.shardings(abstract_params))
        train_specs = [
            tuple(s.spec) + (None,) * (len(shape) - len(s.spec))
            for s, shape in zip(self.train_shardings, self._shapes, strict=True)
        ]
        self.gen_layout, self.account = (
            self._order_gen(gen, abstract_params, train_specs) if mode == "zero_redundancy" else (gen, None)
        )
        self.gen_shardings: list[NamedSharding] = jax.tree.leaves(self.gen_layout.shardings(abstract_params))
        if self.account is None:
            self.account = account(self._shapes, self._itemsizes, self.train_shardings, self.gen_shardings)
        self._local_slices = (
            [
                None if t.is_equivalent_to(g, len(shape)) else _as_bounds(local_train_slices(shape, t, g))
                for shape, t, g in zip(self._shapes, self.train_shardings, self.gen_shardings, strict=True)
            ]
            if mode == "zero_redundancy" and self.account.contained
            else None
        )
        self.offload_optimizer = offload_optimizer and _has_separate_host_memory(self.train_layout)
        if offload_optimizer and not self.offload_optimizer:
            log.warning(
                "offload_optimizer: the %s backend has no host memory separate from device memory; "
                "optimizer state stays where it is during generation",
                jax.default_backend(),
            )
        self.times = TransitionTimes()

    def _order_gen(
        self, gen: Layout, abstract_params: Any, train_specs: list[tuple]
    ) -> tuple[Layout, TransitionAccount]:
        """Gen layout with the containing device order, else the candidate order that moves the fewest bytes."""
        gen_specs = [
            tuple(gen.spec(leaf.get_metadata().get("logical_axes", (None,) * len(leaf.shape))))
            for leaf in jax.tree.leaves(abstract_params, is_leaf=is_param_leaf)
        ]
        gen_specs = [s + (None,) * (len(shape) - len(s)) for s, shape in zip(gen_specs, self._shapes, strict=True)]
        order = containing_order(self.train_layout, gen, train_specs, gen_specs)
        orders = [order] if order is not None else candidate_orders(self.train_layout)
        best = None
        for candidate in orders:
            layout = dataclasses.replace(gen, device_ids=tuple(candidate))
            acc = account(
                self._shapes, self._itemsizes, self.train_shardings, jax.tree.leaves(layout.shardings(abstract_params))
            )
            if best is None or acc.max("received_bytes") < best[1].max("received_bytes"):
                best = (layout, acc)
        if not best[1].contained:
            log.warning(
                "HybridEngine: no device order of gen layout %s contains the training shards of %s; using "
                "the order that moves the fewest bytes (%d bytes per device must come back in to_train)",
                gen.describe(),
                self.train_layout.describe(),
                best[1].max("uncontained_bytes"),
            )
        return best

    def _flatten(self, params: Any, what: str) -> list[jax.Array]:
        leaves = jax.tree.leaves(params)
        if len(leaves) != len(self._shapes):
            raise ValueError(f"{what}: expected {len(self._shapes)} parameter arrays, got {len(leaves)}")
        return leaves

    def _unflatten(self, params: Any, leaves: list[jax.Array]) -> Any:
        return jax.tree.unflatten(jax.tree.structure(params), leaves)

    def to_gen(self, train_params: Any) -> Any:
        """Parameters in the generation layout. Zero-redundancy mode deletes each training buffer once its gen
        copy exists, so at most one parameter is held twice at any moment."""
        start = time.perf_counter()
        out = []
        for leaf, target in zip(self._flatten(train_params, "to_gen"), self.gen_shardings, strict=True):
            if leaf.sharding.is_equivalent_to(target, leaf.ndim):
                out.append(leaf)
                continue
            moved = jax.device_put(leaf, target)
            if self.mode == "zero_redundancy":
                moved.block_until_ready()
                leaf.delete()
            out.append(moved)
        jax.block_until_ready(out)
        self.times.to_gen_s.append(time.perf_counter() - start)
        self._kept_train = train_params if self.mode == "naive" else None
        return self._unflatten(train_params, out)

    def to_train(self, gen_params: Any) -> Any:
        """Parameters back in the training layout. Zero-redundancy mode with containment slices each device's
        own gen shard (no cross-device copy) and frees the gen buffers; naive mode returns the kept training
        arrays (drop the gen ones)."""
        start = time.perf_counter()
        leaves = self._flatten(gen_params, "to_train")
        if self.mode == "naive":
            result = self._kept_train
            self._kept_train = None
        elif self._local_slices is None:  # no containing order exists: fetch back across devices
            result = self._unflatten(gen_params, self._device_put_back(leaves))
        else:
            result = self._unflatten(gen_params, self._slice_locally(leaves))
        self.times.to_train_s.append(time.perf_counter() - start)
        return result

    def _device_put_back(self, leaves: list[jax.Array]) -> list[jax.Array]:
        out = []
        for leaf, target in zip(leaves, self.train_shardings, strict=True):
            back = jax.device_put(leaf, target)
            if back is not leaf:
                back.block_until_ready()
                leaf.delete()
            out.append(back)
        return out

    def _slice_locally(self, leaves: list[jax.Array]) -> list[jax.Array]:
        out = []
        with jax.transfer_guard_device_to_device("disallow"):
            for leaf, shape, target, slices in zip(
                leaves, self._shapes, self.train_shardings, self._local_slices, strict=True
            ):
                if slices is None:
                    out.append(leaf)
                    continue
                pieces = [_static_slice(shard.data, *slices[shard.device.id]) for shard in leaf.addressable_shards]
                out.append(jax.make_array_from_single_device_arrays(shape, target, pieces))
                jax.block_until_ready(pieces)
                leaf.delete()  # even sharding: every train block is strictly smaller, so pieces are copies
        return out

    def stats(self) -> dict[str, Any]:
        """Per-device bytes (max over devices) of the layouts and transitions, and transition wall times."""
        acc = self.account
        kept = acc.max("train_bytes") if self.mode == "naive" else 0
        return {
            "mode": self.mode,
            "train_layout": self.train_layout.describe(),
            "gen_layout": self.gen_layout.describe(),
            "gen_device_order": list(self.gen_layout.device_ids or ()),
            "contained": acc.contained,
            "train_bytes_per_device": acc.max("train_bytes"),
            "gen_bytes_per_device": acc.max("gen_bytes"),
            "received_bytes_per_device": acc.max("received_bytes"),
            "received_bytes_total": sum(acc.received_bytes.values()),
            "peak_param_bytes_per_device": acc.max("gen_bytes") + kept,
            "redundant_bytes_per_device": kept,
            "uncontained_bytes_per_device": acc.max("uncontained_bytes"),
            "to_gen_s": list(self.times.to_gen_s),
            "to_train_s": list(self.times.to_train_s),
        }

    def offload(self, tree: Any) -> Any:
        """Moves a tree (e.g. optimizer state) to pinned host memory during generation, when enabled and the
        backend has it; otherwise returns it unchanged."""
        return _to_memory(tree, "pinned_host") if self.offload_optimizer else tree

    def reload(self, tree: Any) -> Any:
        """Brings an offloaded tree back to device memory."""
        return _to_memory(tree, "device") if self.offload_optimizer else tree


# Slice bounds are static: a compiled slice per (shape, bounds) that moves no index data to the device.
_static_slice = jax.jit(jax.lax.slice, static_argnums=(1, 2))


def _as_bounds(slices: dict[int, tuple[slice, ...]]) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Static (start, limit) index tuples for `jax.lax.slice`, which moves no index data to the device."""
    return {d: (tuple(s.start for s in sl), tuple(s.stop for s in sl)) for d, sl in slices.items()}


def _has_separate_host_memory(layout: Layout) -> bool:
    device = layout.mesh.devices.reshape(-1)[0]
    kinds = {m.kind for m in device.addressable_memories()}
    return device.platform != "cpu" and "pinned_host" in kinds


def _to_memory(tree: Any, kind: str) -> Any:
    def move(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        return jax.device_put(x, x.sharding.with_memory_kind(kind))

    return jax.tree.map(move, tree)
