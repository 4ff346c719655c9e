"""`WorkerGroup`: binds a worker class's `@register` methods onto a group object (check arguments, dispatch,
run on the ranks, collect); `LocalWorkerGroup` runs the worker in this process; `RoleGroup` is one role's view of a
colocated group; `WorkerError` / `WorkerDiedError` carry a failing rank and its traceback to the controller.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import traceback
from collections.abc import Callable
from typing import Any

from hfjax.controller.dispatch import dispatch_mode
from hfjax.controller.future import DataProtoFuture
from hfjax.controller.worker import (
    Execute,
    Registration,
    Worker,
    WorkerInfo,
    check_worker_cls,
    registered_methods,
    start_worker,
)


class WorkerError(RuntimeError):
    """A worker method raised: names the method, the rank and carries the worker's traceback."""

    def __init__(self, method: str, rank: int, world_size: int, remote_traceback: str) -> None:
        self.method, self.rank, self.world_size, self.remote_traceback = method, rank, world_size, remote_traceback
        super().__init__(f"{method} failed on rank {rank} of {world_size}:\n{remote_traceback}")


class WorkerDiedError(WorkerError):
    """A worker process died (killed, crashed, out of memory) before answering."""


def _group_method(
    invoke: Callable[..., Any], path: str, label: str, registration: Registration, signature: inspect.Signature
) -> Callable[..., Any]:
    def run(current: Registration, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            signature.bind(None, *args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{label}{signature}: {exc}") from None
        return invoke(path, label, current, args, kwargs)

    def call(*args: Any, **kwargs: Any) -> Any:
        return run(registration, args, kwargs)

    def submit(*args: Any, **kwargs: Any) -> DataProtoFuture:
        """Starts the call and returns its `DataProtoFuture` at once, whether or not the method blocks."""
        return run(dataclasses.replace(registration, blocking=False), args, kwargs)

    call.__name__ = path.rsplit(".", 1)[-1]
    call.__doc__ = f"Group method for {label} ({registration.dispatch_mode}, execute {registration.execute_mode})."
    call.submit = submit  # type: ignore[attr-defined]
    return call


def bind_methods(target: Any, invoke: Callable[..., Any], worker_cls: type, prefix: str = "") -> None:
    """Sets one attribute on `target` per `@register` method of `worker_cls`, calling `invoke(path, label,
    registration, args, kwargs)` with path `prefix + name`."""
    for name, (registration, signature) in registered_methods(worker_cls).items():
        if hasattr(target, name):
            raise ValueError(f"{worker_cls.__name__}.{name} clashes with {type(target).__name__}.{name}: rename it")
        label = f"{worker_cls.__name__}.{name}"
        setattr(target, name, _group_method(invoke, prefix + name, label, registration, signature))


class WorkerGroup:
    """A group of `world_size` processes running one worker class; its `@register` methods are group methods.

    Subclasses provide `_submit` (start a method on some ranks, return one part per rank), `_fetch` (parts to
    values, raising `WorkerError` with the failing rank) and `_accept` (prepare a call argument).
    """

    on_ray = False

    def __init__(self, worker_cls: type[Worker], world_size: int) -> None:
        self.worker_cls, self.world_size = worker_cls, world_size
        bind_methods(self, self._invoke, worker_cls)

    def _invoke(
        self, path: str, label: str, registration: Registration, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        args = tuple(self._accept(a) for a in args)
        kwargs = {k: self._accept(v) for k, v in kwargs.items()}
        mode = dispatch_mode(registration.dispatch_mode)
        dispatched = mode.dispatch(self.world_size, args, kwargs)
        ranks = [0] if registration.execute_mode is Execute.RANK_ZERO else list(range(self.world_size))
        parts = self._submit(
            path, label, ranks, [dispatched.args[r] for r in ranks], [dispatched.kwargs[r] for r in ranks]
        )
        future = DataProtoFuture(
            parts,
            mode.collect_fn,
            dispatched.pad_size,
            row_chunks=mode.row_chunks and len(ranks) == self.world_size,
            fetch=functools.partial(self._fetch, label, ranks),
            on_ray=self.on_ray,
        )
        return future.get() if registration.blocking else future

    def role(self, name: str, role_cls: type[Worker]) -> RoleGroup:
        """The group methods of one role of a colocated worker (see `colocate`)."""
        return RoleGroup(self, name, role_cls)

    def _submit(
        self, path: str, label: str, ranks: list[int], args: list[tuple[Any, ...]], kwargs: list[dict[str, Any]]
    ) -> list[Any]:
        raise NotImplementedError

    def _fetch(self, label: str, ranks: list[int], parts: list[Any]) -> list[Any]:
        raise NotImplementedError

    def _accept(self, value: Any) -> Any:
        return value

    def shutdown(self) -> None:
        """Releases the group's processes (a no-op for in-process groups)."""


class RoleGroup:
    """One role of a colocated group: that role's group methods, running in the shared processes."""

    def __init__(self, group: WorkerGroup, name: str, role_cls: type[Worker]) -> None:
        self.group, self.name, self.world_size = group, name, group.world_size
        bind_methods(self, group._invoke, role_cls, prefix=f"{name}.")


class LocalWorkerGroup(WorkerGroup):
    """The worker in this process: one process, all local devices. Futures passed in are fetched first;
    `blocking=False` methods run at once and return an already-computed `DataProtoFuture`."""

    def __init__(self, worker_cls: type[Worker], *args: Any, **kwargs: Any) -> None:
        check_worker_cls(worker_cls)
        try:
            self.worker = start_worker(worker_cls, WorkerInfo(), args, kwargs)
        except Exception as exc:
            raise WorkerError(f"{worker_cls.__name__}.__init__", 0, 1, traceback.format_exc()) from exc
        super().__init__(worker_cls, 1)

    def _submit(
        self, path: str, label: str, ranks: list[int], args: list[tuple[Any, ...]], kwargs: list[dict[str, Any]]
    ) -> list[Any]:
        try:
            return [self.worker.group_method(path)(*args[0], **kwargs[0])]
        except Exception as exc:
            raise WorkerError(label, 0, 1, traceback.format_exc()) from exc

    def _fetch(self, label: str, ranks: list[int], parts: list[Any]) -> list[Any]:
        return parts

    def _accept(self, value: Any) -> Any:
        return value.get() if isinstance(value, DataProtoFuture) else value
