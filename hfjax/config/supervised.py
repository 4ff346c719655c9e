"""The supervised runs' configs (`hfjax sft`, `hfjax rm`): the model, data, optimizer and trainer sections, and the
run configs that compose them (`SFTConfig`, `RMConfig`). The loop that runs them is `hfjax.trainer.supervised`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from hfjax.config.roles import Dtype, warn_low_precision_master
from hfjax.optim import OptimConfig
from hfjax.parallel import Layout
from hfjax.typed_config import AT_LEAST_1, NON_NEGATIVE, ZERO_AT_END, check_fields


@dataclasses.dataclass
class ModelSection:
    """The starting checkpoint (a Hugging Face directory), its tokenizer (default: the same directory), numerics
    and the training layout (`Layout.from_config` form; null: fsdp over every device)."""

    path: str
    tokenizer_path: str | None = None
    dtype: Dtype = "float32"  # compute
    param_dtype: Dtype = "float32"  # storage of the trained master copy (optimizer state is always float32)
    layout: dict[str, Any] | None = None
    # a vision-language checkpoint: true keeps its vision tower as the checkpoint has it (the projector into the
    # language model and the language model train)
    freeze_vision_tower: bool = False

    def __post_init__(self) -> None:
        check_fields(self, path=(bool, "a Hugging Face model directory (not empty)"))
        if self.layout is not None:
            Layout.from_config(self.layout, "layout")
        warn_low_precision_master("model", self.param_dtype)


@dataclasses.dataclass
class DataSection:
    """Training (and optional held-out) files; `batch_size` rows per optimizer step, run as micro-batches of
    `micro_batch_size` rows; every sequence padded to `max_length` (one compiled shape)."""

    train_files: list[str]
    val_files: list[str] = dataclasses.field(default_factory=list)
    max_length: int = 512
    truncation: Literal["error", "filter", "left", "right"] = "error"
    batch_size: int = 32
    micro_batch_size: int = 8
    shuffle: bool = True

    def __post_init__(self) -> None:
        check_fields(self, max_length=AT_LEAST_1, batch_size=AT_LEAST_1, micro_batch_size=AT_LEAST_1)
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"batch_size: expected a multiple of micro_batch_size={self.micro_batch_size}, got {self.batch_size}"
            )
        if not self.train_files:
            raise ValueError("train_files: expected at least one parquet or JSONL file, got []")


@dataclasses.dataclass
class TrainerSection:
    """Run length, checkpointing, evaluation and logging. `total_steps` caps `epochs`; `save_freq` / `val_freq` of
    0 mean "at the end only"; `resume: auto` continues from the newest readable checkpoint in `run_dir`."""

    run_dir: str = "runs/supervised"
    epochs: int = 1
    total_steps: int | None = None
    save_freq: int = 0
    val_freq: int = 0
    max_to_keep: int = 3
    resume: Literal["auto", "never"] = "auto"
    log_freq: int = 1
    seed: int = 0
    export_hf: bool = True
    progress: bool = True
    plot: bool = True  # draw `hfjax plot`'s PNGs into run_dir/plots at the end
    # on SIGTERM (one process only): seconds to finish and save the step in flight before abandoning it (0: abandon
    # at once; the previous checkpoint is kept either way); the run then exits with code 143
    preemption_grace_s: float = 30.0

    def __post_init__(self) -> None:
        check_fields(
            self,
            run_dir=(bool, "a directory path (not empty)"),
            epochs=AT_LEAST_1,
            log_freq=AT_LEAST_1,
            max_to_keep=AT_LEAST_1,
            save_freq=ZERO_AT_END,
            val_freq=ZERO_AT_END,
            total_steps=(lambda v: v is None or v >= 1, ">= 1 or null"),
            seed=NON_NEGATIVE,
            preemption_grace_s=(lambda v: 0 <= v < math.inf, "seconds >= 0"),
        )


@dataclasses.dataclass
class SupervisedConfig:
    """A supervised run: `model`, `data`, `optim`, `trainer`."""

    model: ModelSection
    data: DataSection
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    trainer: TrainerSection = dataclasses.field(default_factory=TrainerSection)


@dataclasses.dataclass
class SFTConfig(SupervisedConfig):
    """An SFT run: `model`, `data` (rows with `prompt` and `response`), `optim`, `trainer`."""

    trainer: TrainerSection = dataclasses.field(default_factory=lambda: TrainerSection(run_dir="runs/sft"))


@dataclasses.dataclass
class RMConfig(SupervisedConfig):
    """A reward-model run: `model`, `data` (rows with `prompt`, `chosen`, `rejected`), `optim`, `trainer`."""

    trainer: TrainerSection = dataclasses.field(default_factory=lambda: TrainerSection(run_dir="runs/rm"))
