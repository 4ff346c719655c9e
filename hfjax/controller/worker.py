"""`Worker` (the base of model worker classes), `@register` / `Execute`, and how a worker is started in its process.

A worker process belongs to one group; when the group has more than one process, `start_worker` first calls
`jax.distributed.initialize` with rank 0's address (gloo collectives on CPU), then builds the worker with its
rank known before `__init__` runs. JAX is imported inside functions, so that a
worker process imports it after its environment (device visibility, XLA flags) is set. Must not import ray.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from collections.abc import Callable
from typing import Any

from hfjax.controller.dispatch import Dispatch
from hfjax.controller.dispatch import dispatch_mode as lookup_dispatch_mode

REGISTRATION_ATTR = "__hfjax_registration__"
DISTRIBUTED_INIT_TIMEOUT_S = 300


class Execute(enum.StrEnum):
    """Which ranks run a registered method."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclasses.dataclass(frozen=True)
class Registration:
    """How a group calls a worker method: dispatch mode name, executing ranks, and whether it waits."""

    dispatch_mode: str
    execute_mode: Execute
    blocking: bool


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """A worker's place in its group; `coordinator` is rank 0's `host:port` for jax.distributed (None: one process)."""

    rank: int = 0
    world_size: int = 1
    coordinator: str | None = None
    device: str = "cpu"


class Worker:
    """Base class of worker classes. A worker group sets `rank` and `world_size` before `__init__` runs; a worker
    built directly is a one-process group. Methods decorated with `@register` become methods of the group."""

    _info: WorkerInfo = WorkerInfo()

    @property
    def rank(self) -> int:
        """This process's index in its group."""
        return self._info.rank

    @property
    def world_size(self) -> int:
        """Number of processes in the group."""
        return self._info.world_size

    @property
    def local_devices(self) -> list[Any]:
        """The JAX devices this process owns."""
        import jax

        return jax.local_devices()

    def group_method(self, path: str) -> Callable[..., Any]:
        """The method a group call named `path` runs on this worker."""
        return getattr(self, path)


def register(
    dispatch_mode: str | Dispatch = Dispatch.ALL_TO_ALL,
    execute_mode: Execute | str | None = None,
    blocking: bool = True,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Marks a worker method as a group method. `execute_mode` defaults to RANK_ZERO for `Dispatch.RANK_ZERO` and
    to ALL otherwise; `blocking=False` makes the group method return a `DataProtoFuture`."""
    mode = lookup_dispatch_mode(dispatch_mode)
    if execute_mode is None:
        execute_mode = Execute.RANK_ZERO if mode.name == Dispatch.RANK_ZERO else Execute.ALL
    execute_mode = Execute(execute_mode)
    if mode.name == Dispatch.RANK_ZERO and execute_mode is not Execute.RANK_ZERO:
        raise ValueError("register: Dispatch.RANK_ZERO runs on rank 0 only; execute_mode must be RANK_ZERO")
    if mode.row_chunks and execute_mode is not Execute.ALL:
        raise ValueError(f"register: {mode.name} splits rows over all ranks; execute_mode must be ALL")

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        setattr(fn, REGISTRATION_ATTR, Registration(mode.name, execute_mode, bool(blocking)))
        return fn

    return decorate


def registered_methods(cls: type) -> dict[str, tuple[Registration, inspect.Signature]]:
    """Name -> (registration, signature) of every `@register` method of `cls` (inherited ones included)."""
    found = {}
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        registration = getattr(fn, REGISTRATION_ATTR, None)
        if registration is not None:
            found[name] = (registration, inspect.signature(fn))
    return found


def check_worker_cls(worker_cls: Any) -> None:
    """Raises TypeError unless `worker_cls` is a Worker subclass."""
    if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
        raise TypeError(f"worker_cls must be a subclass of hfjax.controller.Worker, got {worker_cls!r}")


def construct_worker(cls: type[Worker], info: WorkerInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Worker:
    """Builds `cls(*args, **kwargs)` with `info` in place before `__init__` runs."""
    check_worker_cls(cls)
    worker = cls.__new__(cls)
    worker._info = info
    worker.__init__(*args, **kwargs)
    return worker


def init_distributed(info: WorkerInfo) -> None:
    """Joins this process to its group's JAX distributed runtime (gloo collectives on CPU)."""
    import jax

    if info.device == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        info.coordinator,
        num_processes=info.world_size,
        process_id=info.rank,
        initialization_timeout=DISTRIBUTED_INIT_TIMEOUT_S,
        coordinator_bind_address=info.coordinator,  # rank 0's service: that address only, not every interface
    )


def start_worker(cls: type[Worker], info: WorkerInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Worker:
    """Starts the worker of one process: jax.distributed first when the group has several processes."""
    if info.world_size > 1:
        init_distributed(info)
    return construct_worker(cls, info, args, kwargs)
