"""The loop shared by the supervised trainers (SFT, reward model): typed config sections, loading the checkpoint
under a layout, resumable shuffled batches split into fixed-size micro-batches, `TrainState` updates, held-out
evaluation, orbax checkpoints with `trainer.resume: auto`, metrics, and the final Hugging Face export.

What differs between trainers is an `Objective`: the model head, the dataset, the loss (normalised by the whole
step's counts, added to each batch by `normalisers`) and the evaluation sums. A checkpoint holds parameters,
optimizer state, the step counters and the data position, so a resumed run repeats the uninterrupted run's steps.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from hfjax.config.supervised import DataSection, SupervisedConfig
from hfjax.data import BatchLoader
from hfjax.models import load_hf, load_tokenizer
from hfjax.models.hub import resolve_model
from hfjax.models.model_io import save_model, trained_parameters
from hfjax.models.vision_lm import check_policy_head, is_vision_language_checkpoint, load_processor, load_vision_lm
from hfjax.optim import TrainState, make_optimizer
from hfjax.optim.train_state import split_rows
from hfjax.parallel import layout_or_default
from hfjax.records import CheckpointManager, MetricsLogger
from hfjax.records.run_dir import RunDirLock, disk_failure, save_run_config
from hfjax.trainer.preemption import Preempted, SigtermGuard, abandoned_message, saved_message, training_guard
from hfjax.trainer.preflight import check_positions, model_config
from hfjax.typed_config import ConfigError, load_config, to_dict

CHECKPOINT_DIR = "checkpoints"
EXPORT_DIR = "hf"
ROW_WEIGHT = "row_weight"  # 1 on real rows of an evaluation batch, 0 on the padding rows that fill it


@dataclasses.dataclass(frozen=True)
class Objective:
    """What a supervised trainer trains. Functions are module-level (they key compiled programs):

    - `load_dataset(files, tokenizer, data, processor) -> dataset` with `__len__` and `collate(indices) -> Batch`
      (`processor`: a vision-language checkpoint's, else None);
    - `normalisers(tensors) -> dict` of per-row arrays with the whole step's counts, merged into the batch;
    - `loss_fn(model, batch) -> (loss, aux)`, the micro-batch's share of the step's loss;
    - `eval_fn(model, batch) -> {name: sum}` over rows weighted by `batch["row_weight"]`;
    - `summarize(sums) -> {"val/...": value}` from the sums over the whole held-out set;
    - `tokens(tensors) -> int`, the real tokens of a batch (for `perf/tokens_per_s`).
    """

    name: str
    head: str
    load_dataset: Callable[[Sequence[str], Any, DataSection, Any], Any]
    normalisers: Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]
    loss_fn: Callable[..., Any]
    eval_fn: Callable[..., Any]
    summarize: Callable[[Mapping[str, float]], dict[str, float]]
    tokens: Callable[[Mapping[str, np.ndarray]], int]


def full_rows(indices: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """`indices` padded to `size` by repeating its first entry, and the row weights (0 on the padding)."""
    pad = size - len(indices)
    weights = np.concatenate([np.ones(len(indices), np.float32), np.zeros(pad, np.float32)])
    return np.concatenate([indices, np.repeat(indices[:1], pad)]), weights


def evaluate(state: TrainState, objective: Objective, dataset: Any, micro_batch_size: int) -> dict[str, float]:
    """The objective's held-out metrics over all of `dataset`, in fixed-size batches."""
    loader = BatchLoader(dataset, micro_batch_size, shuffle=False, drop_last=False)
    sums: dict[str, float] = {}
    for indices in loader.batch_indices():
        rows, weights = full_rows(indices, micro_batch_size)
        batch = {**dataset.collate(rows).tensors, ROW_WEIGHT: weights}
        for key, value in state.eval(objective.eval_fn, batch).items():
            sums[key] = sums.get(key, 0.0) + float(value)
    return objective.summarize(sums)


def _batches(loader: BatchLoader) -> Iterator[Any]:
    while True:
        yield from loader


def _restore(
    state: TrainState, loader: BatchLoader, manager: CheckpointManager, resume: str, run_dir: Path
) -> int | None:
    """Continues from the newest readable checkpoint (`auto`); returns its step, or None for a fresh run."""
    if manager.latest_step() is None:
        return None
    if resume == "never":
        raise ValueError(
            f"trainer.resume=never but {manager.directory} holds checkpoints {manager.all_steps()}; "
            "choose another trainer.run_dir or set trainer.resume=auto"
        )
    step, items, extra = manager.restore(None, state.abstract_items())
    state.load_items(items)
    state.load_counters(extra["counters"])
    loader.load_state_dict(extra["data"])
    tqdm.write(f"resumed {run_dir} from step {step}")
    return step


def export(state: TrainState, tokenizer: Any, out_dir: Path, processor: Any = None) -> Path:
    """Writes the model as a Hugging Face checkpoint with its tokenizer (a vision-language model's `processor`);
    records the tokenizer's pad id in the config when the checkpoint had none (sequence-classification models need
    it to find the last token)."""
    path = save_model(state.model(), out_dir, tokenizer=processor or tokenizer, overwrite=True)
    config_file = path / "config.json"
    if jax.process_index() == 0 and tokenizer.pad_token_id is not None:
        config = json.loads(config_file.read_text())
        if config.get("pad_token_id") is None:
            config["pad_token_id"] = int(tokenizer.pad_token_id)
            config_file.write_text(json.dumps(config, indent=2))
    return path


def check_supervised_run(cfg: SupervisedConfig, head: str = "causal_lm") -> None:
    """Before anything loads: `model.path` (and `model.tokenizer_path`) are local model directories (a
    vision-language one as a causal LM `head` only, `model.freeze_vision_tower` on such a one only), sequences of
    `data.max_length` fit the model's positions, and the data files exist. Raises ConfigError naming the field."""
    model = model_config(cfg.model.path, "model.path")
    try:
        if is_vision_language_checkpoint(cfg.model.path):
            check_policy_head(cfg.model.path, head)
    except ValueError as exc:
        raise ConfigError(f"model.path: {exc}") from exc
    try:
        trained_parameters(cfg.model.path, cfg.model.freeze_vision_tower)
    except ValueError as exc:
        raise ConfigError(f"model.{exc}") from exc
    if cfg.model.tokenizer_path is not None and not Path(cfg.model.tokenizer_path).expanduser().is_dir():
        raise ConfigError(f"model.tokenizer_path: no such directory {cfg.model.tokenizer_path!r}")
    check_positions(model, cfg.data.max_length, f"data.max_length {cfg.data.max_length}", "model.path")
    for field in ("train_files", "val_files"):
        for i, file in enumerate(getattr(cfg.data, field)):
            if not Path(file).is_file():
                raise ConfigError(f"data.{field}[{i}]: no such file {file!r}")


def run_supervised(cfg: SupervisedConfig, objective: Objective) -> dict[str, float]:
    """Trains `objective` as configured (checked first by `check_supervised_run`); returns the last step's metrics
    with the final held-out metrics."""
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, path=resolve_model(cfg.model.path, "model.path"))
    )
    check_supervised_run(cfg, objective.head)
    is_main = jax.process_index() == 0
    # a SIGTERM while the model loads stops the run at once; one process only (several would have to agree)
    with SigtermGuard(cfg.trainer.preemption_grace_s, enabled=jax.process_count() == 1, starting=True):
        lock = RunDirLock(cfg.trainer.run_dir).acquire() if is_main else None  # one run per directory
        try:
            return _run_in_dir(cfg, objective, is_main)
        finally:
            if lock is not None:
                lock.release()


def _run_in_dir(cfg: SupervisedConfig, objective: Objective, is_main: bool) -> dict[str, float]:
    trainer, data = cfg.trainer, cfg.data
    run_dir = Path(trainer.run_dir)
    vision = is_vision_language_checkpoint(cfg.model.path)  # its processor reads images beside the text
    processor = load_processor(cfg.model.tokenizer_path or cfg.model.path) if vision else None
    tokenizer = processor.tokenizer if vision else load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
    train_set = objective.load_dataset(data.train_files, tokenizer, data, processor)
    val_set = objective.load_dataset(data.val_files, tokenizer, data, processor) if data.val_files else None
    loader = BatchLoader(train_set, data.batch_size, seed=trainer.seed, shuffle=data.shuffle, drop_last=True)
    total_steps = len(loader) * trainer.epochs
    total_steps = min(total_steps, trainer.total_steps) if trainer.total_steps else total_steps
    layout = layout_or_default(cfg.model.layout, where="model.layout")
    dtypes = {"dtype": cfg.model.dtype, "param_dtype": cfg.model.param_dtype}
    if vision:
        model = load_vision_lm(cfg.model.path, layout=layout, **dtypes)
    else:
        model = load_hf(cfg.model.path, layout=layout, head=objective.head, seed=trainer.seed, **dtypes)
    trainable = trained_parameters(cfg.model.path, cfg.model.freeze_vision_tower)
    optimizer = make_optimizer(cfg.optim, total_steps)
    state = TrainState(model, layout, optimizer, cfg.optim.grad_clip, trainable=trainable)
    del model  # its arrays now belong to `state` (donated on update)
    manager = CheckpointManager(run_dir / CHECKPOINT_DIR, trainer.max_to_keep)
    logger = None
    try:
        start = _restore(state, loader, manager, trainer.resume, run_dir)
        if is_main:
            save_run_config(cfg, run_dir)
        logger = MetricsLogger(run_dir, start_step=start or 0, write=is_main)  # drops records past the restart
        last = _train(cfg, objective, state, loader, val_set, manager, logger, total_steps)
        if val_set is not None and not any(k.startswith("val/") for k in last):
            last.update(evaluate(state, objective, val_set, data.micro_batch_size))
        if trainer.export_hf:
            export(state, tokenizer, run_dir / EXPORT_DIR, processor)
        if trainer.plot and is_main:
            from hfjax.records.plot import plot_finished_run

            plot_finished_run(run_dir)
        return last
    finally:
        try:
            manager.close()
        finally:
            if logger is not None:
                logger.close()


def _train(
    cfg: SupervisedConfig,
    objective: Objective,
    state: TrainState,
    loader: BatchLoader,
    val_set: Any,
    manager: CheckpointManager,
    logger: MetricsLogger,
    total_steps: int,
) -> dict[str, float]:
    """The steps up to `total_steps`; on SIGTERM (one process only: several would have to agree on the step) the
    step in flight is finished and saved, then `Preempted` is raised (`hfjax.trainer.preemption`)."""
    trainer, data = cfg.trainer, cfg.data
    batches = _batches(loader)
    last: dict[str, float] = {}
    saved = manager.latest_step()
    show = trainer.progress and jax.process_index() == 0

    def save() -> None:
        nonlocal saved
        extra = {"counters": state.counters(), "data": loader.state_dict(), "config": to_dict(cfg)}
        manager.save(state.step, state.items(), extra)
        saved = state.step

    with (
        training_guard(trainer.preemption_grace_s, enabled=jax.process_count() == 1) as sigterm,
        tqdm(total=total_steps, initial=state.step, desc=objective.name, unit="step", disable=not show) as bar,
    ):
        in_flight = state.step + 1
        try:
            while state.step < total_steps:
                if sigterm.requested:
                    if state.step and saved != state.step:
                        save()
                    manager.wait()
                    raise Preempted(saved_message(state.step))
                started, in_flight = time.perf_counter(), state.step + 1
                tensors = dict(next(batches).tensors)
                tensors.update(objective.normalisers(tensors))
                metrics = state.update(objective.loss_fn, split_rows(tensors, data.micro_batch_size))
                seconds = time.perf_counter() - started
                step, final = state.step, state.step == total_steps
                last = {f"train/{key}": value for key, value in metrics.items()}
                last["train/epoch"] = loader.epoch + loader.batch / len(loader)
                last["timing_s/step"] = seconds
                last["perf/tokens_per_s"] = objective.tokens(tensors) / seconds
                if val_set is not None and ((trainer.val_freq and step % trainer.val_freq == 0) or final):
                    last.update(evaluate(state, objective, val_set, data.micro_batch_size))
                if step % trainer.log_freq == 0 or final:
                    logger.log(step, last)
                if (trainer.save_freq and step % trainer.save_freq == 0) or final:
                    save()
                bar.update(1)
                bar.set_postfix(loss=f"{last['train/loss']:.4g}")
        except BaseException as exc:
            abandoned = sigterm.abandonment(exc)
            if abandoned is not None:
                raise Preempted(abandoned_message(abandoned, in_flight, saved)) from None
            failure = disk_failure(exc, cfg.trainer.run_dir, saved)
            if failure is None:
                raise
            raise failure from exc
    return last


def cli_main(
    cls: type[SupervisedConfig], run: Callable[[Any], dict[str, float]], config_path: str, overrides: list[str]
) -> int:
    """Loads `cls` from YAML plus `key=value` overrides, runs `run`, prints the final metrics; returns 0. A bad config
    raises `ConfigError` (the CLI prints it as one line per problem, exit code 2)."""
    cfg = load_config(cls, config_path, overrides)
    metrics = run(cfg)
    if jax.process_index() == 0:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"final metrics ({cfg.trainer.run_dir})")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key in sorted(metrics):
            table.add_row(key, f"{metrics[key]:.6g}")
        Console().print(table)
    return 0
