"""`ResourcePool`: the hosts (one process each) and devices per host that one or more worker groups run on.

On Ray a pool reserves one placement-group bundle per host process (when a group first needs it) and gives each
process only its devices: on CPU `--xla_force_host_platform_device_count` fake devices, on GPU `num_gpus` (Ray sets
`CUDA_VISIBLE_DEVICES`), on TPU the `TPU` resource (Ray sets `TPU_VISIBLE_CHIPS` and the chip bounds).
Pools are values: `split` and `merge` describe new pools, each reserving its own bundles when first used.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

DEVICES = ("cpu", "gpu", "tpu")
PLACEMENT_TIMEOUT_S = 120
_FAKE_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def resolve_device(requested: str, resources: Mapping[str, float], where: str = "trainer.device") -> str:
    """The device kind workers run on: `requested`, or for `auto` the accelerator the cluster's `resources` (Ray's
    `cluster_resources()`) offer (GPU, else TPU), else cpu. An accelerator the cluster lacks is an error."""
    if requested == "auto":
        return next((kind for kind in ("gpu", "tpu") if resources.get(kind.upper(), 0) > 0), "cpu")
    if requested not in DEVICES:
        raise ValueError(f"{where}: expected auto or one of {DEVICES}, got {requested!r}")
    if requested != "cpu" and not resources.get(requested.upper(), 0) > 0:
        raise ValueError(
            f"{where}={requested}: the Ray cluster has no {requested.upper()} resources (it has "
            f"{dict(sorted(resources.items()))}); start Ray on hosts with {requested}s, or use {where}=auto"
        )
    return requested


def group_hosts(hosts: int, devices_per_host: int, groups: int) -> tuple[int, int] | None:
    """(hosts, devices per host) of each of `groups` worker groups on `hosts` x `devices_per_host` devices: an equal
    share of the one host's devices, or whole hosts each when there are several; None where that cannot be."""
    if hosts == 1:
        return (1, devices_per_host // groups) if devices_per_host >= groups else None
    return None if hosts % groups else (hosts // groups, devices_per_host)


def group_shapes(
    hosts: int, devices_per_host: int, groups: int, group_devices: Sequence[int] | None = None
) -> list[tuple[int, int]] | None:
    """(hosts, devices per host) of each of `groups` worker groups: `group_hosts`'s equal shares, or on one host
    `group_devices[i]` devices for group i (an uneven split, e.g. 6 for generation and 2 for training); None where
    that cannot be (several hosts with `group_devices`, a count per group missing, more devices than the host's)."""
    if group_devices is None:
        shape = group_hosts(hosts, devices_per_host, groups)
        return None if shape is None else [shape] * groups
    if hosts != 1 or len(group_devices) != groups or sum(group_devices) > devices_per_host:
        return None
    return [(1, n) for n in group_devices]


class ResourcePool:
    """Hosts for worker groups: `devices_per_host[i]` devices of kind `device` for the process on host i.

    `cpus_per_host`: logical CPUs each bundle reserves (Ray scheduling only; the worker actors themselves request
    none, so several groups may share a CPU pool). `strategy`: Ray placement strategy of the bundles.
    """

    def __init__(
        self,
        devices_per_host: Sequence[int],
        device: str = "cpu",
        cpus_per_host: float = 0.1,
        strategy: str = "SPREAD",
    ) -> None:
        devices_per_host = list(devices_per_host)
        if not devices_per_host or any(not isinstance(n, int) or n < 1 for n in devices_per_host):
            raise ValueError(f"ResourcePool.devices_per_host: expected positive ints, got {devices_per_host!r}")
        if device not in DEVICES:
            raise ValueError(f"ResourcePool.device: expected one of {DEVICES}, got {device!r}")
        if not cpus_per_host > 0:
            raise ValueError(
                f"ResourcePool.cpus_per_host: expected > 0 (a bundle cannot be empty), got {cpus_per_host}"
            )
        self.devices_per_host, self.device = devices_per_host, device
        self.cpus_per_host, self.strategy = cpus_per_host, strategy
        self._placement_group: Any = None

    def __repr__(self) -> str:
        return f"ResourcePool(devices_per_host={self.devices_per_host}, device={self.device!r})"

    @property
    def world_size(self) -> int:
        """Number of processes (one per host)."""
        return len(self.devices_per_host)

    def split(self, hosts_per_pool: Sequence[int]) -> list[ResourcePool]:
        """Consecutive sub-pools with `hosts_per_pool[j]` hosts each (for split placements)."""
        if any(n < 1 for n in hosts_per_pool) or sum(hosts_per_pool) != self.world_size:
            raise ValueError(
                f"ResourcePool.split: hosts_per_pool {list(hosts_per_pool)} must be positive and sum to "
                f"{self.world_size} hosts"
            )
        starts = [sum(hosts_per_pool[:j]) for j in range(len(hosts_per_pool))]
        return [self._like(self.devices_per_host[s : s + n]) for s, n in zip(starts, hosts_per_pool, strict=True)]

    @staticmethod
    def merge(*pools: ResourcePool) -> ResourcePool:
        """One pool with the hosts of all `pools` (same device kind), in order."""
        if not pools or len({p.device for p in pools}) != 1:
            raise ValueError(f"ResourcePool.merge: expected pools of one device kind, got {pools}")
        return pools[0]._like([n for p in pools for n in p.devices_per_host])

    def _like(self, devices_per_host: list[int]) -> ResourcePool:
        return ResourcePool(devices_per_host, self.device, self.cpus_per_host, self.strategy)

    def process_env(self, rank: int) -> dict[str, str]:
        """Environment variables of the process on host `rank`, set before it imports JAX."""
        if self.device == "cpu":
            inherited = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_FAKE_DEVICES_FLAG)]
            flags = [*inherited, f"{_FAKE_DEVICES_FLAG}={self.devices_per_host[rank]}"]
            return {"XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
        return {"JAX_PLATFORMS": "cuda" if self.device == "gpu" else "tpu"}

    def _bundle(self, rank: int) -> dict[str, float]:
        bundle = {"CPU": self.cpus_per_host}
        if self.device != "cpu":
            bundle[self.device.upper()] = self.devices_per_host[rank]
        return bundle

    def placement_group(self) -> Any:
        """The pool's Ray placement group, reserved on first call; raises if Ray cannot place it in time."""
        if self._placement_group is None:
            import ray
            from ray.util.placement_group import placement_group, remove_placement_group

            bundles = [self._bundle(r) for r in range(self.world_size)]
            group = placement_group(bundles, strategy=self.strategy)
            ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                remove_placement_group(group)
                raise RuntimeError(
                    f"{self!r}: Ray could not reserve bundles {bundles} ({self.strategy}) within "
                    f"{PLACEMENT_TIMEOUT_S} s; available resources: {ray.available_resources()}"
                )
            self._placement_group = group
        return self._placement_group

    def actor_options(self, rank: int) -> dict[str, Any]:
        """Ray actor options placing the process of host `rank` in its bundle with only its devices visible."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options: dict[str, Any] = {
            "num_cpus": 0,
            "runtime_env": {"env_vars": self.process_env(rank)},
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.placement_group(), rank),
        }
        if self.device == "gpu":
            options["num_gpus"] = self.devices_per_host[rank]
        elif self.device == "tpu":
            options["resources"] = {"TPU": self.devices_per_host[rank]}
        return options

    def release(self) -> None:
        """Returns the reserved bundles to Ray (groups on this pool must be shut down first)."""
        if self._placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement_group)
            self._placement_group = None
