"""`Layout`: a device mesh (ordered axes with sizes, optional device order) plus logical-axis rules, as a value.

Built from config such as `{"mesh": {"fsdp": 4, "tensor": 2}, "rules": "fsdp_tp"}`; turns the `logical_axes`
metadata of model parameters into `NamedSharding`s. Meshes use `AxisType.Auto` (pjit-style propagation).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "expert", "sequence", "tensor")
LOGICAL_AXES = (
    "batch",
    "length",
    "embed",
    "heads",
    "kv_heads",
    "head_dim",
    "mlp",
    "vocab",
    "labels",
    "lora_rank",
    "expert",
    "patches",  # a vision tower's patch positions (never split: an image's patches attend to one another)
    "patch_pixels",  # the pixels of one patch (channels, rows, columns) in the patch embedding's kernel
)
_TENSOR_PARALLEL = (("heads", ("tensor",)), ("kv_heads", ("tensor",)), ("mlp", ("tensor",)), ("vocab", ("tensor",)))
# Expert parallelism: a mixture-of-experts layer's experts split over the `expert` mesh axis, which also splits rows
# (as data parallelism does) everywhere else; a model without experts uses it as one more data-parallel axis.
_EXPERT_PARALLEL = (("expert", ("expert",)),)
# Sequence (context) parallelism: the positions of a row split over the `sequence` mesh axis in the training and
# log-prob passes (attention gathers keys and values over it); under the fsdp presets the weights split over it too,
# so its devices hold no copy of one another's weights or optimizer state.
_SEQUENCE_PARALLEL = (("length", ("sequence",)),)
_FSDP_WEIGHTS = (("embed", ("fsdp", "sequence")),)
RULE_PRESETS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "fsdp": (("batch", ("data", "fsdp", "expert")), *_FSDP_WEIGHTS, *_EXPERT_PARALLEL, *_SEQUENCE_PARALLEL),
    "tp": (("batch", ("data", "expert")), *_TENSOR_PARALLEL, *_EXPERT_PARALLEL, *_SEQUENCE_PARALLEL),
    "fsdp_tp": (
        ("batch", ("data", "fsdp", "expert")),
        *_FSDP_WEIGHTS,
        *_TENSOR_PARALLEL,
        *_EXPERT_PARALLEL,
        *_SEQUENCE_PARALLEL,
    ),
    "dp_tp_gen": (("batch", ("data", "fsdp", "expert")), *_TENSOR_PARALLEL, *_EXPERT_PARALLEL),
}
LAYOUT_KEYS = ("mesh", "rules", "devices")
WEIGHT_ONLY_AXES = ("embed", "head_dim")  # logical axes that split weights but never activations
TOKENS = "tokens"  # an activation axis of rows with their positions folded in: split over the batch and length axes

Rules = tuple[tuple[str, tuple[str, ...]], ...]


def spec_entry(mesh_axes: Sequence[str]) -> tuple[str, ...] | str | None:
    """One PartitionSpec entry for a dimension split over `mesh_axes`: the tuple, the one name, or None."""
    return tuple(mesh_axes) if len(mesh_axes) > 1 else (mesh_axes[0] if mesh_axes else None)


class LayoutError(ValueError):
    """A layout config that cannot describe a valid mesh or sharding."""


def _parse_rules(rules: str | Sequence[Any], where: str) -> Rules:
    if isinstance(rules, str):
        if rules not in RULE_PRESETS:
            raise LayoutError(
                f"{where}.rules: unknown preset {rules!r}; expected one of {sorted(RULE_PRESETS)} "
                "or a list of [logical_axis, mesh_axes]"
            )
        return RULE_PRESETS[rules]
    parsed = []
    for i, rule in enumerate(rules):
        if not isinstance(rule, (list, tuple)) or len(rule) != 2 or not isinstance(rule[0], str):
            raise LayoutError(f"{where}.rules[{i}]: expected [logical_axis, mesh_axes], got {rule!r}")
        logical, mesh_axes = rule
        if mesh_axes is None:
            mesh_axes = ()
        elif isinstance(mesh_axes, str):
            mesh_axes = (mesh_axes,)
        parsed.append((logical, tuple(mesh_axes)))
    return tuple(parsed)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Ordered mesh axes with sizes, logical-axis rules and an optional device order (device ids, row-major)."""

    axes: tuple[tuple[str, int], ...]
    rules: Rules
    device_ids: tuple[int, ...] | None = None
    device_pool: tuple[Any, ...] | None = None  # the devices to build the mesh over (default: `jax.devices()`)

    def __post_init__(self) -> None:
        names = [name for name, _ in self.axes]
        for name, size in self.axes:
            if name not in MESH_AXES:
                raise LayoutError(f"layout.mesh: unknown axis {name!r}; expected names from {MESH_AXES}")
            if not isinstance(size, int) or size < 1:
                raise LayoutError(f"layout.mesh.{name}: size must be a positive integer, got {size!r}")
        if len(set(names)) != len(names):
            raise LayoutError(f"layout.mesh: axis names repeat: {names}")
        seen = set()
        for logical, mesh_axes in self.rules:
            if logical not in LOGICAL_AXES:
                raise LayoutError(f"layout.rules: unknown logical axis {logical!r}; expected one of {LOGICAL_AXES}")
            if logical in seen:
                raise LayoutError(f"layout.rules: logical axis {logical!r} has more than one rule")
            seen.add(logical)
            for axis in mesh_axes:
                if axis not in names:
                    raise LayoutError(
                        f"layout.rules: {logical!r} maps to mesh axis {axis!r}, which is not in the "
                        f"mesh axes {tuple(names)}"
                    )
        ids = self.device_ids
        if ids is not None and (len(set(ids)) != len(ids) or len(ids) != self.size):
            raise LayoutError(
                f"layout.devices: expected {self.size} distinct device ids (the mesh size), got {list(ids)}"
            )

    @classmethod
    def from_config(cls, config: Layout | Mapping[str, Any], where: str = "layout") -> Layout:
        """Builds a layout from `{"mesh": {axis: size, ...}, "rules": preset | [[logical, mesh_axes], ...],
        "devices": [ids] (optional)}`. Mesh axes not named get size 1; named ones keep their order."""
        if isinstance(config, Layout):
            return config
        if not isinstance(config, Mapping):
            raise LayoutError(f"{where}: expected a mapping with keys {LAYOUT_KEYS}, got {type(config).__name__}")
        unknown = sorted(set(config) - set(LAYOUT_KEYS))
        if unknown:
            raise LayoutError(f"{where}: unknown keys {unknown}; expected {LAYOUT_KEYS}")
        mesh = config.get("mesh")
        if not isinstance(mesh, Mapping) or not mesh:
            raise LayoutError(
                f"{where}.mesh: expected a mapping of mesh axis to size, e.g. {{'fsdp': 8}}, got {mesh!r}"
            )
        for name in mesh:
            if name not in MESH_AXES:
                raise LayoutError(f"{where}.mesh: unknown axis {name!r}; expected names from {MESH_AXES}")
        axes = tuple((name, 1) for name in MESH_AXES if name not in mesh) + tuple(
            (name, size) for name, size in mesh.items()
        )
        devices = config.get("devices")
        layout = cls(
            axes=axes,
            rules=_parse_rules(config.get("rules", "fsdp_tp"), where),
            device_ids=None if devices is None else tuple(int(d) for d in devices),
        )
        ruled = {axis for _, mesh_axes in layout.rules for axis in mesh_axes}
        for name, size in axes:
            if size > 1 and name not in ruled:
                raise LayoutError(
                    f"{where}.mesh: axis {name!r} has size {size}, but no rule of {config.get('rules', 'fsdp_tp')!r} "
                    f"maps a logical axis to it, so its {size} devices would each hold and compute the same arrays; "
                    f"use rules that name {name!r} (e.g. 'fsdp_tp', the default) or drop the axis"
                )
        return layout

    def on_devices(self, devices: Sequence[Any]) -> Layout:
        """This layout over `devices` instead of this process's `jax.devices()`: e.g. the compile-only devices of a
        TPU topology or GPU target, so that a program is traced and compiled for that target on any machine."""
        return dataclasses.replace(self, device_pool=tuple(devices))

    @property
    def size(self) -> int:
        return math.prod(size for _, size in self.axes)

    def axis_size(self, name: str) -> int:
        return dict(self.axes)[name]

    @property
    def batch_parts(self) -> int:
        """How many parts the mesh axes of the `batch` rule split rows into."""
        return math.prod(self.axis_size(a) for a in dict(self.rules).get("batch", ()))

    @functools.cached_property
    def mesh(self) -> Mesh:
        """The mesh over `device_ids` (in that order) of `device_pool` (default: all of `jax.devices()`); sizes must
        multiply to their count."""
        all_devices = list(self.device_pool) if self.device_pool is not None else jax.devices()
        if self.device_ids is None:
            devices = all_devices
        else:
            by_id = {d.id: d for d in all_devices}
            missing = [i for i in self.device_ids if i not in by_id]
            if missing:
                raise LayoutError(f"layout.devices: ids {missing} are not among this process's devices {sorted(by_id)}")
            devices = [by_id[i] for i in self.device_ids]
        if len(devices) != self.size:
            sizes = " x ".join(f"{n}={s}" for n, s in self.axes if s > 1) or "1"
            raise LayoutError(
                f"layout.mesh: sizes {sizes} multiply to {self.size}, but there are {len(devices)} "
                "devices; the product must equal the device count of the worker group"
            )
        names = tuple(name for name, _ in self.axes)
        array = np.array(devices, dtype=object).reshape([size for _, size in self.axes])
        return Mesh(array, names, axis_types=(AxisType.Auto,) * len(names))

    @property
    def platform(self) -> str:
        """The platform of the mesh's devices (`cpu`, `gpu` or `tpu`): what a program over this layout is compiled
        for, whatever machine traces it."""
        return str(self.mesh.devices.flat[0].platform)

    def activation_spec(self, logical_axes: Sequence[str | None], shape: Sequence[int]) -> PartitionSpec:
        """PartitionSpec of an activation: like `spec`, except that `embed` and `head_dim` stay whole (they shard
        weights, not activations: under `fsdp` the rows split and the weights are gathered), `tokens` splits over the
        mesh axes of `batch` then `length` (rows with their positions folded in), and a mesh axis that does not
        divide its dimension is left out (that dimension is replicated over it)."""
        rules = dict(self.rules)
        rules[TOKENS] = (*rules.get("batch", ()), *rules.get("length", ()))
        used: set[str] = set()
        entries: list[tuple[str, ...] | str | None] = []
        for size, logical in zip(shape, logical_axes, strict=True):
            mesh_axes: list[str] = []
            if logical not in WEIGHT_ONLY_AXES:
                for axis in rules.get(logical, ()):
                    parts = math.prod(self.axis_size(a) for a in mesh_axes) * self.axis_size(axis)
                    if axis not in used and self.axis_size(axis) > 1 and size % parts == 0:
                        mesh_axes.append(axis)
            used.update(mesh_axes)
            entries.append(spec_entry(mesh_axes))
        return PartitionSpec(*entries)

    def spec(
        self, logical_axes: Sequence[str | None], shape: Sequence[int] | None = None, name: str = "array"
    ) -> PartitionSpec:
        """PartitionSpec for dimensions named by logical axes. A mesh axis already used by an earlier dimension is
        not reused; size-1 mesh axes are dropped. With `shape`, checks that every dimension divides evenly."""
        rules = dict(self.rules)
        used: set[str] = set()
        entries: list[tuple[str, ...] | str | None] = []
        for dim, logical in enumerate(logical_axes):
            mesh_axes = tuple(a for a in rules.get(logical, ()) if a not in used and self.axis_size(a) > 1)
            used.update(mesh_axes)
            if shape is not None and mesh_axes:
                parts = math.prod(self.axis_size(a) for a in mesh_axes)
                if shape[dim] % parts:
                    raise LayoutError(
                        f"{name}: dimension {dim} ({logical!r}) of shape {tuple(shape)} is not "
                        f"divisible by mesh axes {mesh_axes} (size {parts})"
                    )
            entries.append(spec_entry(mesh_axes))
        return PartitionSpec(*entries)

    def sharding(
        self, logical_axes: Sequence[str | None], shape: Sequence[int] | None = None, name: str = "array"
    ) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical_axes, shape, name))

    def shardings(self, abstract_tree: Any) -> Any:
        """Maps a tree of `nnx.Variable`s (abstract or concrete) to `NamedSharding`s from their `logical_axes`
        metadata (replicated when absent). Raises one error naming every parameter whose sharded dimension does not
        divide by its mesh axes."""
        _ = self.mesh  # a device-count mismatch is one error, not one per parameter
        problems: list[str] = []

        def leaf_sharding(path: tuple[Any, ...], leaf: Any) -> NamedSharding | None:
            axes = getattr(leaf, "get_metadata", dict)().get("logical_axes")
            name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            try:
                return self.sharding(axes if axes is not None else (None,) * len(leaf.shape), leaf.shape, name)
            except LayoutError as e:
                problems.append(str(e))
                return None

        out = jax.tree_util.tree_map_with_path(leaf_sharding, abstract_tree, is_leaf=is_param_leaf)
        if problems:
            raise LayoutError(
                f"layout {self.describe()} cannot shard {len(problems)} parameters: " + "; ".join(problems)
            )
        return out

    def describe(self) -> str:
        mesh = ", ".join(f"{n}={s}" for n, s in self.axes if s > 1) or "single device"
        return f"mesh({mesh})"


def is_param_leaf(x: Any) -> bool:
    """True for an `nnx.Variable`-like leaf (has metadata and a shape)."""
    return hasattr(x, "get_metadata") and hasattr(x, "shape")


def layout_or_default(
    config: Layout | Mapping[str, Any] | None, *, generation: bool = False, where: str = "layout"
) -> Layout:
    """The configured layout, or every device of this process: fsdp for training and scoring (`fsdp` rules),
    data parallel for generation (`dp_tp_gen` rules)."""
    if config is not None:
        return Layout.from_config(config, where)
    devices = len(jax.devices())
    if generation:
        return Layout.from_config({"mesh": {"data": devices}, "rules": "dp_tp_gen"}, where)
    return Layout.from_config({"mesh": {"fsdp": devices}, "rules": "fsdp"}, where)
