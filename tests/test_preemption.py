"""`SigtermGuard` in this process: the first SIGTERM only asks the loop to stop, a second one or the end of the grace
period abandons the step at once, the hard fallback exits with 143, and the previous handler comes back. The CLI
prints `Preempted` as one line with exit code 143. (A whole run stopped by SIGTERM: tests/test_faults.py.)"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from hfjax.cli.runner import run_command
from hfjax.trainer.preemption import (
    EXIT_PREEMPTED,
    Preempted,
    SigtermGuard,
    StepAbandoned,
    abandoned_message,
    saved_message,
)


def _sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)  # the handler runs in the main thread at its next bytecode


def test_the_first_sigterm_asks_to_stop_and_the_previous_handler_comes_back(previous_handler):
    exits: list[int] = []
    with SigtermGuard(0.3, hard_exit_margin_s=0.1, exit_process=exits.append) as guard:
        assert signal.getsignal(signal.SIGTERM) == guard._on_sigterm
        assert not guard.requested
        _sigterm()
        assert guard.requested  # and nothing raised: the step in flight goes on
    assert signal.getsignal(signal.SIGTERM) == previous_handler
    time.sleep(0.6)  # past the grace period and the hard fallback: both were cancelled by the clean exit
    assert exits == []


def test_a_second_sigterm_abandons_the_step_at_once(previous_handler):
    exits: list[int] = []
    with pytest.raises(StepAbandoned, match="a second SIGTERM"), SigtermGuard(30.0, exit_process=exits.append):
        _sigterm()
        _sigterm()
        pytest.fail("the second SIGTERM did not raise")
    assert signal.getsignal(signal.SIGTERM) == previous_handler


def test_the_grace_period_running_out_abandons_the_step_then_the_hard_fallback_exits_143(previous_handler):
    exits: list[int] = []
    started = time.monotonic()
    guard = SigtermGuard(0.2, hard_exit_margin_s=0.3, exit_process=exits.append)
    with pytest.raises(StepAbandoned, match=r"the 0\.2 s grace period ran out"), guard:
        _sigterm()
        time.sleep(5)  # a blocking call in the main thread: the grace timer's signal interrupts it
    abandoned = time.monotonic() - started
    assert 0.2 <= abandoned < 1.0, abandoned
    assert exits == []  # the hard fallback waits 0.3 s more for the cleanup after the loop
    deadline = time.monotonic() + 5
    while not exits and time.monotonic() < deadline:
        time.sleep(0.02)
    assert exits == [EXIT_PREEMPTED] == [143]
    assert time.monotonic() - started >= 0.5


def test_a_grace_of_zero_abandons_on_the_first_sigterm(previous_handler):
    exits: list[int] = []
    guard = SigtermGuard(0.0, hard_exit_margin_s=30, exit_process=exits.append)
    with pytest.raises(StepAbandoned, match=r"trainer\.preemption_grace_s=0"), guard:
        _sigterm()
    assert signal.getsignal(signal.SIGTERM) == previous_handler
    # an abandoned run keeps its hard fallback armed past the guard (the process is on its way out); this one goes on
    # running tests, so it is disarmed here: left, it printed its message into a test 30 s later
    assert guard._hard_timer is not None and guard._hard_timer.is_alive()
    guard._hard_timer.cancel()
    assert exits == []


def test_outside_the_main_thread_the_guard_leaves_the_handler_alone(previous_handler):
    seen = []
    thread = threading.Thread(target=lambda: seen.append(SigtermGuard(1.0).__enter__()._installed))
    thread.start()
    thread.join()
    assert seen == [False] and signal.getsignal(signal.SIGTERM) == previous_handler
    with pytest.raises(ValueError, match="grace_s: expected >= 0, got -1"):
        SigtermGuard(-1)


def test_the_cli_prints_one_line_and_exits_143(capsys):
    def preempted_after(step: int) -> int:
        raise Preempted(saved_message(step))

    assert run_command("train", lambda: preempted_after(7), debug=False) == 143
    assert capsys.readouterr().err == (
        "hfjax train: preempted (SIGTERM): step 7 saved; run the same command to resume\n"
    )
    abandoned = abandoned_message(StepAbandoned("a second SIGTERM"), 8, 6)

    def abandon() -> int:
        raise Preempted(abandoned)

    assert run_command("train", abandon, debug=True) == 143
    assert capsys.readouterr().err == (
        "hfjax train: preempted (SIGTERM): a second SIGTERM: step 8 abandoned; the previous checkpoint holds step 6; "
        "run the same command to resume\n"
    )
