"""What every model role shares: its layout (default: all of this process's devices), loading its checkpoint under
it, and running a jitted per-row function over fixed-size micro-batches placed on it (attention traced under the
layout, `hfjax.models.program.program_layout`).

"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hfjax.algos import mask_counts
from hfjax.controller import Dispatch, Worker, register
from hfjax.models.attention import configured_implementation
from hfjax.models.lora import LoraConfig, LoraParam, add_lora
from hfjax.models.model_io import load_model, trained_parameters
from hfjax.models.moe import router_summary, set_expert_capacity
from hfjax.models.program import program_layout
from hfjax.models.transformer import set_remat
from hfjax.models.vision_lm import language_model, set_model_images_per_step
from hfjax.optim.train_state import (
    TrainState,
    batch_sharding,
    combine_metric,
    place_batch,
    place_params,
    split_rows,
)
from hfjax.parallel import Layout
from hfjax.parallel.global_arrays import process_reduce, to_local
from hfjax.protocol import PADDING_ROWS, ROW_IN_LOSS, DataProto
from hfjax.records.checkpoint import CheckpointManager, UnreadableStepError
from hfjax.workers.packing import packed_micro_batches
from hfjax.workers.sequences import trimmed_chunks
from hfjax.xla_settings import FORWARD_COMPILER_OPTIONS


def device_peak_bytes() -> float | None:
    """The most device memory any of this process's devices has held so far (`peak_bytes_in_use` of
    `Device.memory_stats`), or None where the platform keeps no such count (CPU)."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    known = [p for p in peaks if p is not None]
    return float(max(known)) if known else None


def reports_usage(method: Callable[..., Any]) -> Callable[..., Any]:
    """Adds the wall time spent inside a worker method returning a `DataProto` to its `meta_info["metrics"]` as
    `worker_seconds` (the controller compares it with the time it waited: the rest is dispatch and transfer), and
    this process's peak device memory so far as `device_peak_bytes` where the platform counts it."""

    @functools.wraps(method)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        out = method(self, *args, **kwargs)
        metrics = out.meta_info.setdefault("metrics", {})
        metrics["worker_seconds"] = time.perf_counter() - started
        peak = device_peak_bytes()
        if peak is not None:
            metrics["device_peak_bytes"] = peak
        return out

    return timed


class LoadedModel:
    """A checkpoint loaded under a layout (with `lora`'s adapters attached, when given, the top-level parameters
    named in `float32_params` cast to float32, and a mixture of experts' `expert_capacity_factor`): graph
    definition, parameters, and jitted per-row functions over them. With `frozen_layout`, the parameters that
    `trainable` does not select (a LoRA base) are loaded into that layout instead (`place_params`)."""

    def __init__(
        self,
        path: str,
        layout: Layout,
        *,
        dtype: str,
        param_dtype: str | None = None,
        head: str | None,
        remat: str = "none",
        lora: LoraConfig | None = None,
        float32_params: tuple[str, ...] = (),
        expert_capacity_factor: float | None = None,
        trainable: nnx.filterlib.Filter = nnx.Param,
        frozen_layout: Layout | None = None,
        images_per_step: int = 0,
    ):
        self.layout = layout
        loaded = frozen_layout or layout
        model = load_model(path, dtype=dtype, param_dtype=param_dtype, layout=loaded, head=head)
        set_remat(language_model(model), remat)
        set_model_images_per_step(model, images_per_step)
        set_expert_capacity(model, expert_capacity_factor)
        for name in float32_params:  # e.g. a trained head beside a frozen base stored in the compute dtype
            param = getattr(model, name)
            param.set_value(param.get_value().astype(jnp.float32))
        if lora is not None:
            add_lora(model, lora)
        self.config = model.config
        self.model = model
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self.params = place_params(params, layout, trainable, frozen_layout)  # adapters sharded as their base weights
        nnx.update(model, self.params)

    def merge(self, params: Any) -> nnx.Module:
        return nnx.merge(self.graphdef, params, self.rest)

    def rows_fn(self, fn: Callable[[nnx.Module, dict[str, jax.Array]], Any]) -> Callable[..., Any]:
        """`fn(model, batch) -> arrays with rows first`, jitted over (params, batch) (`rows_program`)."""
        return rows_program(self.graphdef, self.rest, self.layout, fn)

    def map_rows(
        self,
        jitted: Callable[..., Any],
        params: Any,
        arrays: Mapping[str, np.ndarray],
        micro_batch_size: int,
        response_length: int | None = None,
        row_tokens: int = 0,
    ) -> Any:
        """Runs `jitted(params, micro_batch)` over fixed-size micro-batches; concatenates the outputs (numpy),
        dropping the padding rows of the last micro-batch. With `response_length` (outputs [rows, response columns]),
        rows of similar lengths share micro-batches, each micro-batch drops its all-padding columns
        (`trim_padding`), and the outputs come back in row order, zero-padded to `response_length` columns; with
        `row_tokens` too, the micro-batches are packed instead (`hfjax.workers.packing`: `micro_batch_size` unused).
        In a group of several processes, `arrays` are this process's rows, `micro_batch_size` counts the rows of
        the whole group (each process gives its share) and only this process's rows come back."""
        rows = len(next(iter(arrays.values())))
        local_rows = process_share(micro_batch_size, "micro_batch_size")
        if response_length is None:
            order, chunks = np.arange(rows), split_rows(arrays, local_rows)
        elif row_tokens:
            parts = packing_parts(self.layout)
            order, chunks = packed_micro_batches(arrays, response_length, row_tokens, parts)
        else:
            order, chunks = trimmed_chunks(dict(arrays), local_rows, response_length)
        outputs = [jitted(params, place_batch(self.layout, chunk)) for chunk in chunks]  # all dispatched, then read
        host = [to_local(out) for out in outputs]
        if response_length is not None:
            host = [jax.tree.map(lambda x: _pad_columns(x, response_length), out) for out in host]
        joined = jax.tree.map(lambda *parts: np.concatenate(parts)[: len(order)], *host)
        return jax.tree.map(lambda x: _in_row_order(x, order, rows), joined)


def load_trained(
    section: Any,
    layout: Layout,
    head: str,
    trained_head: tuple[str, ...] = (),
    frozen_layout: Layout | None = None,
) -> tuple[LoadedModel, Any]:
    """A trained role's checkpoint (`section`: the actor's or critic's config) and the filter of what it trains: every
    parameter, or with `section.lora` its adapters and the head parameters named in `trained_head` (kept in float32),
    the base frozen and stored in the compute dtype (sharded by `frozen_layout` when given, else by `layout`)."""
    lora = section.lora if section.lora.enabled else None
    freeze = getattr(section, "freeze_vision_tower", False)  # the actor's setting (a critic has no vision tower)
    trained = nnx.Any(LoraParam, *(nnx.PathContains(name) for name in trained_head)) if lora else None
    trainable = trained or trained_parameters(section.model_path, freeze)
    model = LoadedModel(
        section.model_path,
        layout,
        dtype=section.dtype,
        param_dtype=section.dtype if lora else section.param_dtype,
        head=head,
        remat=section.remat,
        lora=lora,
        float32_params=trained_head if lora else (),
        expert_capacity_factor=section.expert_capacity_factor,
        trainable=trainable,
        frozen_layout=frozen_layout,
        images_per_step=getattr(section, "images_per_step", 0),  # the actor's setting
    )
    return model, trainable


def rows_program(
    graphdef: Any, rest: Any, layout: Layout, fn: Callable[[nnx.Module, dict[str, jax.Array]], Any]
) -> Callable[..., Any]:
    """`fn(model, batch) -> arrays with rows first` jitted over (params, batch), traced under `layout`
    (`hfjax.models.program.program_layout`); the outputs keep the batch's row sharding (so each process of a group
    holds the rows it passed in). A model without non-parameter state gets the one program of its structure, layout
    and `fn` in this process (an `fn` from `hfjax.models.program.bind` equals every binding of equal settings), so
    a later worker of the same model and settings reuses its traces."""
    if not jax.tree.leaves(rest):
        return _shared_rows_program(graphdef, layout, fn, (layout.platform, configured_implementation()))
    return _rows_program(graphdef, rest, layout, fn)


@functools.lru_cache(maxsize=64)
def _shared_rows_program(graphdef: Any, layout: Layout, fn: Callable[..., Any], attention: Any) -> Callable[..., Any]:
    """The rows program of a model without non-parameter state, by structure, layout, `fn` and attention choice
    (the layout's platform and the attention setting)."""
    return _rows_program(graphdef, nnx.State({}), layout, fn)


def _rows_program(
    graphdef: Any, rest: Any, layout: Layout, fn: Callable[[nnx.Module, dict[str, jax.Array]], Any]
) -> Callable[..., Any]:
    def rows(params: Any, batch: dict[str, jax.Array]) -> Any:
        with program_layout(layout):
            out = fn(nnx.merge(graphdef, params, rest), batch)
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, batch_sharding(layout, x.shape)), out)

    return jax.jit(rows, compiler_options=FORWARD_COMPILER_OPTIONS)


def process_share(rows: int, name: str) -> int:
    """This process's rows of a batch of `rows` rows split over the group's processes."""
    processes = jax.process_count()
    if rows % processes:
        raise ValueError(f"{name}={rows}: a group of {processes} processes needs a multiple of {processes}")
    return rows // processes


def padding_masked(arrays: dict[str, np.ndarray], data: DataProto) -> dict[str, np.ndarray]:
    """`arrays` with `ROW_IN_LOSS`, the rows the update counts: the batch's own flags (False on rows a program keeps
    out; all True when it has none), and False on the rows DP dispatch added as padding (`PADDING_ROWS`); and with
    `response_mask` zero on every row that does not count, so that none reaches a loss or a normaliser."""
    padding = int(data.meta_info.get(PADDING_ROWS, 0))
    rows = len(arrays["response_mask"])
    in_loss = np.asarray(data.batch[ROW_IN_LOSS], bool) if ROW_IN_LOSS in data.batch else np.ones(rows, bool)
    in_loss = in_loss & (np.arange(rows) < rows - padding)
    arrays[ROW_IN_LOSS] = in_loss
    mask = arrays["response_mask"]
    arrays["response_mask"] = np.where(in_loss[:, None], mask, np.zeros_like(mask))
    return arrays


def _counted_first(in_loss: np.ndarray, micro: int) -> np.ndarray:
    """The rows of this process's share of a mini-batch (`in_loss`: which count; some process of the group has one)
    that its micro-batches of `micro` rows take: the counted rows in order, then uncounted ones up to as many
    micro-batches as the process with the most counted rows needs, so that no micro-batch is padding in every process
    of the group."""
    needed = int(process_reduce(-(-int(in_loss.sum()) // micro), "max"))
    return np.argsort(~in_loss, kind="stable")[: needed * micro]


def packing_parts(layout: Layout) -> int:
    """The packed rows this process gives each packed micro-batch: its share of the layout's batch parts."""
    processes = jax.process_count()
    if layout.batch_parts % processes:
        raise ValueError(
            f"packed_row_tokens: {layout.describe()} splits rows into {layout.batch_parts} parts, which its "
            f"{processes} processes cannot share (one packed row per part); use a layout whose batch axes span "
            "the processes, or packed_row_tokens: 0"
        )
    return layout.batch_parts // processes


def _rows(arrays: dict[str, np.ndarray], index: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v[index] for k, v in arrays.items()}


def _in_row_order(outputs: np.ndarray, order: np.ndarray, rows: int) -> np.ndarray:
    """`outputs` [len(order), ...], output i belonging to row order[i] (-1: a padding row), as [rows, ...]."""
    out = np.zeros((rows, *outputs.shape[1:]), outputs.dtype)
    keep = order >= 0
    out[order[keep]] = outputs[keep]
    return out


def _pad_columns(array: np.ndarray, columns: int) -> np.ndarray:
    """[rows, c, ...] zero-padded to [rows, columns, ...]."""
    return np.pad(array, [(0, 0), (0, columns - array.shape[1])] + [(0, 0)] * (array.ndim - 2))


def weighted_router_metrics(
    router: Any, experts_per_token: int, mask: jax.Array, global_tokens: jax.Array, role: str
) -> dict[str, jax.Array]:
    """A mixture of experts' router figures of one micro-batch (`router_summary` of the stats it collected) as
    `{role}/router_...` metrics, each times the micro-batch's share of the mini-batch's response tokens (so they sum
    over micro-batches to the mini-batch's token-weighted figure)."""
    share = jnp.sum(mask) / jnp.maximum(global_tokens, 1.0)
    return {f"{role}/router_{name}": value * share for name, value in router_summary(router, experts_per_token).items()}


def step_metrics(
    history: list[tuple[dict[str, float], int]], role: str, skipped_steps: int, empty_mini_batches: int = 0
) -> dict[str, float]:
    """`TrainState.update` metrics over optimizer steps, combined by `combine_metric` (means; extremes of `_max` /
    `_min` metrics). The loss functions' own metrics (named `<namespace>/...`: `actor/`, `critic/`,
    `rollout_corr/`) are normalised by the whole mini-batch's counts, so a step's value is the sum over its
    micro-batches (`update` reports their mean: times the micro-batch count), or for an extreme the extreme of the
    micro-batches' (as `update` reports it); the update's own metrics (`loss`, `grad_norm`, ...) get the `role/`
    prefix. Without a step (`history` empty) there are none of these. Always: `role/skipped_steps` (the state's
    steps skipped for a non-finite gradient, so far) and `role/skipped_empty_mini_batches` (the mini-batches
    without a counted row in this update, which took no step)."""
    per_step = [{k: v * micro if _is_share(k) else v for k, v in metrics.items()} for metrics, micro in history]
    out = {}
    for key in per_step[0] if per_step else ():
        name = key if "/" in key else f"{role}/{key}"
        out[name] = combine_metric(key, [m[key] for m in per_step])
    out[f"{role}/skipped_steps"] = float(skipped_steps)
    out[f"{role}/skipped_empty_mini_batches"] = float(empty_mini_batches)
    return out


def _is_share(key: str) -> bool:
    """Whether a metric of `TrainState.update` is a loss function's share of its mini-batch's value."""
    return "/" in key and not key.endswith(("_max", "_min"))


LORA_DROPOUT_SEED = "lora_dropout_seed"  # [rows] int: each row's adapter dropout masks (`adapter_dropout`)


class TrainedRole(Worker):
    """What the trained roles (actor, critic) share: PPO epochs over mini-batches with micro-batch accumulation,
    and checkpoints of their `TrainState` (set `self.state` in `init_model`)."""

    state: TrainState
    checkpoints: CheckpointManager | None = None

    def with_dropout_seeds(self, arrays: dict[str, np.ndarray], lora: LoraConfig) -> dict[str, np.ndarray]:
        """`arrays` with a fresh `LORA_DROPOUT_SEED` per row when `lora` drops out adapter inputs (drawn from this
        process's index and the optimizer steps taken, so a resumed run draws new masks)."""
        if not lora.drops_out:
            return arrays
        rng = np.random.default_rng((jax.process_index(), self.state.step))
        seeds = rng.integers(0, 2**31 - 1, len(arrays["responses"]), dtype=np.int32)
        return {**arrays, LORA_DROPOUT_SEED: seeds}

    def ppo_epochs(
        self,
        arrays: dict[str, np.ndarray],
        loss_fn: Callable[..., Any],
        epochs: int,
        mini: int,
        micro: int,
        role: str,
        trim: bool = False,
        row_tokens: int = 0,
    ) -> DataProto:
        """`epochs` passes over mini-batches of `mini` rows, each one optimizer step over micro-batches of `micro`
        rows whose losses are normalised by the mini-batch's counts (`global_tokens`, `global_seqs` per row), so
        accumulation equals the whole mini-batch. In a group of several processes `arrays` are this process's rows and
        `mini`, `micro` count the group's rows: each process takes its share of every mini- and micro-batch, and the
        counts are the group's. With `trim`, a mini-batch's rows are grouped by length and each
        micro-batch drops its all-padding columns (`trim_padding`); with `row_tokens`, a mini-batch's sequences are
        packed into micro-batches of one row of at most `row_tokens` tokens per batch part instead
        (`hfjax.workers.packing`; `micro` unused). Either way the step is the same sum of per-token terms.

        One rule for every kind of padding: a row DP dispatch or `split_rows` added, or one a program keeps out
        (`arrays[ROW_IN_LOSS]` False, from `padding_masked`), counts in no normaliser and enters a micro-batch only
        to fill one that holds a counted row in some process (a micro-batch of such rows alone is not run).
        `global_tokens` is the mini-batch's valid tokens and `global_seqs` its counted rows, with or without a valid
        token (verl's `global_batch_size`), over the group, whatever the number of processes and micro-batches. A
        short mini-batch (the last one, or the whole batch when it has fewer than `mini` rows) is normalised by its
        own counted rows as a full one is: verl divides by the configured size and refuses a short mini-batch, but
        hfjax takes one step over a batch smaller than the mini-batch, and rows kept out shrink any mini-batch. A
        mini-batch without a counted row in the group (`global_seqs` 0, which every process agrees on) runs no
        micro-batch and takes no optimizer step: a zero-gradient AdamW step would still move the parameters (momentum,
        weight decay) and advance the learning-rate schedule. Metrics are means over the steps taken
        (`step_metrics`), with the mini-batches skipped so."""
        history, empty = [], 0
        response_length = arrays["responses"].shape[1]
        mini, micro = process_share(mini, "ppo_mini_batch_size"), process_share(micro, "micro_batch_size")
        for _ in range(epochs):
            for batch in split_rows(arrays, mini):
                in_loss = batch.pop(ROW_IN_LOSS)
                tokens, seqs = process_reduce(mask_counts(batch["response_mask"], in_loss), "sum")
                if not seqs:
                    empty += 1
                    continue
                rows = len(in_loss)
                batch["global_tokens"] = np.full(rows, float(tokens), np.float32)
                batch["global_seqs"] = np.full(rows, float(seqs), np.float32)
                if row_tokens:  # packing agrees the micro-batch count; a process without a counted row packs padding
                    keep = in_loss if in_loss.any() else np.arange(rows) == 0
                    parts = packing_parts(self.state.layout)
                    chunks = packed_micro_batches(_rows(batch, keep), response_length, row_tokens, parts)[1]
                else:
                    batch = _rows(batch, _counted_first(in_loss, micro))
                    chunks = trimmed_chunks(batch, micro, response_length)[1] if trim else split_rows(batch, micro)
                history.append((self.state.update(loss_fn, chunks), len(chunks)))
        return DataProto(meta_info={"metrics": step_metrics(history, role, self.state.skipped_steps, empty)})

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, directory: str, step: int, max_to_keep: int = 3) -> None:
        """Parameters, optimizer state and counters under `directory` (orbax, asynchronous), as step `step`; only
        the newest `max_to_keep` steps stay."""
        self.checkpoints = _manager(self.checkpoints, directory, max_to_keep)
        self.checkpoints.save(step, self.state.items(), {"counters": self.state.counters()})

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, directory: str, step: int | None) -> int:
        """Restores step `step` (None: the latest readable one); returns the step restored. Other steps are left
        as they are."""
        self.checkpoints = _manager(self.checkpoints, directory)
        restored, items, extra = self.checkpoints.restore(step, self.state.abstract_items())
        self.state.load_items(items)
        self.state.load_counters(extra["counters"])
        return restored

    @register(Dispatch.ONE_TO_ALL)
    def try_load_checkpoint(self, directory: str, step: int) -> str | None:
        """Restores step `step` when it is saved and readable and returns None; otherwise returns why not (an
        unreadable step is set aside as `<step>.unreadable`) and leaves the state as it was. A step that does not
        match this role's model still raises."""
        self.checkpoints = _manager(self.checkpoints, directory)
        if step not in self.checkpoints.all_steps():
            return f"{directory} has no step {step} (saved: {self.checkpoints.all_steps()})"
        try:
            self.load_checkpoint(directory, step)
        except UnreadableStepError as e:
            self.checkpoints.set_aside(step)
            return str(e)
        return None

    @register(Dispatch.ONE_TO_ALL)
    def discard_checkpoints_after(self, directory: str, step: int) -> list[int]:
        """Deletes this role's steps newer than `step` (a resumed run saves them again); returns them."""
        self.checkpoints = _manager(self.checkpoints, directory)
        return self.checkpoints.discard_after(step)

    @register(Dispatch.ONE_TO_ALL)
    def wait_for_checkpoint(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.wait()


def _manager(manager: CheckpointManager | None, directory: str, max_to_keep: int | None = None) -> CheckpointManager:
    """`manager` when it serves `directory` (and keeps `max_to_keep` steps, when given), else a new one."""
    if (
        manager is not None
        and manager.directory == Path(directory).absolute()
        and max_to_keep in (None, manager.max_to_keep)
    ):
        return manager
    if manager is not None:
        manager.close()
    # several processes: synchronous saves, since two roles' async finalize threads in one process race on orbax's
    # cross-process barrier (seen once: "Barrier ... set_value_start is already ongoing")
    return CheckpointManager(directory, max_to_keep or 3, async_save=jax.process_count() == 1)
