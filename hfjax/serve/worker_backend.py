"""The service's `ServeBackend` over a worker group of `AdapterWorker`: in the server's process (`backend: local`)
or in a worker process on a Ray cluster (`backend: ray`). A refusal (`ServeError`) crosses the group as a returned
`Refusal` and is raised again here, so the HTTP layer answers it with its status; any other failure stays a
`WorkerError` (a 500 with the worker's traceback in the server log)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hfjax.serve.backend import Refusal, ServeError
from hfjax.serve.config import ServeConfig


class GroupBackend:
    """`ServeBackend` whose calls run on `group` (a worker group of `AdapterWorker`); `shutdown` stops it."""

    def __init__(self, group: Any):
        self.group = group

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.group, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            out = method(*args, **kwargs)
            if isinstance(out, Refusal):
                raise ServeError(out.message, out.status)
            return out

        return call

    def shutdown(self) -> None:
        self.group.shutdown()


def start_backend(config: ServeConfig) -> GroupBackend:
    """Loads the base model on the worker group `config.backend` names."""
    from hfjax.serve.adapter_worker import AdapterWorker

    if config.backend == "local":
        from hfjax.controller.worker_group import LocalWorkerGroup

        return GroupBackend(LocalWorkerGroup(AdapterWorker, config))
    import ray

    from hfjax.controller.ray_worker_group import RayWorkerGroup
    from hfjax.controller.resource_pool import ResourcePool, resolve_device

    if not ray.is_initialized():
        ray.init(address="auto" if "RAY_ADDRESS" in os.environ else None)
    device = resolve_device(config.device, ray.cluster_resources(), "device")
    pool = ResourcePool([config.devices], device=device)
    return GroupBackend(RayWorkerGroup(pool, AdapterWorker, config, name="serve"))
