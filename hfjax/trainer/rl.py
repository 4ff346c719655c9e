"""`RLTrainer`: the single controller's loop for an RL run — data, roles, the algorithm program, validation,
metrics (verl's names, to console, JSONL and TensorBoard) and checkpoint/resume.

Checkpoints: each role saves its own state under `run_dir/checkpoints/<role>` first; the trainer's state (step,
data position, KL controller, Lagrange multiplier) is saved last and marks the step as complete, so a crash
midway leaves the previous complete step as the one `resume: auto` continues from.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from hfjax.config.rl import RLConfig
from hfjax.controller.liveness import WorkerHungError
from hfjax.controller.worker_group import WorkerDiedError, WorkerError
from hfjax.data import BatchLoader, PromptDataset
from hfjax.data.records import DataError
from hfjax.models import load_tokenizer
from hfjax.models.vision_lm import is_vision_language_checkpoint, load_processor
from hfjax.protocol import DataProto
from hfjax.records.checkpoint import CheckpointError, CheckpointManager, CheckpointSaveError, UnreadableStepError
from hfjax.records.metrics import MetricsLogger
from hfjax.records.run_dir import RunDirLock, disk_failure, save_run_config
from hfjax.trainer.health import RunHealth
from hfjax.trainer.placement import spawn_roles
from hfjax.trainer.preemption import Preempted, SigtermGuard, abandoned_message, saved_message, training_guard
from hfjax.trainer.programs import program_for
from hfjax.trainer.rl_metrics import data_metrics
from hfjax.trainer.roles import ControllerState, Roles, group_names
from hfjax.trainer.rollout_stream import RolloutStream
from hfjax.trainer.step import Step
from hfjax.trainer.timeline import Timeline, truncate
from hfjax.typed_config import ConfigError, to_dict

log = logging.getLogger(__name__)
TRAINED_ROLES = ("actor", "critic", "cost_critic")
TIMELINE_FILE = "timeline.jsonl"  # what ran when on which worker group (`hfjax plot` draws it)


def _as_proto(batch: Any) -> DataProto:
    return DataProto.from_dict(batch.tensors, batch.non_tensors)


def _save_failure(error: BaseException) -> str | None:
    """What a `CheckpointSaveError` says, raised here or by a worker (which the worker group reports as a
    `WorkerError` carrying the worker's traceback, whose last such line is the error); None for other errors."""
    if isinstance(error, CheckpointSaveError):
        return str(error)
    if isinstance(error, (WorkerDiedError, WorkerHungError)):
        return None
    lines = [line for line in str(error).splitlines() if f"{CheckpointSaveError.__name__}: " in line]
    return lines[-1].split(f"{CheckpointSaveError.__name__}: ", 1)[1] if lines else None


class RLTrainer:
    """Builds everything from an `RLConfig` (roles start here) and runs `fit()`."""

    def __init__(self, cfg: RLConfig, lock: RunDirLock | None = None):
        """`lock`: the run directory's lock when the caller took it already (`run_rl` takes it first)."""
        self.cfg = cfg
        self.run_dir = Path(cfg.trainer.run_dir)
        self.roles = Roles({})
        self.pools: list[Any] = []
        self.logger: MetricsLogger | None = None
        self.state_checkpoints: CheckpointManager | None = None
        self.lock = lock or RunDirLock(self.run_dir).acquire()  # before anything in the directory is touched
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        cfg = self.cfg
        data = cfg.data
        self.tokenizer = load_tokenizer(cfg.tokenizer_path)
        options = {"max_prompt_length": data.max_prompt_length, "truncation": data.truncation}
        if is_vision_language_checkpoint(cfg.actor.model_path):  # prompt rows may carry images
            options |= {"processor": load_processor(cfg.tokenizer_path), "max_images": data.max_images}
        self.train_data = PromptDataset(data.train_files, self.tokenizer, **options)
        if len(self.train_data) < data.train_batch_size:
            raise DataError(
                f"data.train_batch_size={data.train_batch_size}: expected at most the {len(self.train_data)} prompts "
                f"of data.train_files ({self.train_data.num_filtered} longer than data.max_prompt_length filtered)"
            )
        self.loader = BatchLoader(self.train_data, data.train_batch_size, seed=data.seed, shuffle=data.shuffle)
        self.val_data = PromptDataset(data.val_files, self.tokenizer, **options) if data.val_files else None
        self.state = ControllerState.from_config(cfg, self.tokenizer)
        self.program = program_for(cfg.algorithm)
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.state_checkpoints = CheckpointManager(self.checkpoint_dir / "trainer", max_to_keep=cfg.trainer.max_to_keep)
        saved = self.state_checkpoints.all_steps()
        if saved and cfg.trainer.resume == "never":
            raise ConfigError(
                f"trainer.resume=never but {self.state_checkpoints.directory} holds checkpoints {saved}; choose "
                "another trainer.run_dir or set trainer.resume=auto"
            )
        handles, self.pools = spawn_roles(cfg)
        self.roles = Roles(handles, cfg.algorithm.source)
        self.role_info = {name: handle.init_model() for name, handle in self.roles.items()}
        self.gen_role = "rollout" if cfg.disaggregated else "actor"
        self.timeline = Timeline(self.run_dir / TIMELINE_FILE)
        self.loader_states: dict[int, dict[str, Any]] = {}  # before the prompts of each step were taken
        self.health = RunHealth(cfg.trainer.health)
        self.step = 0
        self.saved_step: int | None = None  # the newest complete checkpoint
        self.step_in_flight = 1

    # ------------------------------------------------------------------------------------------------ loop
    def _batches(self) -> Iterator[DataProto]:
        while True:
            yield from (_as_proto(b) for b in self.loader)

    def _prompts(self, batches: Iterator[DataProto], step: int) -> DataProto:
        """The next batch of prompts, for `step`; remembers the loader position before it (for checkpoints)."""
        self.loader_states[step] = self.loader.state_dict()
        return next(batches)

    def fit(self) -> list[dict[str, float]]:
        """Runs the remaining steps up to `trainer.total_steps`; returns the logged metrics of each step. On SIGTERM
        it saves the step in flight once finished and raises `Preempted` (`hfjax.trainer.preemption`). A file of the
        run directory that cannot be written (a full or read-only disk) raises `DiskWriteError`."""
        self.saved_step = self.state_checkpoints.latest_step()
        self.step_in_flight = self.step + 1
        with training_guard(self.cfg.trainer.preemption_grace_s) as sigterm:
            try:
                return self._fit(sigterm)
            except BaseException as exc:
                abandoned = sigterm.abandonment(exc)
                if abandoned is not None:
                    raise Preempted(abandoned_message(abandoned, self.step_in_flight, self.saved_step)) from None
                failure = disk_failure(exc, self.run_dir, self.saved_step)
                if failure is None:
                    raise
                raise failure from exc

    def _fit(self, sigterm: SigtermGuard) -> list[dict[str, float]]:
        trainer = self.cfg.trainer
        if trainer.resume == "auto":
            self.resume()
        save_run_config(self.cfg, self.run_dir)  # every check passed and the checkpoints (if any) restored
        self.logger = self._metrics_logger()
        history = []
        if trainer.val_before_train and self.val_data is not None and self.step == 0:
            self.logger.log(0, self.validate())
        batches, fit_started_at = self._batches(), self.timeline.now()
        stream = None
        if self.cfg.disaggregated:
            stream = RolloutStream(self.cfg, self.roles, lambda k: self._prompts(batches, k), self.timeline)
            stream.sync(self.step)
        bar = tqdm(range(self.step, trainer.total_steps), desc="rl", unit="step", disable=not trainer.progress)
        for step in bar:
            if sigterm.requested:
                raise Preempted(self._save_on_preemption())
            self.step_in_flight = step + 1
            started, started_at = time.perf_counter(), self.timeline.now()
            self.state.scorer.reset()
            if stream is None:
                prompts = self._prompts(batches, step)
                current = Step(self.cfg, self.roles, prompts, step, self.state, timeline=self.timeline)
            else:
                pending = stream.take(step)
                current = Step(self.cfg, self.roles, pending.prompts, step, self.state, pending, self.timeline)
            self.program(current)
            self.step = step + 1
            if stream is not None:
                stream.sync(self.step)  # queued behind the generation already under way
            metrics = {**current.metrics, **data_metrics(current.batch, self.cfg.uses_critic)}
            metrics["timing_s/step"] = time.perf_counter() - started
            if self.state.scorer.rule_reward is not None:
                metrics["reward/errors"] = float(self.state.scorer.errors)
            tokens = float(current.batch.batch["attention_mask"].sum())
            metrics["perf/total_num_tokens"] = tokens
            metrics["perf/throughput"] = tokens / metrics["timing_s/step"]
            metrics["perf/samples_per_s"] = len(current.batch) / metrics["timing_s/step"]
            metrics.update(
                self.timeline.step_metrics(step, started_at, self.timeline.now(), self.timeline_lanes(step=True))
            )
            if self.step == trainer.total_steps:  # every rollout has been taken: the whole run's idle fractions
                lanes = self.timeline_lanes(step=False)
                run = self.timeline.step_metrics(step, fit_started_at, self.timeline.now(), lanes)
                metrics.update({k.replace("timeline/", "timeline/run_"): v for k, v in run.items()})
            due = trainer.test_freq and self.step % trainer.test_freq == 0
            if self.val_data is not None and (due or self.step == trainer.total_steps):
                metrics.update(self.validate())
            if (trainer.save_freq and self.step % trainer.save_freq == 0) or self.step == trainer.total_steps:
                self.save()
            self.logger.log(self.step, metrics)
            history.append(metrics)
            self.health.observe(self.step, metrics, current.batch.batch["scores"])
            bar.set_postfix({"score": f"{metrics.get('critic/score/mean', 0):.3f}"})
        if stream is not None:
            stream.drain()
        return history

    def _save_on_preemption(self) -> str:
        """Saves the last finished step unless `save_freq` just did; returns what `Preempted` says."""
        if self.step and self.saved_step != self.step:
            self.save()
        return saved_message(self.step)

    def _metrics_logger(self) -> MetricsLogger:
        """The `trainer.logger` destinations; records after the restored step, from an interrupted run, are dropped
        (JSONL) and purged (TensorBoard)."""
        trainer, step = self.cfg.trainer, self.step
        sinks = []
        if "wandb" in trainer.logger:
            from hfjax.records.wandb_sink import WandbSink

            experiment = trainer.experiment_name or self.run_dir.resolve().name
            sinks.append(WandbSink(self.run_dir, trainer.project_name, experiment, to_dict(self.cfg), step))
        return MetricsLogger(
            self.run_dir,
            console="console" in trainer.logger,
            jsonl="jsonl" in trainer.logger,
            tensorboard="tensorboard" in trainer.logger,
            sinks=sinks,
            start_step=step,
        )

    def timeline_lanes(self, step: bool) -> list[str]:
        """The timeline's lanes: one per worker group, and the controller. For the metrics of one `step` an
        asynchronous run leaves out the rollout group, whose spans are recorded when their rollout is taken, up to
        `async.max_staleness` steps after they ran."""
        lanes = group_names(self.cfg)
        skip = {lanes["rollout"]} if step and self.cfg.async_.max_staleness else set()
        return [lane for lane in [*dict.fromkeys(lanes.values()), "controller"] if lane not in skip]

    def validate(self) -> dict[str, float]:
        """Greedy responses on the validation set; the mean rule score per data source (`val/test_score/<src>`)."""
        loader = BatchLoader(self.val_data, self.cfg.data.val_batch_size, shuffle=False, drop_last=False)
        sources, scores = [], []
        for batch in loader:
            prompts = _as_proto(batch)
            out = self.roles[self.gen_role].generate_sequences(
                DataProto(prompts.batch, prompts.non_tensor_batch, {"do_sample": False})
            )
            rows = DataProto(out.batch, prompts.non_tensor_batch, {})
            scores.append(Step(self.cfg, self.roles, prompts, self.step, self.state).sequence_scores(rows))
            sources.extend(prompts.non_tensor_batch["data_source"])
        scores_all, sources_all = np.concatenate(scores), np.array(sources)
        return {f"val/test_score/{s}": float(scores_all[sources_all == s].mean()) for s in sorted(set(sources))}

    # ------------------------------------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        """Saves every trained role's state, then the trainer's record, which marks the step complete. A write that
        fails (no space left, no permission) stops the run with a `CheckpointSaveError` naming the step kept."""
        try:
            self._save_step()
        except (CheckpointSaveError, WorkerError) as e:
            failure = _save_failure(e)
            if failure is None:
                raise
            kept = (
                f"step {self.saved_step} is the last complete checkpoint, and a resumed run continues from it"
                if self.saved_step
                else "no step was saved before it"
            )
            raise CheckpointSaveError(
                f"checkpoint of step {self.step} not saved: {failure}; {kept}: free space (or fix the permissions) "
                f"under {self.checkpoint_dir}, then run the same command",
                self.step,
            ) from None

    def _save_step(self) -> None:
        keep = self.cfg.trainer.max_to_keep
        for name in self.trained_roles():
            self.roles[name].save_checkpoint(str(self.checkpoint_dir / name), self.step, keep)
        for name in self.trained_roles():
            self.roles[name].wait_for_checkpoint()
        state = {"loader": self.loader_states.get(self.step, self.loader.state_dict()), **self.state.state_dict()}
        self.state_checkpoints.save(self.step, {}, state)
        self.state_checkpoints.wait()
        self.saved_step = self.step

    def trained_roles(self) -> list[str]:
        return [name for name in TRAINED_ROLES if name in self.roles]

    def resume(self) -> None:
        """Continues from the newest step that the trainer's record and every trained role can restore. A step
        unreadable for any of them is set aside (`<step>.unreadable`) with a warning naming the role and the error,
        and the step before it is tried; steps newer than the restored one are discarded, so every role and the
        record continue from the same step."""
        skipped: list[str] = []
        for step in reversed(self.state_checkpoints.all_steps()):
            try:
                _, _, state = self.state_checkpoints.restore(step, {})
                problem = self._restore_roles(step)
            except UnreadableStepError as e:
                self.state_checkpoints.set_aside(step)
                problem = f"the trainer's record is unreadable ({e})"
            if problem is None:
                self._continue_from(step, state)
                return
            skipped.append(f"step {step}: {problem}")
            log.warning("resume: step %d cannot be restored: %s; falling back to the previous step", step, problem)
        if skipped:
            raise CheckpointError(f"{self.checkpoint_dir}: no step can be restored by every role: {'; '.join(skipped)}")

    def _restore_roles(self, step: int) -> str | None:
        """Restores every trained role at `step`; returns the first role's reason when one cannot."""
        for name in self.trained_roles():
            reasons = [r for r in self.roles[name].try_load_checkpoint(str(self.checkpoint_dir / name), step) if r]
            if reasons:
                return f"{name}: {reasons[0]}"
        return None

    def _continue_from(self, step: int, state: dict[str, Any]) -> None:
        for name in self.trained_roles():
            self.roles[name].discard_checkpoints_after(str(self.checkpoint_dir / name), step)
        self.state_checkpoints.discard_after(step)
        self.loader.load_state_dict(state["loader"])
        self.state.load_state_dict(state)
        self.step = self.saved_step = step
        truncate(self.run_dir / TIMELINE_FILE, step - 1)
        log.info("resumed %s from step %d", self.run_dir, step)

    def close(self) -> None:
        """Stops the workers, closes the logs and releases the run directory."""
        try:
            for handle in {id(h.group): h.group for h in self.roles.values()}.values():
                handle.shutdown()
            for pool in self.pools:
                pool.release()
            if self.state_checkpoints is not None:
                self.state_checkpoints.close()
        finally:
            try:
                if self.logger is not None:
                    self.logger.close()
            finally:
                self.lock.release()
