"""Run-directory safety: one run at a time per directory (`RunDirLock`), a directory that takes new files and has
space for them (checked when the lock is taken, before Ray or any worker starts), and the run's `config.yaml`
written without losing the one it replaces (`save_run_config`). A write that fails for a full or read-only disk is a
`DiskWriteError`: one line naming the path and the operating system's reason.

The lock is an advisory `flock` on `run_dir/.lock`, which records the holder's pid, host and start time. The kernel
drops it when its process dies, however it dies (kill -9 included), so a lock left by a dead run is free to take; the
record it leaves is named in the log when a new run takes over. A second run on a held directory fails at once with
`RunDirLockedError` naming the holder. `flock` does not guard one directory shared by two machines over a network file
system that lacks it; there the recorded host tells the user who holds it.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hfjax.typed_config import dump_yaml

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
CONFIG_FILE = "config.yaml"
MIN_FREE_BYTES = 64 * 2**20  # a run starts only with this much space free for its config, metrics and checkpoints
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})  # a full or read-only disk


class RunDirLockedError(RuntimeError):
    """Another live process holds the run directory."""


class DiskWriteError(RuntimeError):
    """A run's file could not be written (no space left, a read-only file system, no permission), or a metrics
    destination failed: one line naming the path, what failed and why."""


def os_reason(error: BaseException) -> str:
    """The operating system's reason for `error` ("No space left on device, errno 28"), else its type and first line."""
    code = getattr(error, "errno", None)
    if code:
        return f"{os.strerror(code)}, errno {code}"
    first = str(error).splitlines()[0][:200] if str(error) else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def write_failed(path: str | Path, what: str, error: BaseException) -> DiskWriteError:
    """`DiskWriteError` saying that `what` failed at `path`, and why."""
    return DiskWriteError(f"{path}: {what} failed ({os_reason(error)})")


@contextlib.contextmanager
def writing(path: str | Path, what: str) -> Iterator[None]:
    """Turns an `OSError` of the block into `write_failed` at the error's file, else at `path`."""
    try:
        yield
    except OSError as exc:
        raise write_failed(exc.filename or path, what, exc) from exc


def disk_failure(error: BaseException, run_dir: str | Path, saved_step: int | None) -> DiskWriteError | None:
    """What a run that stopped on `error` says when a file of `run_dir` could not be written (a `DiskWriteError`, or
    an `OSError` of a full or read-only disk): the path, the reason and the step a resumed run continues from (the
    newest complete checkpoint, `saved_step`). None for other errors."""
    if isinstance(error, OSError) and error.errno in DISK_ERRNOS:
        error = write_failed(error.filename or run_dir, "writing the run's records", error)
    if not isinstance(error, DiskWriteError):
        return None
    kept = f"step {saved_step} is the last checkpoint" if saved_step else "no step was saved"
    return DiskWriteError(
        f"{error}; the run stopped and {kept}: free space (or fix the permissions) under {run_dir}, then run the "
        "same command"
    )


def check_writable(run_dir: str | Path, min_free_bytes: int = MIN_FREE_BYTES) -> None:
    """Raises `DiskWriteError` unless `run_dir` (created when missing) takes a new file and its file system has
    `min_free_bytes` free."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=run_dir)
        try:
            os.write(fd, b"hfjax")
        finally:
            os.close(fd)
            os.unlink(probe)
        free = shutil.disk_usage(run_dir).free
    except OSError as exc:
        raise DiskWriteError(
            f"trainer.run_dir: {run_dir} cannot take the run's files ({os_reason(exc)}): free space or fix the "
            "permissions there, or choose another trainer.run_dir"
        ) from exc
    if free < min_free_bytes:
        raise DiskWriteError(
            f"trainer.run_dir: {run_dir} has {free / 2**20:.1f} MiB free, and a run needs at least "
            f"{min_free_bytes / 2**20:.0f} MiB to start: free space there, or choose another trainer.run_dir"
        )


class RunDirLock:
    """Exclusive lock of `run_dir` for this process, taken by `acquire()` (or `with`) and released by `release()`."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    def holder(self) -> dict[str, Any]:
        """The record of the process that last took the lock (empty when there is none or it is unreadable)."""
        try:
            return json.loads(self.path.read_text(encoding="utf-8") or "{}")
        except (OSError, ValueError):
            return {}

    def acquire(self) -> RunDirLock:
        """Takes the lock or raises `RunDirLockedError` naming its holder; never waits. A directory that cannot
        take the run's files (`check_writable`) raises `DiskWriteError`."""
        check_writable(self.run_dir)
        with writing(self.path, "opening the run directory's lock"):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            who = self.holder()
            raise RunDirLockedError(
                f"trainer.run_dir: {self.run_dir} is in use by pid {who.get('pid', '?')} on host "
                f"{who.get('host', '?')} (since {who.get('started', '?')}); wait for that run to end, stop it, or "
                "choose another trainer.run_dir"
            ) from None
        previous = self.holder()
        if previous and previous.get("pid") != os.getpid():
            log.info(
                "%s: taking over the lock of pid %s on host %s, which no longer holds it (ended or was killed)",
                self.run_dir,
                previous.get("pid"),
                previous.get("host"),
            )
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
        }
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)  # the lock goes with it
            raise write_failed(self.path, "recording the run directory's holder", exc) from exc
        self._fd = fd
        return self

    def release(self) -> None:
        """Drops the lock (the file stays: removing it could let two runs lock two different files)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def save_run_config(cfg: Any, run_dir: str | Path) -> Path:
    """Writes the resolved config as `run_dir/config.yaml`. A different one already there (an earlier launch of this
    run) is kept as `config.<its modification time>.yaml`; the new file is written atomically. A write that fails
    raises `DiskWriteError`."""
    path = Path(run_dir) / CONFIG_FILE
    with writing(path, "writing the run's config"):
        return _save_config(cfg, path)


def _save_config(cfg: Any, path: Path) -> Path:
    tmp = dump_yaml(cfg, path.with_suffix(".yaml.tmp"))
    if path.is_file():
        if path.read_bytes() == tmp.read_bytes():
            tmp.unlink()
            return path
        stamp = datetime.datetime.fromtimestamp(path.stat().st_mtime).strftime("%Y%m%d-%H%M%S")
        kept, n = path.with_name(f"config.{stamp}.yaml"), 1
        while kept.exists():
            kept, n = path.with_name(f"config.{stamp}-{n}.yaml"), n + 1
        os.replace(path, kept)
        log.info("%s: the config changed since the last launch; the previous one is kept as %s", path, kept.name)
    os.replace(tmp, path)
    return path
