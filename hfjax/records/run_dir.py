"""Run-directory safety: one run at a time per directory (`RunDirLock`) and the run's `config.yaml` written without
losing the one it replaces (`save_run_config`).

The lock is an advisory `flock` on `run_dir/.lock`, which records the holder's pid, host and start time. The kernel
drops it when its process dies, however it dies (kill -9 included), so a lock left by a dead run is free to take; the
record it leaves is named in the log when a new run takes over. A second run on a held directory fails at once with
`RunDirLockedError` naming the holder. `flock` does not guard one directory shared by two machines over a network file
system that lacks it; there the recorded host tells the user who holds it.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

from hfjax.typed_config import dump_yaml

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
CONFIG_FILE = "config.yaml"


class RunDirLockedError(RuntimeError):
    """Another live process holds the run directory."""


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
        """Takes the lock or raises `RunDirLockedError` naming its holder; never waits."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
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
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
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
    run) is kept as `config.<its modification time>.yaml`; the new file is written atomically."""
    path = Path(run_dir) / CONFIG_FILE
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
