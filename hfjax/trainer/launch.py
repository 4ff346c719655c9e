"""Running an RL config end to end: Ray start-up (when the backend is Ray and no cluster is connected), the
trainer, a final summary, and exporting a checkpoint of a finished run as a Hugging Face model."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from hfjax.config.rl import RLConfig, load_rl_config
from hfjax.records.run_dir import RunDirLock
from hfjax.trainer.preemption import SigtermGuard, stopped_by_sigterm
from hfjax.trainer.preflight import check_rl_run, resolve_hub_models
from hfjax.trainer.rl import RLTrainer
from hfjax.typed_config import ConfigError
from hfjax.workers.actor import ActorRolloutRefWorker

log = logging.getLogger(__name__)


# Ray's settings that stop it starting idle worker processes ahead of the first task: each hfjax worker has a runtime
# environment of its own (`ResourcePool.process_env`), which a process started without it cannot serve, so those
# processes only cost CPU (a Python and Ray import each) beside the workers' start-up.
NO_PRESTARTED_WORKERS = {"prestart_worker_first_driver": False, "enable_worker_prestart": False}


@contextlib.contextmanager
def ray_session(cfg: RLConfig) -> Iterator[None]:
    """Ray for one run. With Ray already initialised in this process it is used as it is. Otherwise this joins the
    cluster at `trainer.ray_address` (else `RAY_ADDRESS`), or starts a Ray of this machine alone whose servers listen
    on the loopback interface only (`_start_local_ray`); either is shut down at the end. Workers' output reaches this
    console, each line prefixed by its worker class, rank and pid. A local Ray's temp directory
    is removed after a run that succeeded or was preempted and kept, with its path logged, after one that failed (its
    logs). This process's SIGTERM handler (the run's `SigtermGuard`) stays in place (`_sigterm_handler_kept`)."""
    import ray

    if ray.is_initialized():
        yield
        return
    address = cfg.trainer.ray_address or os.environ.get("RAY_ADDRESS")
    temp = None if address else os.environ.get("HFJAX_RAY_TMPDIR") or tempfile.mkdtemp(prefix="hfjax-ray-")
    failed = False
    try:
        with _sigterm_handler_kept():
            if address:
                ray.init(address=address)
            else:
                _start_local_ray(temp, streams_tpu_logs=cfg.trainer.device == "tpu")
        yield
    except BaseException as exc:
        failed = not stopped_by_sigterm(exc)
        if failed and temp is not None:
            log.error("Ray's logs of this run are kept in %s", temp)
        raise
    finally:
        ray.shutdown()
        if temp is not None and not failed and not os.environ.get("HFJAX_RAY_TMPDIR"):
            shutil.rmtree(temp, ignore_errors=True)


@contextlib.contextmanager
def _sigterm_handler_kept() -> Iterator[None]:
    """Keeps this process's SIGTERM handler while Ray starts: `ray.init` installs one that calls `sys.exit`, which a
    SIGTERM then raises inside Ray's own calls (the driver aborts with Ray's crash dump instead of stopping cleanly)."""
    from ray._private import utils as ray_utils

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = signal.getsignal(signal.SIGTERM)
    install, ray_utils.set_sigterm_handler = ray_utils.set_sigterm_handler, lambda _: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = install
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)


def _start_local_ray(temp: str, streams_tpu_logs: bool) -> None:
    """Starts Ray on this machine with every server bound to 127.0.0.1. Ray resolves "localhost" to the machine's
    network address unless clusters are off (its switch for platforms without clusters), so it is switched off while
    Ray starts; `tests/test_faults.py` checks that every socket Ray listens on is a loopback one. Ray starts no idle
    worker processes ahead of time (`NO_PRESTARTED_WORKERS`). Ray streams every file of libtpu's log directory
    (`TPU_LOG_DIR`, else /tmp/tpu_logs) to this console; unless the run is on TPU (`streams_tpu_logs`) it is shown
    an empty one instead (after `hfjax compile` for a TPU target on this machine, /tmp/tpu_logs can hold hundreds of
    MB of compile logs; with `trainer.device: auto` they stay in that directory, off the console)."""
    import ray
    from ray._private import ray_constants

    clusters = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    tpu_logs = os.environ.get("TPU_LOG_DIR")
    if not streams_tpu_logs:
        os.environ["TPU_LOG_DIR"] = os.path.join(temp, "no-tpu-logs")
        os.makedirs(os.environ["TPU_LOG_DIR"], exist_ok=True)
    try:
        ray.init(include_dashboard=False, _temp_dir=temp, _system_config=NO_PRESTARTED_WORKERS)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = clusters
        if tpu_logs is None:
            os.environ.pop("TPU_LOG_DIR", None)
        else:
            os.environ["TPU_LOG_DIR"] = tpu_logs


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
    """Resolves Hub ids (`resolve_hub_models`), checks the run (`check_rl_run`) and takes the run directory's lock
    (which checks that the directory takes files and has space), then trains; for `backend: ray` in a `ray_session`
    (started after the lock), with the controller's JAX on the CPU (`pin_controller_to_cpu`). One `SigtermGuard`
    covers it all: a SIGTERM before the training loop stops the run at once (`hfjax.trainer.preemption`)."""
    with SigtermGuard(cfg.trainer.preemption_grace_s, starting=True):
        cfg = resolve_hub_models(cfg)  # Hub ids to local snapshots, on this (the controller's) host
        check_rl_run(cfg)  # files, models, lengths, memory and data: before Ray or any worker starts
        if cfg.trainer.backend == "local":
            check_local_devices(cfg.trainer.devices_per_host)
        with RunDirLock(cfg.trainer.run_dir) as lock:  # before Ray: a second run on the directory starts nothing
            if cfg.trainer.backend != "ray":
                return _train(cfg, lock)
            pin_controller_to_cpu()
            with ray_session(cfg):
                return _train(cfg, lock)


def check_local_devices(devices_per_host: int) -> None:
    """`backend: local` runs every role in this process, over all of its devices: they must be the
    `trainer.devices_per_host` that the memory check and the default layouts counted (8 fake CPU devices under a
    config of 1 would hold 8 replicas of every program's buffers in one host's RAM)."""
    import jax

    found = jax.local_device_count()
    if found != devices_per_host:
        raise ConfigError(
            f"trainer.devices_per_host={devices_per_host}, but backend local runs on every device of this process"
            f" and it has {found} ({jax.default_backend()}): set trainer.devices_per_host={found}, or start the"
            " process with that many devices (CUDA_VISIBLE_DEVICES, TPU_VISIBLE_CHIPS, or"
            " XLA_FLAGS=--xla_force_host_platform_device_count for CPU)"
        )


def _train(cfg: RLConfig, lock: RunDirLock) -> list[dict[str, float]]:
    trainer = RLTrainer(cfg, lock)
    try:
        history = trainer.fit()
    except BaseException:
        close_after_failure(trainer)
        raise
    trainer.close()
    if cfg.trainer.plot and "jsonl" in cfg.trainer.logger:
        from hfjax.records.plot import plot_finished_run

        plot_finished_run(cfg.trainer.run_dir)
    return history


def close_after_failure(trainer: RLTrainer) -> None:
    """Closes a run that stopped on an error, Ctrl-C or SIGTERM. A failure while closing (a checkpoint save cut
    short by the interrupt, say) is logged, so that what stopped the run stays what the caller sees: Ctrl-C still
    exits 130, not as a checkpoint error."""
    try:
        trainer.close()
    except Exception as exc:
        log.warning("closing the stopped run also failed: %s", exc)


def export_run(run_dir: str | Path, step: int | None, out_dir: str | Path, adapters: bool = False) -> int:
    """Writes the actor of `run_dir` at `step` (default: the latest) as a Hugging Face checkpoint (a LoRA actor's
    adapters merged), or with `adapters` a LoRA actor's adapters as a PEFT adapter directory; returns the step."""
    cfg = load_rl_config(Path(run_dir) / "config.yaml")
    if adapters and not cfg.actor.lora.enabled:
        raise ValueError(f"export --adapters: the actor of {run_dir} has no LoRA adapters (actor.lora.rank is 0)")
    # this process's devices, whatever hosts and layout trained it: the checkpoint restores into any sharding
    actor = dataclasses.replace(cfg.actor, train_layout=None)
    worker = ActorRolloutRefWorker(actor, cfg.rollout, "actor", max_prompt_length=cfg.data.max_prompt_length)
    worker.init_model()
    restored = worker.load_checkpoint(str(Path(run_dir) / "checkpoints" / "actor"), step)
    worker.export_hf(str(out_dir), adapters)
    from hfjax.models import load_tokenizer
    from hfjax.models.vision_lm import is_vision_language_checkpoint, load_processor

    # a vision-language policy's processor (its tokenizer and image settings), as the trainer read its prompts with
    vision = is_vision_language_checkpoint(cfg.actor.model_path)
    (load_processor if vision else load_tokenizer)(cfg.tokenizer_path).save_pretrained(str(out_dir))
    return restored
