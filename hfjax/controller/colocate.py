"""`colocate`: several roles (actor, critic, reference, ...) in one worker process per host, sharing its devices.

`colocate({"actor_rollout": A, "critic": functools.partial(C, config)})` describes a `ColocatedWorker` holding one
worker per role; `.spawn(pool)` starts it as one group and returns a `RoleGroup` per role, whose methods are that
role's `@register` methods.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from hfjax.controller.liveness import LivenessConfig
from hfjax.controller.resource_pool import ResourcePool
from hfjax.controller.worker import Worker, check_worker_cls, construct_worker
from hfjax.controller.worker_group import LocalWorkerGroup, RoleGroup

RoleSpec = tuple[type[Worker], tuple[Any, ...], dict[str, Any]]


class ColocatedWorker(Worker):
    """One worker per role in this process; every role sees the rank and world size of the shared process."""

    def __init__(self, roles: Mapping[str, RoleSpec]) -> None:
        self.roles = {
            name: construct_worker(cls, self._info, args, kwargs) for name, (cls, args, kwargs) in roles.items()
        }

    def group_method(self, path: str) -> Callable[..., Any]:
        """`path` is `role.method`."""
        role, _, method = path.partition(".")
        return getattr(self.roles[role], method)


def _role_spec(name: str, worker: type[Worker] | functools.partial) -> RoleSpec:
    if not name.isidentifier():
        raise ValueError(f"colocate: role name {name!r} must be a Python identifier")
    if isinstance(worker, functools.partial):
        check_worker_cls(worker.func)
        return worker.func, tuple(worker.args), dict(worker.keywords)
    check_worker_cls(worker)
    return worker, (), {}


class Colocated:
    """Roles to run in one process per host; `spawn` starts them."""

    def __init__(self, roles: Mapping[str, type[Worker] | functools.partial]) -> None:
        if not roles:
            raise ValueError("colocate: expected at least one role")
        self.roles = {name: _role_spec(name, worker) for name, worker in roles.items()}

    def spawn(
        self, resource_pool: ResourcePool | None = None, liveness: LivenessConfig | None = None
    ) -> dict[str, RoleGroup]:
        """One group over `resource_pool` (Ray, its calls watched as `liveness` says), or in this process when no
        pool is given; a handle per role."""
        if resource_pool is None:
            group = LocalWorkerGroup(ColocatedWorker, self.roles)
        else:
            from hfjax.controller.ray_worker_group import RayWorkerGroup  # Ray loads only for a Ray group

            name = "+".join(self.roles)  # the prefix of its processes' console output
            group = RayWorkerGroup(resource_pool, ColocatedWorker, self.roles, liveness=liveness, name=name)
        return {name: group.role(name, cls) for name, (cls, _, _) in self.roles.items()}


def colocate(roles: Mapping[str, type[Worker] | functools.partial]) -> Colocated:
    """Describes one worker process per host holding every role of `roles` (a worker class, or a
    `functools.partial` of one with its constructor arguments)."""
    return Colocated(roles)
