"""Running an RL config end to end: Ray start-up (when the backend is Ray and no cluster is connected), the
trainer, a final summary, and exporting a checkpoint of a finished run as a Hugging Face model.
Imports `hfjax.config`, `hfjax.workers` and this package."""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from pathlib import Path

from hfjax.config import RLConfig, load_rl_config
from hfjax.trainer.rl import RLTrainer
from hfjax.workers.actor import ActorRolloutRefWorker

log = logging.getLogger(__name__)


def connect_ray(cfg: RLConfig) -> bool:
    """Joins the Ray cluster at `trainer.ray_address` (else `RAY_ADDRESS`) or, with neither, starts a local Ray;
    returns whether this call connected (False when Ray was already initialised)."""
    import ray

    if ray.is_initialized():
        return False
    address = cfg.trainer.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        temp = os.environ.get("HFJAX_RAY_TMPDIR") or tempfile.mkdtemp(prefix="hfjax-ray-")
        ray.init(include_dashboard=False, _temp_dir=temp, log_to_driver=False)
    return True


def pin_controller_to_cpu() -> None:
    """Keeps this (the controller's) process's JAX on the host CPU: its own computations are small (advantages, KL,
    masked means), and on a GPU host it would otherwise open every GPU and preallocate most of their memory beside
    the workers (on a TPU VM the chips belong to the worker process). Warns when JAX already started elsewhere."""
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")
    elif jax.default_backend() != "cpu":
        log.warning(
            "the controller's JAX already runs on %s (initialised before the run started); its arrays take "
            "accelerator memory beside the workers'. Set JAX_PLATFORMS=cpu in the driver to avoid it",
            jax.default_backend(),
        )


def run_rl(cfg: RLConfig) -> list[dict[str, float]]:
    """Trains; for `backend: ray` connects to Ray first (`connect_ray`) unless this process already has, and keeps
    the controller's JAX on the CPU (`pin_controller_to_cpu`)."""
    if cfg.trainer.backend == "ray":
        pin_controller_to_cpu()
    started_ray = cfg.trainer.backend == "ray" and connect_ray(cfg)
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
    # this process's devices, whatever hosts and layout trained it: the checkpoint restores into any sharding
    actor = dataclasses.replace(cfg.actor, train_layout=None)
    worker = ActorRolloutRefWorker(actor, cfg.rollout, "actor", max_prompt_length=cfg.data.max_prompt_length)
    worker.init_model()
    restored = worker.load_checkpoint(str(Path(run_dir) / "checkpoints" / "actor"), step)
    worker.export_hf(str(out_dir))
    from hfjax.models import load_tokenizer

    load_tokenizer(cfg.tokenizer_path).save_pretrained(str(out_dir))
    return restored
