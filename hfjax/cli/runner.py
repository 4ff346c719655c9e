"""What every `hfjax` subcommand shares: hfjax's own errors and a full or read-only disk turned into one line and exit
code 2 (`--debug` or `HFJAX_DEBUG=1` shows the traceback instead), Ctrl-C turned into a message and exit code 130,
SIGTERM's `Preempted` into its message and exit code 143, INFO logging of hfjax's loggers on the console (above any
progress bar), and the installed version."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from importlib import metadata

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


def version() -> str:
    """The installed distribution's version (`hfjax --version`)."""
    try:
        return metadata.version("hfjax")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def user_errors() -> tuple[type[BaseException], ...]:
    """hfjax's own errors: what the user must change (config, data, files, layouts, sampling, rewards, run directory,
    checkpoints) or what stopped a run (a worker that failed, died or hung; a run that cannot learn)."""
    from hfjax.automap.compiled.targets import TargetError
    from hfjax.controller.worker_group import WorkerError
    from hfjax.data.records import DataError
    from hfjax.models.config import UnsupportedModelError
    from hfjax.models.safetensors_io import CheckpointError as ModelFileError
    from hfjax.parallel.layout import LayoutError
    from hfjax.predict.cost import InfeasibleError
    from hfjax.records.checkpoint import CheckpointError
    from hfjax.records.plot import PlotError
    from hfjax.records.run_dir import DiskWriteError, RunDirLockedError
    from hfjax.rewards import RewardError
    from hfjax.rollout.prompt_file import PromptFileError
    from hfjax.rollout.sampling import SamplingError
    from hfjax.trainer.health import RunStalledError
    from hfjax.typed_config import ConfigError

    return (
        ConfigError,
        DataError,
        RewardError,
        LayoutError,
        SamplingError,
        PromptFileError,
        InfeasibleError,
        TargetError,
        UnsupportedModelError,
        ModelFileError,
        PlotError,
        RunDirLockedError,
        DiskWriteError,
        CheckpointError,
        WorkerError,
        RunStalledError,
        FileNotFoundError,
    )


def debugging(flag: bool) -> bool:
    return flag or os.environ.get("HFJAX_DEBUG", "") not in ("", "0")


def run_command(command: str, run: Callable[[], int], debug: bool) -> int:
    """Runs a subcommand: returns its exit code, or prints `hfjax COMMAND: message` for hfjax's own errors and a write
    that found the disk full or read-only (exit 2), for Ctrl-C (exit 130) and for a run stopped by SIGTERM (exit 143).
    With `debug`, errors propagate with their traceback."""
    try:
        return run()
    except KeyboardInterrupt:
        if debug:
            raise
        print(
            f"hfjax {command}: interrupted; {INTERRUPTED_HINT.get(command, 'nothing was left half-written')}",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    except SystemExit as exc:  # the commands' own argument checks: `raise SystemExit("--flag: what was expected")`
        if not isinstance(exc.code, str):
            raise
        message = exc.code if exc.code.startswith("hfjax ") else f"hfjax {command}: {exc.code}"
        print(message, file=sys.stderr)
        return EXIT_USER_ERROR
    except BaseException as exc:
        from hfjax.trainer.preemption import EXIT_PREEMPTED, Preempted

        if isinstance(exc, Preempted):  # SIGTERM: the run stopped as asked (not an error), its message says how
            print(f"hfjax {command}: {exc}", file=sys.stderr)
            return EXIT_PREEMPTED
        from hfjax.records.run_dir import DISK_ERRNOS, os_reason

        if debug:
            raise
        if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
            where = f"{exc.filename}: " if exc.filename else ""
            print(f"hfjax {command}: {where}writing failed ({os_reason(exc)})", file=sys.stderr)
            return EXIT_USER_ERROR
        if not isinstance(exc, user_errors()):
            raise
        print(f"hfjax {command}: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR


INTERRUPTED_HINT = {
    "train": "the workers are stopped and the last checkpoint kept: run the same command to resume from it "
    "(trainer.resume=auto)",
    "sft": "the last checkpoint is kept: run the same command to resume from it (trainer.resume=auto)",
    "rm": "the last checkpoint is kept: run the same command to resume from it (trainer.resume=auto)",
}


class _TqdmHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm

        tqdm.write(self.format(record), file=sys.stderr)


def configure_logging(level: int = logging.INFO) -> None:
    """hfjax's log records at `level` and above on stderr, written above progress bars; other libraries' loggers are
    left as they are."""
    logger = logging.getLogger("hfjax")
    if any(isinstance(h, _TqdmHandler) for h in logger.handlers):
        return
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
