"""The single controller: resource pools, workers, dispatch modes, worker groups (Ray and in-process), colocation.
`RayWorkerGroup` imports Ray when first named, so the local backend runs where Ray is not installed."""

from typing import Any

from hfjax.controller.colocate import ColocatedWorker, colocate
from hfjax.controller.dispatch import Dispatch, Dispatched, register_dispatch_mode
from hfjax.controller.future import DataProtoFuture
from hfjax.controller.resource_pool import ResourcePool
from hfjax.controller.worker import Execute, Worker, register
from hfjax.controller.worker_group import LocalWorkerGroup, RoleGroup, WorkerDiedError, WorkerError, WorkerGroup

__all__ = [
    "ColocatedWorker",
    "DataProtoFuture",
    "Dispatch",
    "Dispatched",
    "Execute",
    "LocalWorkerGroup",
    "RayWorkerGroup",
    "ResourcePool",
    "RoleGroup",
    "Worker",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroup",
    "colocate",
    "register",
    "register_dispatch_mode",
]


def __getattr__(name: str) -> Any:
    if name == "RayWorkerGroup":
        from hfjax.controller.ray_worker_group import RayWorkerGroup

        return RayWorkerGroup
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
