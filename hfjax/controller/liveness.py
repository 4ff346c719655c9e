"""Liveness of a Ray worker group's calls: heartbeats and deadlines, so that a stopped or hung worker is reported
instead of waited on forever.

While the controller waits for a call, `Watchdog.check` pings every rank it still waits for (`WorkerHost.ping`, which
runs on a thread of its own beside the worker's method). A rank whose process answers no ping for
`silent_after_s` (stopped with SIGSTOP, frozen, swapped out, or its Python interpreter deadlocked) raises
`WorkerHungError`; a call that runs past its method's deadline (`deadline_s`, e.g. a collective that waits forever for
a peer, or a reward tool that never returns) raises it too. The messages name the method, the rank and how long it
has been silent or running.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from hfjax.controller.worker_group import WorkerError

# Generous defaults (seconds) per method: loading a large checkpoint or compiling a big program takes minutes.
DEFAULT_DEADLINES = {
    "start": 600.0,  # the process starting, joining jax.distributed and building the worker (no weights yet)
    "init_model": 3600.0,
    "generate_sequences": 3600.0,
    "update_actor": 3600.0,
    "update_critic": 3600.0,
    "default": 3600.0,
}


class WorkerHungError(WorkerError):
    """A worker process stopped answering heartbeats, or one call ran past its deadline."""


@dataclasses.dataclass
class LivenessConfig:
    """How the controller watches a Ray group's calls (`trainer.liveness`): it pings the ranks it waits for every
    `heartbeat_s`; one silent for `silent_after_s` is hung, and so is a call past `deadline_s[method]` (else
    `deadline_s["default"]`). Start-up (`start`) is judged by its deadline alone until the process has answered once.
    Methods are named without their role: `update_actor`, `generate_sequences`, `start` for start-up."""

    heartbeat_s: float = 5.0
    silent_after_s: float = 30.0
    deadline_s: dict[str, float] = dataclasses.field(default_factory=lambda: dict(DEFAULT_DEADLINES))

    def __post_init__(self) -> None:
        if not self.heartbeat_s > 0:
            raise ValueError(f"heartbeat_s: expected > 0, got {self.heartbeat_s}")
        if not self.silent_after_s > self.heartbeat_s:
            raise ValueError(
                f"silent_after_s: expected more than heartbeat_s ({self.heartbeat_s}), got {self.silent_after_s}"
            )
        self.deadline_s = {**DEFAULT_DEADLINES, **self.deadline_s}
        bad = {k: v for k, v in self.deadline_s.items() if not v > 0}
        if bad:
            raise ValueError(f"deadline_s: expected every deadline > 0 seconds, got {bad}")

    def deadline(self, method: str) -> float:
        """The deadline of `method` (a bare name or `role.method` / `Worker.method`)."""
        name = method.rsplit(".", 1)[-1]
        return self.deadline_s.get(name, self.deadline_s["default"])


class Watchdog:
    """Watches one call of a group: `hosts` are the group's Ray actors, `label` the call's name for messages."""

    def __init__(self, hosts: list[Any], label: str, method: str, config: LivenessConfig):
        self.hosts, self.label, self.config = hosts, label, config
        self.started = time.monotonic()
        self.deadline = config.deadline(method)
        # a process still starting (queued for resources, importing) answers nothing yet: only the deadline applies
        # until it has answered once
        self.starting = method == "start"
        self._pings: dict[int, Any] = {}
        self._heard: dict[int, float] = {}

    def check(self, waiting: list[int]) -> None:
        """Pings the ranks in `waiting`; raises `WorkerHungError` for one silent too long or past the deadline."""
        import ray

        now = time.monotonic()
        running = now - self.started
        if running > self.deadline:
            raise WorkerHungError(
                self.label,
                waiting[0],
                len(self.hosts),
                f"still running after {running:.0f} s, past its deadline of {self.deadline:.0f} s (ranks {waiting} "
                f"have not answered; trainer.liveness.deadline_s sets it). The run stops; its last checkpoint is kept",
            )
        for rank in waiting:
            ping = self._pings.get(rank)
            if ping is not None and ray.wait([ping], timeout=0)[0]:
                try:
                    ray.get(ping)
                except ray.exceptions.RayError:
                    continue  # the process died: the call's own result reports it
                self._heard[rank], ping = now, None
            heard = self._heard.get(rank, None if self.starting else self.started)
            silent = 0.0 if heard is None else now - heard
            if silent > self.config.silent_after_s:
                raise WorkerHungError(
                    self.label,
                    rank,
                    len(self.hosts),
                    f"the worker process has answered no heartbeat for {silent:.0f} s (it runs the call for "
                    f"{running:.0f} s; stopped, frozen or deadlocked; trainer.liveness.silent_after_s="
                    f"{self.config.silent_after_s:g}). The run stops; its last checkpoint is kept",
                )
            if ping is None:
                self._pings[rank] = self.hosts[rank].ping.remote()
