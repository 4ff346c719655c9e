"""`RayWorkerGroup`: one Ray actor per host of a `ResourcePool`, each a JAX process running the worker class.

Start-up: the actors start with their device environment (see `ResourcePool.process_env`); rank 0 picks a free port
on its node and the controller hands `ip:port` to every rank, which joins jax.distributed before building its
worker. Calls: arguments shared by several ranks are put in the object store once; per-rank chunks travel as
Ray's zero-copy pickle-5 buffers. Results are gathered as they finish, so the first failing rank is reported at
once (with its traceback), even while other ranks still wait in a collective for the dead one.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from hfjax.controller.liveness import LivenessConfig, Watchdog
from hfjax.controller.resource_pool import ResourcePool
from hfjax.controller.worker import Worker, WorkerInfo, check_worker_cls, start_worker
from hfjax.controller.worker_group import WorkerDiedError, WorkerError, WorkerGroup

_INLINE_TYPES = (str, bytes, int, float, bool, type(None), ray.ObjectRef)


class WorkerHost:
    """The Ray actor of one group process: holds the worker and runs the group's calls on it; `ping` answers on a
    thread of its own (concurrency group `liveness`) while a call runs."""

    def __init__(self, label: str = "worker", rank: int = 0) -> None:
        self.worker: Worker | None = None
        self.label, self.rank = label, rank

    def __repr__(self) -> str:
        """Ray prefixes the process's console output with this: `(<worker class> rank <r> pid=...)`."""
        return f"{self.label} rank {self.rank}"

    @ray.method(concurrency_group="liveness")
    def ping(self) -> int:
        """Answers a heartbeat (this process's pid)."""
        return os.getpid()

    def coordinator_address(self) -> str:
        """`ip:port` with a port that was free on this node, for jax.distributed's coordinator."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def start(self, worker_cls: type[Worker], info: WorkerInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """Joins jax.distributed when needed, builds the worker; returns this process's pid."""
        self.worker = start_worker(worker_cls, info, args, kwargs)
        return os.getpid()

    def execute(self, path: str, *args: Any, **kwargs: Any) -> Any:
        """Runs the worker method named `path`."""
        return self.worker.group_method(path)(*args, **kwargs)


def _shared_once(args: list[tuple[Any, ...]], kwargs: list[dict[str, Any]]) -> tuple[list, list]:
    """Replaces every non-scalar value passed to more than one rank by one object-store ref."""
    values = [v for a in args for v in a] + [v for k in kwargs for v in k.values()]
    counts: dict[int, int] = {}
    for v in values:
        counts[id(v)] = counts.get(id(v), 0) + 1
    refs: dict[int, Any] = {}
    for v in values:
        if counts[id(v)] > 1 and id(v) not in refs and not isinstance(v, _INLINE_TYPES):
            refs[id(v)] = ray.put(v)
    if not refs:
        return args, kwargs

    def swap(v: Any) -> Any:
        return refs.get(id(v), v)

    return [tuple(swap(v) for v in a) for a in args], [{k: swap(v) for k, v in kw.items()} for kw in kwargs]


class RayWorkerGroup(WorkerGroup):
    """`worker_cls(*args, **kwargs)` in one Ray actor per host of `resource_pool`; every `@register` method of
    `worker_cls` becomes a method of the group. `liveness`: how its calls are watched (`Watchdog`); `name`: the prefix
    of its processes' console output (default the class name). Raises `WorkerError` if a worker fails to start."""

    on_ray = True

    def __init__(
        self,
        resource_pool: ResourcePool,
        worker_cls: type[Worker],
        *args: Any,
        liveness: LivenessConfig | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        check_worker_cls(worker_cls)
        self.resource_pool, self._label = resource_pool, worker_cls.__name__
        self.liveness = liveness or LivenessConfig()
        world_size = resource_pool.world_size
        host_cls = ray.remote(concurrency_groups={"liveness": 1})(WorkerHost)
        self._hosts = [
            host_cls.options(**resource_pool.actor_options(r)).remote(name or self._label, r) for r in range(world_size)
        ]
        try:
            coordinator = None
            if world_size > 1:
                address_ref = self._hosts[0].coordinator_address.remote()
                coordinator = self._gather(f"{self._label} start", [0], [address_ref], "start")[0]
            starts = [
                host.start.remote(
                    worker_cls, WorkerInfo(r, world_size, coordinator, resource_pool.device), args, kwargs
                )
                for r, host in enumerate(self._hosts)
            ]
            self.pids = self._gather(f"{self._label}.__init__", list(range(world_size)), starts, "start")
        except BaseException:
            self.shutdown()
            raise
        super().__init__(worker_cls, world_size)

    def _submit(
        self, path: str, label: str, ranks: list[int], args: list[tuple[Any, ...]], kwargs: list[dict[str, Any]]
    ) -> list[Any]:
        args, kwargs = _shared_once(args, kwargs)
        return [self._hosts[r].execute.remote(path, *a, **k) for r, a, k in zip(ranks, args, kwargs, strict=True)]

    def _fetch(self, label: str, ranks: list[int], parts: list[Any]) -> list[Any]:
        return self._gather(label, ranks, parts, label)

    def _gather(self, label: str, ranks: list[int], refs: list[Any], method: str) -> list[Any]:
        """Values of `refs` (one per rank in `ranks`); raises for the first rank that fails, as soon as it does, and
        `WorkerHungError` for a rank silent too long or a call past `method`'s deadline (`Watchdog`)."""
        position = {ref: i for i, ref in enumerate(refs)}
        out: list[Any] = [None] * len(refs)
        pending = list(refs)
        watchdog = Watchdog(self._hosts, label, method, self.liveness)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=self.liveness.heartbeat_s)
            if not ready:
                watchdog.check(sorted(ranks[position[r]] for r in pending))
                continue
            if pending:
                more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
                ready += more
            for ref in ready:
                out[position[ref]] = self._value(label, ranks[position[ref]], ref)
        return out

    def _value(self, label: str, rank: int, ref: Any) -> Any:
        try:
            return ray.get(ref)
        except RayActorError as exc:
            raise WorkerDiedError(label, rank, len(self._hosts), f"the worker process died: {exc}") from None
        except RayTaskError as exc:
            raise WorkerError(label, rank, len(self._hosts), str(exc)) from None
        except RayError as exc:
            raise WorkerError(label, rank, len(self._hosts), f"{type(exc).__name__}: {exc}") from None

    def shutdown(self) -> None:
        """Kills the group's actors (the pool's bundles stay reserved for other groups)."""
        for host in self._hosts:
            ray.kill(host, no_restart=True)
        self._hosts = []
