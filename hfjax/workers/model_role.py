"""What every model role shares: its layout (default: all of this process's devices), loading its checkpoint under
it, and running a jitted per-row function over fixed-size micro-batches placed on it.

Imports `hfjax.models`, `hfjax.parallel`, `hfjax.training` and this package's sequences.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from hfjax.models import load_hf
from hfjax.parallel import Layout
from hfjax.training.checkpoint import CheckpointManager
from hfjax.training.train_state import TrainState, place_batch
from hfjax.workers.sequences import split_rows


def reports_seconds(method: Callable[..., Any]) -> Callable[..., Any]:
    """Adds the wall time spent inside a worker method returning a `DataProto` to its `meta_info["metrics"]` as
    `worker_seconds` (the controller compares it with the time it waited: the rest is dispatch and transfer)."""

    @functools.wraps(method)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        out = method(self, *args, **kwargs)
        out.meta_info.setdefault("metrics", {})["worker_seconds"] = time.perf_counter() - started
        return out

    return timed


def role_layout(config: Mapping[str, Any] | None, generation: bool = False) -> Layout:
    """The configured layout, or every local device: fsdp for training and scoring, data parallel for generation."""
    if config is not None:
        return Layout.from_config(config)
    devices = len(jax.devices())
    if generation:
        return Layout.from_config({"mesh": {"data": devices}, "rules": "dp_tp_gen"})
    return Layout.from_config({"mesh": {"fsdp": devices}, "rules": "fsdp"})


class LoadedModel:
    """A checkpoint loaded under a layout: graph definition, parameters, and jitted per-row functions over them."""

    def __init__(self, path: str, layout: Layout, *, dtype: str, param_dtype: str | None = None, head: str | None):
        self.layout = layout
        model = load_hf(path, dtype=dtype, param_dtype=param_dtype, layout=layout, head=head)
        self.config = model.config
        self.model = model
        self.graphdef, self.params, self.rest = nnx.split(model, nnx.Param, ...)

    def merge(self, params: Any) -> nnx.Module:
        return nnx.merge(self.graphdef, params, self.rest)

    def rows_fn(self, fn: Callable[[nnx.Module, dict[str, jax.Array]], Any]) -> Callable[..., Any]:
        """`fn(model, batch) -> arrays with rows first`, jitted over (params, batch)."""
        return jax.jit(lambda params, batch: fn(self.merge(params), batch))

    def map_rows(
        self, jitted: Callable[..., Any], params: Any, arrays: Mapping[str, np.ndarray], micro_batch_size: int
    ) -> Any:
        """Runs `jitted(params, micro_batch)` over fixed-size micro-batches; concatenates the outputs (numpy),
        dropping the padding rows of the last micro-batch."""
        rows = len(next(iter(arrays.values())))
        outs = [jitted(params, place_batch(self.layout, chunk)) for chunk in split_rows(dict(arrays), micro_batch_size)]
        host = jax.device_get(outs)
        return jax.tree.map(lambda *parts: np.concatenate(parts)[:rows], *host)


def step_metrics(history: list[tuple[dict[str, float], int]], role: str, skipped_steps: int) -> dict[str, float]:
    """Means over optimizer steps of `TrainState.update` metrics. The loss functions' own metrics (named
    `role/...`) are normalised by the whole mini-batch's counts, so their per-step value is the sum over the
    micro-batches (`update` reports their mean: times the micro-batch count)."""
    per_step = []
    for metrics, micro_batches in history:
        per_step.append({k: v * micro_batches if k.startswith(f"{role}/") else v for k, v in metrics.items()})
    out = {}
    for key in per_step[0]:
        name = key if "/" in key else f"{role}/{key}"
        out[name] = float(np.mean([m[key] for m in per_step]))
    out[f"{role}/skipped_steps"] = float(skipped_steps)
    return out


def save_train_state(
    state: TrainState, manager: CheckpointManager | None, directory: str, step: int
) -> CheckpointManager:
    """Saves a role's `TrainState` (asynchronously; `manager.wait()` to finish); returns the manager used."""
    manager = _manager(manager, directory)
    manager.save(step, state.items(), {"counters": state.counters()})
    return manager


def load_train_state(
    state: TrainState, manager: CheckpointManager | None, directory: str, step: int | None
) -> tuple[CheckpointManager, int]:
    """Restores a role's `TrainState` from `directory` at `step` (None: latest) and drops newer steps (a run
    resumes from the step it completed); returns the manager and the step."""
    manager = _manager(manager, directory)
    restored, items, extra = manager.restore(step, state.abstract_items())
    manager.discard_after(restored)
    state.load_items(items)
    state.load_counters(extra["counters"])
    return manager, restored


def _manager(manager: CheckpointManager | None, directory: str) -> CheckpointManager:
    if manager is not None and manager.directory == Path(directory).absolute():
        return manager
    return CheckpointManager(directory)
