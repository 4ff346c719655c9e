"""`TrainState`: a model's parameters and optimizer state sharded by a `Layout`, and the jitted programs that train
it with gradient accumulation over micro-batches.

One optimizer step (`update`) runs a jitted loss-and-gradient program per micro-batch, sums the gradients with a
jitted add (the accumulator is donated), then one jitted apply: global-norm clipping, and the optax update, or no
update at all when the norm is not finite (the step is counted in `skipped_steps`).

Compilation: the programs are module-level and keyed by the model's graph, the loss function, the shardings, the
layout (the gradient and eval programs trace attention under it, `program_layout`: Pallas kernels run per shard), the
optimizer and the input shapes, so they compile once per distinct micro-batch shape and are shared by every
`TrainState` with the same keys (callers pad micro-batches to fixed shapes). `compile_counts()` reports them.
Precision: parameters are the master copy in their stored dtype (float32 by default; the model computes in its own
`dtype`), gradients arrive in that dtype, and the optimizer state is float32 whatever the parameters are.
Memory: parameters and optimizer state are donated to the apply program (one copy, not two), so arrays taken from
`params` or from the model passed in are invalid after an `update` (read `params` again), unless `donate=False`.
Frozen parameters: with `trainable` (an nnx filter: a parameter type such as `LoraParam`, paths, ...) only the
parameters it selects get gradients and optimizer state; the others stay as they are (a LoRA role's base), sharded by
`frozen_layout` (default: the layout), e.g. a base kept in the generation layout.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hfjax.models.program import program_layout
from hfjax.optim.optimizer import current_learning_rate
from hfjax.parallel import Layout, LayoutError
from hfjax.protocol import ROW_IN_LOSS
from hfjax.xla_settings import FORWARD_COMPILER_OPTIONS, GRADIENT_COMPILER_OPTIONS

LossFn = Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


def combine_metric(key: str, values: Sequence[float]) -> float:
    """One value of metric `key` from its values over micro-batches (or optimizer steps): the largest for a name
    ending in `_max`, the smallest for `_min` (a part without data reports the identity, -inf or +inf), the mean
    otherwise."""
    if key.endswith("_max"):
        return float(np.max(values))
    if key.endswith("_min"):
        return float(np.min(values))
    return float(np.mean(values))


def batch_sharding(layout: Layout, shape: Sequence[int]) -> NamedSharding:
    """Rows (dimension 0) split over the layout's `batch` mesh axes; replicated when they do not divide evenly."""
    if not shape:
        return layout.sharding(())
    try:
        return layout.sharding(("batch",) + (None,) * (len(shape) - 1), shape)
    except LayoutError:
        return layout.sharding((None,) * len(shape))


def place_batch(layout: Layout, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """Host arrays put on the layout's devices with `batch_sharding`. In a group of several processes each process
    passes its own rows: the global arrays have `processes` times as many rows, split over the batch mesh axes
    (which must divide them: a replicated batch would need every process's rows everywhere)."""
    processes = jax.process_count()
    if processes == 1:
        return {k: jax.device_put(np.asarray(v), batch_sharding(layout, np.shape(v))) for k, v in batch.items()}
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        if value.ndim == 0:  # the same scalar in every process
            out[key] = jax.make_array_from_process_local_data(layout.sharding(()), value)
            continue
        shape = (value.shape[0] * processes, *value.shape[1:])
        sharding = batch_sharding(layout, shape)
        if not sharding.spec or sharding.spec[0] is None:
            parts = layout.batch_parts
            raise LayoutError(
                f"place_batch: a micro-batch of {shape[0]} rows ({value.shape[0]} per process) cannot be split over "
                f"the batch mesh axes of {layout.describe()} ({parts} parts); with several hosts make micro-batch "
                f"sizes a multiple of {parts}"
            )
        out[key] = jax.make_array_from_process_local_data(sharding, value, shape)
    return out


@dataclasses.dataclass(frozen=True)
class _Frozen:
    """A pytree of hashable leaves (shardings) as a static, hashable jit argument."""

    treedef: Any
    leaves: tuple[Any, ...]

    @classmethod
    def of(cls, tree: Any) -> _Frozen:
        leaves, treedef = jax.tree.flatten(tree)
        return cls(treedef, tuple(leaves))

    def tree(self) -> Any:
        return jax.tree.unflatten(self.treedef, self.leaves)


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "loss_fn", "static", "shardings", "layout"),
    compiler_options=GRADIENT_COMPILER_OPTIONS,
)
def _loss_and_grad(
    params: Any,
    rest: Any,
    batch: dict[str, jax.Array],
    *,
    graphdef: Any,
    loss_fn: LossFn,
    static: Any,
    shardings: Any,
    layout: Layout | None,
) -> tuple[jax.Array, dict[str, jax.Array], Any]:
    def loss(p: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        return loss_fn(nnx.merge(graphdef, p, rest), batch, **dict(static))

    with program_layout(layout):
        (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return value, aux, jax.lax.with_sharding_constraint(grads, shardings.tree())


@functools.partial(jax.jit, donate_argnums=0)
def _accumulate(total: Any, grads: Any) -> Any:
    return jax.tree.map(jnp.add, total, grads)


def _apply_gradients(
    params: Any, opt_state: Any, grads: Any, *, optimizer: Any, grad_clip: float, shardings: Any
) -> tuple[Any, Any, jax.Array, jax.Array]:
    norm = optax.tree.norm(grads)
    scale = jnp.float32(1.0) if grad_clip == 0 else grad_clip / jnp.maximum(norm, grad_clip)

    # A non-finite step keeps the old values, chosen element by element: the select fuses into the update, which then
    # writes its donated buffers in place (a `lax.cond` returns new buffers: three float32 copies of the parameters,
    # the step's largest temporaries).
    finite = jnp.isfinite(norm)
    updates, state = optimizer.update(jax.tree.map(lambda x: x * scale.astype(x.dtype), grads), opt_state, params)
    new = jax.tree.map(
        lambda updated, old: jnp.where(finite, updated, old),
        (optax.apply_updates(params, updates), state),
        (params, opt_state),
    )
    new_params, new_state = jax.lax.with_sharding_constraint(new, shardings.tree())
    lr = current_learning_rate(new_state)
    return new_params, new_state, norm, jnp.float32(jnp.nan) if lr is None else lr


_APPLY_STATIC = ("optimizer", "grad_clip", "shardings")
_apply_donating = jax.jit(_apply_gradients, static_argnames=_APPLY_STATIC, donate_argnums=(0, 1))
_apply_keeping = jax.jit(_apply_gradients, static_argnames=_APPLY_STATIC)


@functools.partial(jax.jit, static_argnames=("graphdef", "fn", "layout"), compiler_options=FORWARD_COMPILER_OPTIONS)
def _forward(
    params: Any, rest: Any, batch: dict[str, jax.Array], *, graphdef: Any, fn: Callable[..., Any], layout: Layout
) -> Any:
    with program_layout(layout):
        return fn(nnx.merge(graphdef, params, rest), batch)


def split_trained(params: Any, rest: Any, trainable: nnx.filterlib.Filter) -> tuple[Any, Any]:
    """(the parameters that `trainable` selects (a type such as `LoraParam`, or any nnx filter), the rest of a
    model's state: its other parameters and `rest`), the arguments of the loss-and-gradient program
    (`grad_program`)."""
    if trainable is nnx.Param:
        return params, rest
    trained, frozen = nnx.split_state(params, trainable, ...)
    return trained, nnx.merge_state(frozen, rest)


def place_params(
    params: Any, layout: Layout, trainable: nnx.filterlib.Filter = nnx.Param, frozen_layout: Layout | None = None
) -> Any:
    """`params` sharded by `layout`, those that `trainable` does not select by `frozen_layout` (default: `layout`)."""
    if frozen_layout is None or trainable is nnx.Param:
        return jax.device_put(params, layout.shardings(params))
    trained, frozen_params = nnx.split_state(params, trainable, ...)
    return nnx.merge_state(
        jax.device_put(trained, layout.shardings(trained)),
        jax.device_put(frozen_params, frozen_layout.shardings(frozen_params)),
    )


def frozen_flags(params: Any, trainable: nnx.filterlib.Filter) -> list[bool]:
    """One flag per array of `params`, in tree order: True where `trainable` does not select it (it stays frozen)."""
    if trainable is nnx.Param:
        return [False] * len(jax.tree.leaves(params))
    trained, frozen_params = nnx.split_state(params, trainable, ...)
    flags = nnx.merge_state(jax.tree.map(lambda _: False, trained), jax.tree.map(lambda _: True, frozen_params))
    return [bool(flag) for flag in jax.tree.leaves(flags)]


def compile_counts() -> dict[str, int]:
    """Programs compiled so far in this process, over all `TrainState`s: `grad` (per model, loss function and
    micro-batch shape), `accumulate`, `apply` (per optimizer) and `eval` (per function and batch shape)."""
    return {
        "grad": _loss_and_grad._cache_size(),
        "accumulate": _accumulate._cache_size(),
        "apply": _apply_donating._cache_size() + _apply_keeping._cache_size(),
        "eval": _forward._cache_size(),
    }


def _init_float32(optimizer: optax.GradientTransformation, params: Any) -> Any:
    """Optimizer state in float32 whatever the parameters are stored in (moments of bf16 weights would lose the
    small gradients that a float32 master copy keeps)."""
    return optimizer.init(jax.tree.map(lambda p: p.astype(jnp.promote_types(p.dtype, jnp.float32)), params))


def _abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def optimizer_shardings(optimizer: optax.GradientTransformation, params: Any, layout: Layout) -> Any:
    """Shardings of the float32 optimizer state of `params` (concrete arrays or `ShapeDtypeStruct`s with shardings):
    each parameter's moments as the parameter, scalars (step counts, the injected rate) replicated."""
    replicated = NamedSharding(layout.mesh, PartitionSpec())
    return optax.tree_utils.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        jax.eval_shape(functools.partial(_init_float32, optimizer), params),
        jax.tree.map(lambda x: x.sharding, params),
        transform_non_params=lambda _: replicated,
    )


def abstract_optimizer_state(optimizer: optax.GradientTransformation, params: Any, layout: Layout) -> Any:
    """The optimizer state of `params` as `ShapeDtypeStruct`s with their shardings, allocating nothing (to lower and
    compile the programs of a state that is not built, e.g. for another machine)."""
    shapes = jax.eval_shape(functools.partial(_init_float32, optimizer), params)
    return _abstract(shapes, optimizer_shardings(optimizer, params, layout))


def apply_program(donate: bool = True) -> Any:
    """The jitted optimizer step `(params, opt_state, grads, *, optimizer, grad_clip, shardings)`: what
    `TrainState.update` applies after accumulating the micro-batches' gradients."""
    return _apply_donating if donate else _apply_keeping


def grad_program() -> Any:
    """The jitted loss-and-gradient program of one micro-batch `(params, rest, batch, *, graphdef, loss_fn, static,
    shardings, layout)`."""
    return _loss_and_grad


def frozen(tree: Any) -> Any:
    """A pytree of shardings as the hashable static argument the programs above take."""
    return _Frozen.of(tree)


class TrainState:
    """Parameters (`params`, an `nnx.State` of every `nnx.Param`, frozen ones included), optimizer state
    (`opt_state` of the trained ones, sharded like them; scalars replicated), `step` (optimizer steps taken, skipped
    ones included) and `skipped_steps`.

    `params` may be replaced (e.g. by the HybridEngine) with arrays of the same shapes and shardings.
    """

    def __init__(
        self,
        model: nnx.Module,
        layout: Layout,
        optimizer: optax.GradientTransformation,
        grad_clip: float,
        *,
        donate: bool = True,
        trainable: nnx.filterlib.Filter = nnx.Param,
        frozen_layout: Layout | None = None,
    ):
        if grad_clip < 0:
            raise ValueError(f"grad_clip: expected >= 0 (0 disables clipping), got {grad_clip!r}")
        self.layout, self.optimizer, self.grad_clip = layout, optimizer, float(grad_clip)
        self.trainable = trainable
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self.params = place_params(params, layout, trainable, frozen_layout)
        trained, _ = self._trained_and_rest()
        if not jax.tree.leaves(trained):
            name = getattr(trainable, "__name__", trainable)
            raise ValueError(f"TrainState: no parameter of the model is trainable (trainable={name})")
        self._trained_shardings = jax.tree.map(lambda x: x.sharding, trained)
        self.opt_shardings = optimizer_shardings(optimizer, trained, layout)
        init = functools.partial(_init_float32, optimizer)
        self.opt_state = jax.jit(init, out_shardings=self.opt_shardings)(trained)
        self.step = 0
        self.skipped_steps = 0
        self._grad_shardings = _Frozen.of(self._trained_shardings)
        self._state_shardings = _Frozen.of((self._trained_shardings, self.opt_shardings))
        self._apply = _apply_donating if donate else _apply_keeping

    def _trained_and_rest(self) -> tuple[Any, Any]:
        """(the trained parameters, everything else the model holds: frozen parameters and non-parameter state)."""
        return split_trained(self.params, self.rest, self.trainable)

    def model(self) -> nnx.Module:
        """The module with the current parameters (e.g. for `save_hf`)."""
        return nnx.merge(self.graphdef, self.params, self.rest)

    def update(self, loss_fn: LossFn, micro_batches: list[dict[str, np.ndarray]], **static: Any) -> dict[str, float]:
        """One optimizer step over `micro_batches` (host arrays, rows first).

        `loss_fn(model, batch, **static) -> (loss, aux)`: each micro-batch's loss must already be normalised by the
        whole step's counts (tokens, sequences), so the summed gradients are the step's gradient. `loss_fn` and the
        `static` values must be hashable and stable (a module-level function, or `hfjax.models.program.bind` of one
        to its settings, which equals every binding of equal settings; not a new lambda per call): they key the
        compiled program, shared by every `TrainState` of the same model structure and layout in this process, and
        JAX's compile cache keeps them alive, so a bound method of an object holding arrays would keep those arrays
        alive too. Returns
        `loss` (sum over micro-batches), `grad_norm` (before clipping), `lr` (of this update), `skipped` (1 when the
        norm was not finite) and each aux metric combined over micro-batches by `combine_metric` (the mean; the max
        or min of `..._max` / `..._min` metrics).
        """
        if not micro_batches:
            raise ValueError("TrainState.update: expected at least one micro-batch, got none")
        keys = {
            "graphdef": self.graphdef,
            "loss_fn": loss_fn,
            "static": tuple(sorted(static.items())),
            "layout": self.layout,
        }
        losses, auxes, total = [], [], None
        trained, rest = self._trained_and_rest()
        for micro in micro_batches:
            batch = place_batch(self.layout, micro)
            loss, aux, grads = _loss_and_grad(trained, rest, batch, **keys, shardings=self._grad_shardings)
            total = grads if total is None else _accumulate(total, grads)
            losses.append(loss)
            auxes.append(aux)
        trained, self.opt_state, norm, lr = self._apply(
            trained,
            self.opt_state,
            total,
            optimizer=self.optimizer,
            grad_clip=self.grad_clip,
            shardings=self._state_shardings,
        )
        self.params = trained if self.trainable is nnx.Param else nnx.merge_state(self.params, trained)
        losses, auxes, norm, lr = jax.device_get((losses, auxes, norm, lr))
        skipped = int(not np.isfinite(norm))
        self.step += 1
        self.skipped_steps += skipped
        metrics = {"loss": float(np.sum(losses)), "grad_norm": float(norm), "lr": float(lr), "skipped": skipped}
        for key in auxes[0]:
            metrics[key] = combine_metric(key, [a[key] for a in auxes])
        return metrics

    def eval(
        self, fn: Callable[[nnx.Module, dict[str, jax.Array]], Any], batch: Mapping[str, np.ndarray], params: Any = None
    ) -> Any:
        """`fn(model, batch)` jitted (once per `fn` and batch shape; `fn` must be stable, as for `update`) on the
        current parameters, or on `params` of the same structure; returns numpy."""
        params = self.params if params is None else params
        placed = place_batch(self.layout, batch)
        out = _forward(params, self.rest, placed, graphdef=self.graphdef, fn=fn, layout=self.layout)
        return jax.device_get(out)

    def items(self) -> dict[str, Any]:
        """What a checkpoint holds: `{"params": ..., "opt_state": ...}`, the trained parameters only (a LoRA role's
        adapters; its base comes from the model's checkpoint)."""
        return {"params": self._trained_and_rest()[0], "opt_state": self.opt_state}

    def abstract_items(self) -> dict[str, Any]:
        """`items()` as `jax.ShapeDtypeStruct`s with this state's shardings (restore targets)."""
        return {
            "params": _abstract(self._trained_and_rest()[0], self._trained_shardings),
            "opt_state": _abstract(self.opt_state, self.opt_shardings),
        }

    def load_items(self, items: Mapping[str, Any]) -> None:
        """Replaces the trained parameters and the optimizer state with restored ones, which must have the trees,
        shapes and dtypes of `abstract_items` (checked: a mismatch raises before anything is replaced)."""
        expected = self.abstract_items()
        for name in ("params", "opt_state"):
            chex.assert_trees_all_equal_structs(items[name], expected[name])
            chex.assert_trees_all_equal_shapes_and_dtypes(items[name], expected[name])
        trained = items["params"]
        self.params = trained if self.trainable is nnx.Param else nnx.merge_state(self.params, trained)
        self.opt_state = items["opt_state"]

    def counters(self) -> dict[str, int]:
        """`step` and `skipped_steps` (JSON-able, for a checkpoint's extra data)."""
        return {"step": self.step, "skipped_steps": self.skipped_steps}

    def load_counters(self, counters: Mapping[str, int]) -> None:
        self.step, self.skipped_steps = int(counters["step"]), int(counters["skipped_steps"])


def split_rows(arrays: Mapping[str, np.ndarray], size: int) -> list[dict[str, np.ndarray]]:
    """Consecutive chunks of `size` rows, the last one padded by repeating its first row so that every chunk has one
    shape and compiles once. A padding row counts in no loss and no normaliser: its `response_mask` is 0 and its
    `ROW_IN_LOSS` False (where the arrays have them)."""
    rows = len(next(iter(arrays.values())))
    chunks = []
    for start in range(0, rows, size):
        chunk = {k: v[start : start + size] for k, v in arrays.items()}
        short = size - len(next(iter(chunk.values())))
        if short:
            chunk = {k: np.concatenate([v, np.repeat(v[:1], short, axis=0)]) for k, v in chunk.items()}
            for key in ("response_mask", ROW_IN_LOSS):
                if key in chunk:
                    chunk[key][-short:] = 0
        chunks.append(chunk)
    return chunks
