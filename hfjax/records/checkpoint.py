"""`CheckpointManager`: numbered, atomic orbax checkpoints of named pytrees plus a JSON `extra` record, restored
into any shardings, falling back past an unreadable latest step.

A step is written into a temporary directory and renamed into place once complete (orbax's commit), with the JSON
record inside it, so a crash midway leaves the previous steps untouched; leftover temporary directories are ignored
and cleaned up. Each pytree is stored as a flat mapping from its leaves' key paths (`model.layers.0.mlp...`) to
arrays, so any pytree (nnx `State`, optax states) round-trips and is rebuilt with the restore target's structure.
Only the newest `max_to_keep` steps are kept; saving a step number that exists replaces it (a run resumed from an
earlier step re-saves the steps after it); an unreadable step found by `restore(None, ...)` is renamed
`<step>.unreadable` (kept for inspection); a target whose tree or shapes differ from the saved ones is a caller error
(named leaves, nothing set aside). A restore that fails lets orbax's other reads of the step end before their event
loop closes (no asyncio tracebacks after the step's one warning).

Every step records the SHA-256 of its files (`checksums.MANIFEST`, written by process 0 on a thread once
orbax has committed the step; `wait()` waits for it too). A restore first checks them: a step whose files changed is
unreadable, named with its files, and set aside like a truncated one; a step without them (saved before hfjax
recorded checksums, or stopped before they were written) is restored unverified, with a note in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from hfjax.models.config import VOCAB_MULTIPLE
from hfjax.records import checksums

log = logging.getLogger(__name__)

RECORD = "record"  # the JSON item: {"extra": ..., "keys": {item: [leaf key, ...]}}


class CheckpointError(RuntimeError):
    """No readable checkpoint, or one that does not match what is restored into it."""


class CheckpointSaveError(CheckpointError):
    """Writing a step failed (no space left on the device, no permission): the steps committed before it are intact
    (a step is renamed into place only once complete). One line; `step` names the step that failed."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class UnreadableStepError(CheckpointError):
    """A step that exists but cannot be read (damaged or partly deleted files); `step` names it."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


def flatten(tree: Any) -> dict[str, Any]:
    """`{key path: leaf}` with paths like `model.layers.0.mlp.up_kernel.value`; raises if two paths collide."""
    flat: dict[str, Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = jax.tree_util.keystr(path, simple=True, separator=".")
        if key in flat:
            raise CheckpointError(f"two leaves share the checkpoint key {key!r}; rename one of them")
        flat[key] = leaf
    return flat


def _unflatten_like(target: Any, flat: Mapping[str, Any]) -> Any:
    paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    return jax.tree_util.tree_unflatten(
        treedef, [flat[jax.tree_util.keystr(p, simple=True, separator=".")] for p, _ in paths]
    )


class CheckpointManager:
    """Steps of `{name: pytree}` plus `extra` (JSON-able) under `directory`; async saves (call `wait()` before
    reading them from another process or exiting)."""

    def __init__(self, directory: str | Path, max_to_keep: int = 3, *, async_save: bool = True):
        if not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(f"max_to_keep: expected a positive int, got {max_to_keep!r}")
        self.directory = Path(directory).absolute()
        self.max_to_keep = max_to_keep
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, cleanup_tmp_directories=True, enable_async_checkpointing=async_save
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._saving: int | None = None  # the step of the latest save started
        self._checksummer = ThreadPoolExecutor(1, thread_name_prefix="hfjax-checkpoint-checksums")
        self._checksummed: Future[None] | None = None  # the latest save's commit, then its checksums

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, items: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> None:
        """Starts saving `items` (name -> pytree of arrays) and `extra` as step `step`; returns once the arrays are
        copied off the devices (they may then be donated or deleted). An existing step of that number (left by a run
        that went further before this one resumed from an earlier step) is replaced."""
        if RECORD in items:
            raise ValueError(f"CheckpointManager.save: item name {RECORD!r} is reserved for the JSON record")
        self.wait()
        if step in self.all_steps():
            log.info("replacing checkpoint step %d in %s", step, self.directory)
            self._manager.delete(step)
        record = {"extra": dict(extra or {}), "keys": {}}
        args: dict[str, Any] = {}
        for name, tree in items.items():
            flat = flatten(tree)
            record["keys"][name] = list(flat)
            args[name] = ocp.args.StandardSave(flat)
        try:
            json.dumps(record)
        except (TypeError, ValueError) as e:
            raise ValueError(f"CheckpointManager.save: extra must be JSON-serialisable ({e})") from e
        args[RECORD] = ocp.args.JsonSave(record)
        self._saving = step
        try:
            self._manager.save(step, args=ocp.args.Composite(**args), force=True)
        except OSError as e:
            raise self._save_failed(e) from e
        self._checksummed = self._checksummer.submit(self._write_checksums, step)

    def _write_checksums(self, step: int) -> None:
        """Waits for orbax to commit step `step` (its files are then final), then records their checksums."""
        self._manager.wait_until_finished()
        if jax.process_index() == 0:
            checksums.write_manifest(self.directory / str(step))

    def wait(self) -> None:
        """Blocks until in-flight saves are committed with their checksums. A save that failed in the background
        (tensorstore reports a full disk as `ValueError: RESOURCE_EXHAUSTED ... [os_error_code='28']`) raises
        `CheckpointSaveError`."""
        try:
            if self._checksummed is not None:
                checksummed, self._checksummed = self._checksummed, None
                checksummed.result()
            self._manager.wait_until_finished()
        except Exception as e:
            raise self._save_failed(e) from e

    def _save_failed(self, error: Exception) -> CheckpointSaveError:
        step = self._saving
        intact = [s for s in self._committed_steps() if s != step]
        kept = (
            f"the steps before it ({', '.join(map(str, intact))}) are intact"
            if intact
            else "no step was saved before it"
        )
        return CheckpointSaveError(f"{self.directory}: writing step {step} failed ({_os_reason(error)}); {kept}", step)

    def _committed_steps(self) -> list[int]:
        """The step directories on disk (a failed save leaves only a temporary directory, which is not one)."""
        if not self.directory.is_dir():
            return []
        return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and p.is_dir())

    def restore(self, step: int | None, targets: Mapping[str, Any]) -> tuple[int, dict[str, Any], dict[str, Any]]:
        """`(step, items, extra)`: each target (a pytree of `jax.ShapeDtypeStruct` with `sharding`) filled from
        the checkpoint, placed on the target's shardings (any layout). `step=None` takes the newest readable step:
        an unreadable one is logged, set aside and the previous one tried. A target whose leaves differ from the
        saved tree raises `CheckpointError` naming them."""
        self.wait()
        steps = self.all_steps()
        if step is not None and step not in steps:
            raise CheckpointError(f"{self.directory}: no step {step}; saved steps are {steps}")
        if not steps:
            raise CheckpointError(f"{self.directory}: no checkpoint to restore")
        candidates = [step] if step is not None else steps[::-1]
        for candidate in candidates:
            try:
                with _loops_that_finish_their_tasks():
                    items, extra = self._restore_step(candidate, targets)
                return candidate, items, extra
            except _Mismatch as e:
                raise CheckpointError(f"{self.directory / str(candidate)}: {e}") from e
            except Exception as e:  # orbax, tensorstore and json raise many types for damaged files
                if step is not None:
                    raise UnreadableStepError(
                        f"{self.directory / str(candidate)}: unreadable ({type(e).__name__}: {str(e)[:300]})", candidate
                    ) from e
                log.warning(
                    "checkpoint step %d in %s is unreadable (%s: %.200s); falling back to the previous step",
                    candidate,
                    self.directory,
                    type(e).__name__,
                    str(e),
                )
                self.set_aside(candidate)
        raise CheckpointError(f"{self.directory}: none of the steps {steps} is readable")

    def _restore_step(self, step: int, targets: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        if not checksums.verify(self.directory / str(step)):
            log.info(
                "checkpoint step %d in %s has no checksums (saved before hfjax recorded them, or stopped before they "
                "were written); restoring it unverified",
                step,
                self.directory,
            )
        record = self._manager.restore(step, args=ocp.args.Composite(**{RECORD: ocp.args.JsonRestore()}))[RECORD]
        flat_targets = {name: flatten(tree) for name, tree in targets.items()}
        for name, flat in flat_targets.items():
            saved = record["keys"].get(name)
            if saved is None:
                raise _Mismatch(f"no item {name!r}; the checkpoint has {sorted(record['keys'])}")
            missing, unexpected = sorted(set(saved) - set(flat)), sorted(set(flat) - set(saved))
            if missing or unexpected:
                raise _Mismatch(
                    f"item {name!r} does not match the restore target: saved but not in the target {missing[:5]}"
                    f"{'...' if len(missing) > 5 else ''}, in the target but not saved {unexpected[:5]}"
                    f"{'...' if len(unexpected) > 5 else ''}"
                )
            self._check_shapes(step, name, flat)
        args = {name: ocp.args.StandardRestore(flat) for name, flat in flat_targets.items()}
        restored = self._manager.restore(step, args=ocp.args.Composite(**args))
        items = {name: _unflatten_like(targets[name], restored[name]) for name in targets}
        return items, record["extra"]

    def _check_shapes(self, step: int, name: str, flat: Mapping[str, Any]) -> None:
        """Raises `_Mismatch` naming the leaves whose saved shape differs from the target's (read from the saved
        metadata; unreadable metadata is left to the restore, which then reports the damage)."""
        try:
            saved = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / name).tree
        except Exception:  # damaged metadata: the restore itself fails and the step is handled as unreadable
            return
        differ = {
            key: (tuple(saved[key].shape), tuple(target.shape))
            for key, target in flat.items()
            if key in saved and tuple(getattr(saved[key], "shape", target.shape)) != tuple(target.shape)
        }
        if not differ:
            return
        shown = ", ".join(f"{key}: saved {a}, target {b}" for key, (a, b) in list(differ.items())[:3])
        padded = any(
            a[0] != b[0] and b[0] % VOCAB_MULTIPLE == 0 and a[0] % VOCAB_MULTIPLE and a[1:] == b[1:]
            for a, b in differ.values()
        )
        hint = (
            f"; the checkpoint predates vocabulary padding (embedding and LM head rows are now stored padded to a "
            f"multiple of {VOCAB_MULTIPLE}): export it with the hfjax version that wrote it and start from that"
            if padded
            else ""
        )
        raise _Mismatch(f"item {name!r}: {len(differ)} leaves differ in shape ({shown}){hint}")

    def discard_after(self, step: int) -> list[int]:
        """Deletes the committed steps newer than `step` (left by a save that did not complete everywhere, e.g. a
        role saved but the run's record did not); returns them."""
        self.wait()
        newer = [s for s in self.all_steps() if s > step]
        for s in newer:
            self._manager.delete(s)
        return newer

    def set_aside(self, step: int) -> None:
        """Renames step `step` to `<step>.unreadable` (kept for inspection, no longer a step)."""
        self.wait()
        if jax.process_index() == 0 and (self.directory / str(step)).exists():
            source = self.directory / str(step)
            target = self.directory / f"{step}.unreadable"
            suffix = 1
            while target.exists():
                target, suffix = self.directory / f"{step}.unreadable{suffix}", suffix + 1
            source.rename(target)
        self._manager.reload()

    def close(self) -> None:
        """Waits for in-flight saves and their checksums and releases orbax's threads."""
        try:
            self.wait()
        finally:
            self._checksummer.shutdown()
            self._manager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _os_reason(error: Exception) -> str:
    """The operating system's reason for `error` ("No space left on device") when it names one, else its type and
    first line."""
    code = getattr(error, "errno", None)
    if code is None:
        found = re.search(r"os_error_code='?(\d+)", str(error))
        code = int(found.group(1)) if found else None
    if code:
        return f"{os.strerror(code)}, errno {code}"
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"


class _TaskFinishingEventLoop(asyncio.SelectorEventLoop):
    """An event loop that, when closed, first lets its unfinished tasks end and collects their errors.

    Orbax restores a step's arrays concurrently on a fresh event loop and closes it as soon as one read fails (a
    damaged file), with the other reads still in flight: their results would then reach a closed loop (tensorstore
    prints "RuntimeError: Event loop is closed") and their errors would never be retrieved (asyncio logs "Task
    exception was never retrieved"), tracebacks printed after the step was already reported and set aside."""

    def close(self) -> None:
        if not self.is_running() and not self.is_closed():
            self.run_until_complete(_finish_other_tasks())
        super().close()


async def _finish_other_tasks() -> None:
    """Awaits every other task of the running loop, its errors collected, until none is left."""
    current = asyncio.current_task()
    while others := asyncio.all_tasks() - {current}:
        await asyncio.gather(*others, return_exceptions=True)


_NEW_LOOP_LOCK = threading.Lock()


@contextlib.contextmanager
def _loops_that_finish_their_tasks() -> Iterator[None]:
    """While open, `asyncio.new_event_loop()` (on which orbax runs each restore) returns a `_TaskFinishingEventLoop`;
    the event loop policy itself (its threads' current loops) is left as it is."""
    with _NEW_LOOP_LOCK:
        policy = asyncio.get_event_loop_policy()
        policy.new_event_loop = _TaskFinishingEventLoop  # this instance only, until the restore returns
        try:
            yield
        finally:
            del policy.new_event_loop


class _Mismatch(ValueError):
    """The restore target's tree differs from the saved one (a caller error, not damage)."""
