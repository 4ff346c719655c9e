"""The training step's state on the workers: the optimizer (`OptimConfig`, `make_optimizer`, the learning-rate
schedule) and sharded parameter and optimizer state with gradient accumulation (`TrainState`). Names load lazily,
so importing `hfjax.optim.optimizer` (for config dataclasses) does not import the train state's dependencies."""

from __future__ import annotations

from hfjax.lazy_names import lazy_names

_EXPORTS = {
    "OptimConfig": "optimizer",
    "learning_rate_schedule": "optimizer",
    "make_optimizer": "optimizer",
    "TrainState": "train_state",
    "batch_sharding": "train_state",
    "compile_counts": "train_state",
    "place_batch": "train_state",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_names(__name__, _EXPORTS)
