"""`WandbSink`: a run's metrics to Weights & Biases (`trainer.logger: [..., wandb]`, the optional extra
`hfjax[wandb]`). `WANDB_MODE=offline` keeps everything local (under `run_dir/wandb`, synced later with `wandb sync`).

W&B keeps one history per run and drops steps lower than the last one logged, so a resumed hfjax run, which logs again
the steps after its checkpoint, starts a new W&B run in the same group, named after the step it resumed from.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


class WandbSink:
    """One W&B run: `project`, `group` (the experiment), `config` (the resolved config) and files under `run_dir`
    (`path`, `run_dir/wandb`)."""

    def __init__(self, run_dir: str | Path, project: str, experiment: str, config: Mapping[str, Any], start_step: int):
        self.path = Path(run_dir) / "wandb"
        try:
            import wandb
        except ImportError as exc:
            raise ImportError("trainer.logger names wandb, which is not installed: pip install 'hfjax[wandb]'") from exc
        name = experiment if not start_step else f"{experiment} (resumed at step {start_step})"
        self._run = wandb.init(
            project=project, group=experiment, name=name, dir=str(run_dir), config=dict(config), reinit="create_new"
        )

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()
