"""Training machinery shared by every trainer and worker: the optimizer (`OptimConfig`, `make_optimizer`), sharded
parameter/optimizer state with gradient accumulation (`TrainState`), atomic orbax checkpoints with fallback
(`CheckpointManager`) and run metrics (`MetricsLogger`, `read_metrics`).

May import `hfjax.protocol`, `parallel`, `models`, `algos`, `data`, `typed_config`; never workers, trainer,
controller or cli. Names load lazily, so importing `hfjax.training.optim` (for config dataclasses) does not import
orbax or tensorboardX.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "OptimConfig": "optim",
    "learning_rate_schedule": "optim",
    "make_optimizer": "optim",
    "TrainState": "train_state",
    "batch_sharding": "train_state",
    "compile_counts": "train_state",
    "place_batch": "train_state",
    "CheckpointError": "checkpoint",
    "CheckpointManager": "checkpoint",
    "MetricsLogger": "metrics",
    "read_metrics": "metrics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hfjax.training' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hfjax.training.{_EXPORTS[name]}"), name)
