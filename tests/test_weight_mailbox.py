"""Partial rollouts on a rollout group of two processes following a `WeightMailbox`: a process whose rows all ended
before a switch point of a generation call (so it never reached the switch, and the other switched alone) switches
at the start of its next call, and both processes then serve the new version and meet at the same later points.
Pure Python: the mailbox called in process, rollout workers with stand-in weights, swap and generator (no Ray, no
model)."""

from __future__ import annotations

import threading
import time

import pytest

from hfjax.config.roles import ActorConfig, RolloutConfig
from hfjax.controller.worker import WorkerInfo, construct_worker
from hfjax.trainer.rollout_stream import WeightMailbox
from hfjax.workers.rollout import RolloutWorker
from hfjax.workers.weight_sync import WeightSyncError


def test_a_process_that_ended_before_a_switch_takes_it_at_its_next_call():
    mailbox = WeightMailbox(processes=2)
    mailbox.publish(0, ["v0"])
    assert mailbox.decide(0, (1, 0, 0), 0) is None and mailbox.decide(1, (1, 0, 0), 0) is None
    mailbox.publish(1, ["v1"])
    mailbox.finish(1, 1)  # process 1's rows all ended
    assert mailbox.decide(0, (1, 1, 2), 0) == ((1, 1, 2), 1, ["v1"])
    assert mailbox.report(0, (1, 1, 2), None) == []  # process 1 passed the point: process 0 switches alone
    mailbox.finish(0, 1)
    assert mailbox.decide(0, (2, 0, 0), 1) is None  # on version 1 already
    assert mailbox.decide(1, (2, 0, 0), 0) == ((2, 0, 0), 1, ["v1"])  # still on version 0: switches here
    assert mailbox.report(1, (2, 0, 0), None) == []


class _InProcess:
    """A mailbox as the rollout processes see its Ray actor (`mailbox.method.remote(...)`), one call at a time."""

    def __init__(self, mailbox: WeightMailbox) -> None:
        self.mailbox, self.lock = mailbox, threading.Lock()

    def __getattr__(self, name: str):
        def remote(*args):
            with self.lock:
                return getattr(self.mailbox, name)(*args)

        return type("Method", (), {"remote": staticmethod(remote)})()


class _Swap:
    """Stages the blocks as they are; the weights after a switch are the staged blocks."""

    incomplete = None

    def stage(self, version: int, parts: list, params: object) -> None:
        self.staged = parts

    def settle(self, version: int, serving: int, params: object, errors: list[str]) -> list:
        if errors:
            raise WeightSyncError(f"version {version} dropped: {errors}")
        return self.staged


def _process(rank: int, mailbox: _InProcess) -> RolloutWorker:
    """Rollout process `rank` of two following `mailbox`, serving version 0 (weights `["v0"]`)."""
    worker = construct_worker(RolloutWorker, WorkerInfo(rank, 2), (ActorConfig(), RolloutConfig()), {})
    worker.policy = type("Policy", (), {"params": ["v0"]})()
    worker.generator = type("Generator", (), {"update_params": lambda self, params: None})()
    worker.swap, worker.mailbox = _Swap(), mailbox
    return worker


def _check(worker: RolloutWorker) -> None:
    """One check of the worker's generation loop (`generate_across_versions`'s interrupt, then the switch)."""
    if worker._switch_due():
        worker._switch()


def _end_call(worker: RolloutWorker) -> None:
    worker.mailbox.finish.remote(worker.rank, worker.point[0])  # as `generate_sequences` does when its rows end


def _together(steps: list, first: int, mailbox: WeightMailbox) -> None:
    """Runs `steps[0]` and `steps[1]` (processes 0 and 1) in threads, process `first` first up to its first ask."""
    threads = [threading.Thread(target=step, daemon=True) for step in steps]
    before = mailbox.positions.get(first)
    threads[first].start()
    deadline = time.monotonic() + 10
    while mailbox.positions.get(first) == before:
        assert time.monotonic() < deadline, "the first process never asked the mailbox"
        time.sleep(0.001)
    threads[1 - first].start()
    for thread in threads:
        thread.join(timeout=10)
    assert not any(thread.is_alive() for thread in threads), "a process waits for a switch the other never reaches"


@pytest.mark.parametrize("first", [0, 1], ids=["up_to_date_first", "behind_first"])
def test_both_processes_serve_the_new_version_from_the_next_call(monkeypatch, first):
    import ray

    monkeypatch.setattr(ray, "get", lambda value: value)  # the in-process mailbox answers with values, not refs
    mailbox = WeightMailbox(processes=2)
    workers = [_process(rank, _InProcess(mailbox)) for rank in range(2)]
    mailbox.publish(0, ["v0"])
    for worker in workers:  # call 1 starts on version 0 everywhere
        worker._start_call()
    mailbox.publish(1, ["v1"])
    _end_call(workers[1])  # process 1's rows all end before the next check
    _check(workers[0])  # process 0 switches there alone
    _end_call(workers[0])
    assert [w.version for w in workers] == [1, 0]

    _together([w._start_call for w in workers], first, mailbox)  # call 2
    assert [w.version for w in workers] == [1, 1] and [w.policy.params for w in workers] == [["v1"], ["v1"]]
    assert [w.point for w in workers] == [(2, 1, 0)] * 2  # the same points from here, switched at the start or not

    mailbox.publish(2, ["v2"])
    _together([lambda w=w: _check(w) for w in workers], first, mailbox)  # a switch part way: both at one point
    assert [w.version for w in workers] == [2, 2] and [w.policy.params for w in workers] == [["v2"], ["v2"]]
