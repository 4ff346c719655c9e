"""What a run keeps in its run directory: atomic orbax checkpoints with fallback (`CheckpointManager`), metrics to
console, JSONL and TensorBoard (`MetricsLogger`, `read_metrics`; W&B in `wandb_sink`), their PNG plots (`plot`),
and the directory's lock and saved config (`run_dir`). Names load lazily, so importing one does not import orbax or
tensorboardX."""

from __future__ import annotations

from hfjax.lazy_names import lazy_names

_EXPORTS = {
    "CheckpointError": "checkpoint",
    "CheckpointManager": "checkpoint",
    "MetricsLogger": "metrics",
    "read_metrics": "metrics",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_names(__name__, _EXPORTS)
