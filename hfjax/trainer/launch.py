"""Running an RL config end to end: Ray start-up (when the backend is Ray and no cluster is connected), the
trainer, a final summary, and exporting a checkpoint of a finished run as a Hugging Face model.
Imports `hfjax.config`, `hfjax.workers` and this package."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hfjax.config import RLConfig, load_rl_config
from hfjax.trainer.rl import RLTrainer
from hfjax.workers.actor import ActorRolloutRefWorker


def run_rl(cfg: RLConfig) -> list[dict[str, float]]:
    """Trains; starts a local Ray instance for `backend: ray` unless one is running (RAY_ADDRESS or ray.init)."""
    started_ray = False
    if cfg.trainer.backend == "ray":
        import ray

        if not ray.is_initialized():
            temp = os.environ.get("HFJAX_RAY_TMPDIR") or tempfile.mkdtemp(prefix="hfjax-ray-")
            ray.init(include_dashboard=False, _temp_dir=temp, log_to_driver=False)
            started_ray = True
    trainer = RLTrainer(cfg)
    try:
        return trainer.fit()
    finally:
        trainer.close()
        if started_ray:
            import ray

            ray.shutdown()


def export_run(run_dir: str | Path, step: int | None, out_dir: str | Path) -> int:
    """Writes the actor of `run_dir` at `step` (default: the latest) as a Hugging Face checkpoint; returns the step."""
    cfg = load_rl_config(Path(run_dir) / "config.yaml")
    worker = ActorRolloutRefWorker(cfg.actor, cfg.rollout, "actor", max_prompt_length=cfg.data.max_prompt_length)
    worker.init_model()
    restored = worker.load_checkpoint(str(Path(run_dir) / "checkpoints" / "actor"), step)
    worker.export_hf(str(out_dir))
    from hfjax.models import load_tokenizer

    load_tokenizer(cfg.tokenizer_path).save_pretrained(str(out_dir))
    return restored
