"""Checkpoint on SIGTERM (how a preemptible TPU VM or a GPU scheduler ends a job): `SigtermGuard` holds SIGTERM for
a whole run, from before Ray or any worker starts until the run is closed.

During the training loop (`SigtermGuard.training`) the first SIGTERM sets `requested`; the loop finishes the step in
flight, saves it and raises `Preempted` (the CLI prints its message and exits with 143). A second SIGTERM, or the
grace period (`trainer.preemption_grace_s`) running out, raises `StepAbandoned` in the main thread at once: the step
in flight is dropped and the previous checkpoint, written atomically, is the one a resumed run continues from. A
grace of 0 abandons on the first SIGTERM. Before the loop (start-up: Ray, the workers, the model loading) there is no
step to finish, so a SIGTERM stops the run at once; after it (closing) SIGTERM is only logged. Whatever error the
abandonment surfaces as (a library interrupted in its own calls may wrap it, as `ray.wait` does in a `SystemError`),
the run reports it as `Preempted`. Should the main thread not get back to Python (stuck in native code), the process
exits with 143 `HARD_EXIT_MARGIN_S` after the grace period.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 128 + signal.SIGTERM  # 143: what a shell reports for a process ended by SIGTERM
HARD_EXIT_MARGIN_S = 5.0  # past the grace period: exit without cleanup if the main thread has not stopped the run
RESUME_HINT = "run the same command to resume"


class Preempted(BaseException):
    """The run stopped on SIGTERM; the message says which step is saved. A `BaseException` (like
    `KeyboardInterrupt`), so that no `except Exception` on the way up mistakes it for a failure."""


class StepAbandoned(Preempted):
    """Raised by the SIGTERM handler in the main thread: a second SIGTERM, or the grace period ran out; `reason`
    says which. The loop turns it into a `Preempted` that names the steps (`abandoned_message`)."""

    def __init__(self, reason: str):
        super().__init__(f"preempted (SIGTERM): {reason}: the step in flight was abandoned; {RESUME_HINT}")
        self.reason = reason


class Phase(enum.Enum):
    """What a run guarded by a `SigtermGuard` is doing, which decides what a SIGTERM does."""

    STARTING = "start-up"  # stop at once: no step is in flight
    TRAINING = "training"  # finish the step in flight within the grace period, save it and stop
    CLOSING = "closing"  # the loop is over: only log, the hard fallback bounds the rest


def startup_message() -> str:
    """`Preempted`'s message when SIGTERM came before the training loop started."""
    return f"preempted (SIGTERM) during start-up: no step ran and the checkpoints are as they were; {RESUME_HINT}"


def saved_message(step: int) -> str:
    """`Preempted`'s message once the step in flight finished and step `step` is saved (0: no step ran)."""
    if step == 0:
        return "preempted (SIGTERM) before the first step finished: nothing to save; run the same command to start"
    return f"preempted (SIGTERM): step {step} saved; {RESUME_HINT}"


def abandoned_message(abandoned: StepAbandoned, step_in_flight: int, saved_step: int | None) -> str:
    """`Preempted`'s message when the step in flight was dropped; `saved_step` is the newest complete checkpoint."""
    kept = f"the previous checkpoint holds step {saved_step}" if saved_step else "no checkpoint was saved yet"
    return f"preempted (SIGTERM): {abandoned.reason}: step {step_in_flight} abandoned; {kept}; {RESUME_HINT}"


class SigtermGuard:
    """A context manager that, in the main thread, replaces the SIGTERM handler with its own and restores the
    previous one on exit (elsewhere, or not `enabled`, it does nothing: signals reach the main thread only).

    It starts in `Phase.TRAINING`, or with `starting` in `Phase.STARTING` until `training()` (see the module
    docstring). `requested` tells the loop to save and stop; `abandoned` is set once a SIGTERM abandoned the run.
    An error that leaves the guard after an abandonment during start-up becomes `Preempted`. `exit_process` is what
    the hard fallback calls (tests replace it)."""

    def __init__(
        self,
        grace_s: float,
        *,
        enabled: bool = True,
        starting: bool = False,
        hard_exit_margin_s: float = HARD_EXIT_MARGIN_S,
        exit_process: Callable[[int], Any] = os._exit,
    ):
        if grace_s < 0:
            raise ValueError(f"grace_s: expected >= 0, got {grace_s}")
        self.grace_s = grace_s
        self.enabled = enabled
        self.hard_exit_margin_s = hard_exit_margin_s
        self.exit_process = exit_process
        self.phase = Phase.STARTING if starting else Phase.TRAINING
        self.requested = False
        self.abandoned: StepAbandoned | None = None
        self._abandoned_in: Phase | None = None  # the phase in which it was abandoned
        self._grace_ran_out = False
        self._grace_timer: threading.Timer | None = None
        self._hard_timer: threading.Timer | None = None
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> SigtermGuard:
        if self.enabled and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if self._grace_timer is not None:
            self._grace_timer.cancel()
        # a preempted process is on its way out: the hard fallback still bounds the cleanup after the loop
        if self._hard_timer is not None and not (exc is not None and (isinstance(exc, Preempted) or self.abandoned)):
            self._hard_timer.cancel()
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False
        if exc is not None and self._abandoned_in is Phase.STARTING and self.abandonment(exc) is not None:
            raise Preempted(startup_message()) from None

    @contextlib.contextmanager
    def training(self) -> Iterator[SigtermGuard]:
        """The training loop: a SIGTERM finishes the step in flight within the grace period; after the block only
        the hard fallback stops the process."""
        self.phase = Phase.TRAINING
        try:
            yield self
        finally:
            self.phase = Phase.CLOSING
            if self._grace_timer is not None:
                self._grace_timer.cancel()

    def abandonment(self, error: BaseException) -> StepAbandoned | None:
        """The abandonment `error` results from: the guard's `StepAbandoned` when a SIGTERM abandoned the run and
        `error` is not a `Preempted` that already reports it, else None."""
        reported = isinstance(error, Preempted) and not isinstance(error, StepAbandoned)
        return None if reported else self.abandoned

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        first, self.requested = not self.requested, True
        if self._hard_timer is None:
            self._hard_timer = _start_timer(self.grace_s + self.hard_exit_margin_s, self._hard_exit)
        if self.abandoned is not None or self.phase is Phase.CLOSING:
            log.warning("SIGTERM: the run is already stopping")
            return
        if first and self.phase is Phase.TRAINING and self.grace_s > 0:
            self._grace_timer = _start_timer(self.grace_s, self._grace_over)
            log.warning(
                "SIGTERM: finishing the step in flight and saving it (within trainer.preemption_grace_s=%g s; a "
                "second SIGTERM abandons the step)",
                self.grace_s,
            )
            return
        if self._grace_timer is not None:
            self._grace_timer.cancel()
        self.abandoned, self._abandoned_in = StepAbandoned(self._abandon_reason()), self.phase
        raise self.abandoned

    def _abandon_reason(self) -> str:
        if self.phase is Phase.STARTING:
            return "during start-up"
        if self.grace_s == 0:
            return "trainer.preemption_grace_s=0"
        if self._grace_ran_out:
            return f"the {self.grace_s:g} s grace period ran out"
        return "a second SIGTERM"

    def _grace_over(self) -> None:
        """Delivers the second SIGTERM to the main thread (interrupting a blocking wait there)."""
        self._grace_ran_out = True
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    def _hard_exit(self) -> None:
        sys.stderr.write(
            f"hfjax: still running {self.hard_exit_margin_s:g} s after the SIGTERM grace period "
            f"({self.grace_s:g} s); exiting without cleanup, the last complete checkpoint kept\n"
        )
        sys.stderr.flush()
        self.exit_process(EXIT_PREEMPTED)


def installed_guard() -> SigtermGuard | None:
    """The guard whose handler SIGTERM has now (a run's own, entered by its launcher), or None."""
    guard = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    return guard if isinstance(guard, SigtermGuard) else None


def stopped_by_sigterm(error: BaseException) -> bool:
    """Whether `error` ends a run because of SIGTERM: a `Preempted`, or any error once the installed guard abandoned
    the run (the abandonment, as a library interrupted by it reports it)."""
    guard = installed_guard()
    return isinstance(error, Preempted) or (guard is not None and guard.abandoned is not None)


@contextlib.contextmanager
def training_guard(grace_s: float, *, enabled: bool = True) -> Iterator[SigtermGuard]:
    """The guard of a training loop: the run's own (`installed_guard`) in `Phase.TRAINING` for the block, or a new
    one entered for it (a trainer driven directly, without its launcher)."""
    guard = installed_guard()
    with contextlib.ExitStack() as stack:
        if guard is None:
            guard = stack.enter_context(SigtermGuard(grace_s, enabled=enabled))
        yield stack.enter_context(guard.training())


def _start_timer(seconds: float, action: Callable[[], Any]) -> threading.Timer:
    timer = threading.Timer(seconds, action)
    timer.daemon = True
    timer.start()
    return timer
