"""The single controller: resource pools, workers, dispatch modes, worker groups (Ray and in-process), colocation."""

from hfjax.controller.colocate import ColocatedWorker, colocate
from hfjax.controller.dispatch import Dispatch, Dispatched, register_dispatch_mode
from hfjax.controller.future import DataProtoFuture
from hfjax.controller.global_arrays import to_global, to_local
from hfjax.controller.ray_worker_group import RayWorkerGroup
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
    "to_global",
    "to_local",
]
