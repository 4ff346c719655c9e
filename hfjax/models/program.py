"""The program a model is traced into: its `Layout` (set by whoever owns the jitted function), the platform of that
layout's devices, and sharding constraints on activations by logical axis.

Code that owns a program's layout enters `program_layout(layout)` inside the traced function (the training programs,
a model role's row functions, the engine's steps). Inside it:
- `program_platform()` is the platform of the layout's devices, so a program traced on a CPU machine for the
  compile-only devices of a TPU or GPU target makes the target's choices (attention kernel, dense path, cache
  blocks); outside any layout it is `jax.default_backend()`.
- `constrain(x, axes)` pins an activation to the layout's sharding of its logical axes (`Layout.activation_spec`):
  rows over the `batch` mesh axes, positions over `sequence`, heads and MLP over `tensor`, the vocabulary of logits
  over `tensor`; `embed` stays whole. With no layout, or one of one device, it is the identity.
- `constrain_weight(x, axes)` pins a weight-shaped array (a gradient summed over rows) to its parameter's sharding
  (`Layout.spec`: `embed` over `fsdp`), so that the sum over the devices' rows is one reduce-scatter (or all-reduce
  and slice, where XLA chooses).
Why constrain: left to propagation, XLA follows the weights, which under `fsdp` split along `embed`, and splits the
residual stream along `embed` too, so every device computes every row and all-reduces activations. Pinned activations
make `fsdp` data parallel over rows with weights gathered per layer (ZeRO-3), and `tensor` Megatron-style.
Jit caches a trace by the function and its static arguments, not by this context: enter it with a layout fixed for
that function or given by one of its static arguments. `bind(fn, *settings)` is `fn` with its settings fixed, equal to
any other binding of the same function to equal settings, so that the workers of two runs in one process (equal
configs, equal model structure) share one traced program instead of tracing it again.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from hfjax.parallel.layout import Layout, spec_entry

_LAYOUT: contextvars.ContextVar[Layout | None] = contextvars.ContextVar("hfjax_program_layout", default=None)


@contextlib.contextmanager
def program_layout(layout: Layout | None) -> Iterator[None]:
    """Model code traced inside this block belongs to a program over `layout` (None: no known layout)."""
    token = _LAYOUT.set(layout)
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def current_layout() -> Layout | None:
    """The layout of the program being traced, if its owner declared one."""
    return _LAYOUT.get()


def program_device() -> jax.Device:
    """A device of the traced program (its layout's first), else this process's first: what the program's
    trace-time choices read (platform, platform version, compute capability)."""
    layout = _LAYOUT.get()
    return layout.mesh.devices.flat[0] if layout is not None else jax.devices()[0]


def program_platform() -> str:
    """`cpu`, `gpu` or `tpu`: the platform of the traced program's devices (its layout's), else the default
    backend's."""
    layout = _LAYOUT.get()
    return layout.platform if layout is not None else jax.default_backend()


def program_platform_version() -> str:
    """The platform version of the program's devices' client and their device kind, one per line: names `cuda` on a
    CUDA GPU, the `NVIDIA ...` kind on a compile-only CUDA device (whose version names no CUDA)."""
    device = program_device()
    version = str(getattr(getattr(device, "client", None), "platform_version", ""))
    return f"{version}\n{getattr(device, 'device_kind', '')}"


def program_device_count() -> int:
    """Devices of the traced program's layout, else of this process."""
    layout = _LAYOUT.get()
    return layout.size if layout is not None else jax.device_count()


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """`x` constrained to the current layout's activation sharding of `logical_axes` (one name or None per
    dimension); the identity outside a layout of several devices."""
    layout = _LAYOUT.get()
    if layout is None or layout.size == 1:
        return x
    spec = layout.activation_spec(logical_axes, x.shape)
    return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, spec))


def split_axes(logical: str, size: int) -> tuple[str, ...]:
    """The mesh axes that the traced program's layout splits a dimension of `size` along activation axis `logical`
    over (`Layout.activation_spec`); none outside a layout of several devices."""
    layout = _LAYOUT.get()
    if layout is None or layout.size == 1:
        return ()
    entry = layout.activation_spec((logical,), (size,))[0] or ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def split_parts(logical: str, size: int) -> int:
    """How many parts `split_axes(logical, size)` cut that dimension into (1 outside a layout)."""
    layout = _LAYOUT.get()
    return math.prod(layout.axis_size(a) for a in split_axes(logical, size)) if layout is not None else 1


def length_parts(length: int) -> int:
    """How many parts the traced program's layout splits `length` positions of a row into (its `length` rule: the
    `sequence` mesh axis); 1 outside a layout or where the axis does not divide `length`."""
    return split_parts("length", length)


def constrain_weight(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """`x` constrained to the current layout's sharding of a parameter of `logical_axes` (`Layout.spec`); the
    identity outside a layout of several devices."""
    layout = _LAYOUT.get()
    if layout is None or layout.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, layout.sharding(logical_axes, x.shape, "weight"))


def lookup_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """`table[ids]` ([rows, ..., embed]) looked up where the table's `embed` shards live: the ids split only over the
    `batch` mesh axes that `embed` does not use (and their positions over the `length` axes), the result pinned to
    rows (and positions) over those and `embed` over the table's other axes, so that a later constraint to rows over
    every batch axis is one all-to-all (looked up with rows over every batch axis, the result is split over `fsdp`
    twice, and the partitioner replicates it). A plain lookup outside a layout of several devices or where no mesh
    axis splits `embed`."""
    layout = _LAYOUT.get()
    rules = dict(layout.rules) if layout is not None else {}
    embed_axes = tuple(a for a in rules.get("embed", ()) if layout.axis_size(a) > 1)
    row_axes = tuple(a for a in rules.get("batch", ()) if a not in embed_axes and layout.axis_size(a) > 1)
    if not embed_axes or ids.shape[0] % math.prod(layout.axis_size(a) for a in row_axes):
        return jnp.take(table, ids, axis=0)
    split = split_axes("length", ids.shape[1]) if ids.ndim > 1 else ()
    positions = (spec_entry(split),) if ids.ndim > 1 else ()
    rows = spec_entry(row_axes)
    ids = jax.lax.with_sharding_constraint(ids, NamedSharding(layout.mesh, PartitionSpec(rows, *positions)))
    out = jnp.take(table, ids, axis=0)
    embed = spec_entry(tuple(a for a in embed_axes if a not in split))
    spec = PartitionSpec(rows, *positions, *([None] * (out.ndim - 2 - len(positions))), embed)
    return jax.lax.with_sharding_constraint(out, NamedSharding(layout.mesh, spec))


def setting_key(value: Any) -> Any:
    """A hashable value that is equal for equal settings: a dataclass (a config section) by the repr of all its
    fields, anything else as itself (it must be hashable)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value), repr(dataclasses.asdict(value))
    hash(value)
    return value


@dataclasses.dataclass(frozen=True, eq=False)
class Bound:
    """`fn` with its leading arguments `settings` fixed (`bind`): hashed and compared by the function and the
    settings' values, not by identity, so it keys one jit trace for every binding of equal settings."""

    fn: Callable[..., Any]
    settings: tuple[Any, ...]
    key: tuple[Any, ...] = dataclasses.field(repr=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*self.settings, *args, **kwargs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Bound) and (self.fn, self.key) == (other.fn, other.key)

    def __hash__(self) -> int:
        return hash((self.fn, self.key))


def bind(fn: Callable[..., Any], *settings: Any) -> Bound:
    """`functools.partial(fn, *settings)` that equals every other binding of `fn` to equal settings (config
    dataclasses compare by their fields' values): a static jit argument, or a function a jitted program is built
    from, that stays one program across workers and runs in one process. `fn` must be a module-level function whose
    result depends only on the settings' values."""
    return Bound(fn, settings, tuple(setting_key(value) for value in settings))
