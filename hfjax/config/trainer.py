"""The `trainer:` section of an RL run: the loop's steps, the placement of roles on devices (hosts, devices per host
and their split between worker groups), checkpoints, validation, logging, and when a run that cannot learn stops."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from hfjax.controller.liveness import LivenessConfig
from hfjax.controller.resource_pool import group_shapes
from hfjax.typed_config import AT_LEAST_1, NON_NEGATIVE, ZERO_AT_END, check_fields


@dataclasses.dataclass
class HealthConfig:
    """When a run that cannot learn stops (`trainer.health`): after `max_skipped_steps` consecutive steps with updates
    skipped for non-finite gradients, or `max_flat_reward_steps` consecutive steps in which every response scored the
    same; 0 turns a check off. `on_stall: warn` logs instead of stopping."""

    max_skipped_steps: int = 3
    max_flat_reward_steps: int = 20
    on_stall: Literal["stop", "warn"] = "stop"

    def __post_init__(self) -> None:
        for name in ("max_skipped_steps", "max_flat_reward_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0 (0 turns the check off), got {getattr(self, name)}")


@dataclasses.dataclass
class TrainerConfig:
    """The loop: steps, placement of roles on devices, checkpoints, validation and logging."""

    run_dir: str = "runs/rl"
    total_steps: int = 3
    critic_warmup: int = 0
    # disaggregated: generation on a rollout group of its own devices, every other role on a trainer group
    placement: Literal["colocate", "split", "standalone", "disaggregated"] = "colocate"
    backend: Literal["ray", "local"] = "ray"
    device: Literal["auto", "cpu", "gpu", "tpu"] = "auto"  # auto: the cluster's accelerator if it has one, else cpu
    hosts: int = 1
    devices_per_host: int = 8
    devices: int | None = None  # replaced by devices_per_host (and hosts); set, it is an error that says so
    # on one host, the devices of each worker group of `placement`, in its order (disaggregated: the rollout group,
    # then the trainer group), e.g. [6, 2]; null: an equal share each (several hosts: whole hosts each)
    group_devices: list[int] | None = None
    ray_address: str | None = None
    save_freq: int = 0
    test_freq: int = 0
    val_before_train: bool = False
    resume: Literal["auto", "never"] = "auto"
    max_to_keep: int = 3
    # on SIGTERM: seconds to finish and save the step in flight before abandoning it (0: abandon at once; the
    # previous checkpoint is kept either way); the run then exits with code 143
    preemption_grace_s: float = 30.0
    # where metrics go (verl's key): console, jsonl (run_dir/metrics.jsonl, read by `hfjax plot`), tensorboard
    # (run_dir/tb), wandb (the `hfjax[wandb]` extra; W&B project `project_name`, run group `experiment_name`)
    logger: list[Literal["console", "jsonl", "tensorboard", "wandb"]] = dataclasses.field(
        default_factory=lambda: ["console", "jsonl", "tensorboard"]
    )
    project_name: str = "hfjax"
    experiment_name: str = ""  # default: the run directory's name
    plot: bool = True  # draw `hfjax plot`'s PNGs into run_dir/plots at the end of the run (needs jsonl)
    progress: bool = True
    liveness: LivenessConfig = dataclasses.field(default_factory=LivenessConfig)  # heartbeats and call deadlines
    health: HealthConfig = dataclasses.field(default_factory=HealthConfig)  # stop runs that cannot learn
    # memory of one device in GiB, for the memory check before start; null: host RAM per device on CPU, and no
    # check of device memory on accelerators (the controller never opens them)
    device_memory_gib: float | None = None

    def __post_init__(self) -> None:
        if self.devices is not None:
            raise ValueError(
                f"trainer.devices={self.devices}: this key was replaced by trainer.devices_per_host (the devices of "
                "each host) and trainer.hosts (how many hosts, default 1); write "
                f"trainer.devices_per_host={self.devices} for the old meaning on one host"
            )
        check_fields(
            self,
            run_dir=(bool, "a directory path (not empty)"),
            total_steps=AT_LEAST_1,
            critic_warmup=NON_NEGATIVE,
            hosts=AT_LEAST_1,
            devices_per_host=AT_LEAST_1,
            save_freq=ZERO_AT_END,
            test_freq=ZERO_AT_END,
            max_to_keep=AT_LEAST_1,
            preemption_grace_s=(lambda v: 0 <= v < math.inf, "seconds >= 0"),
            device_memory_gib=(lambda v: v is None or 0 < v < math.inf, "a number of GiB > 0 or null"),
        )
        if self.ray_address is not None and not self.ray_address.strip():
            raise ValueError("ray_address: expected a Ray address (host:port) or null, got ''")
        if self.group_devices is not None:
            if not self.group_devices or any(not isinstance(n, int) or n < 1 for n in self.group_devices):
                raise ValueError(
                    f"group_devices: expected a list of device counts >= 1, one per worker group, or null; got "
                    f"{self.group_devices!r}"
                )
            if self.hosts > 1:
                raise ValueError(
                    f"trainer.group_devices={self.group_devices}: on several hosts (trainer.hosts={self.hosts}) each "
                    "worker group runs on whole hosts; set it only with trainer.hosts=1"
                )
            if sum(self.group_devices) > self.devices_per_host:
                raise ValueError(
                    f"trainer.group_devices={self.group_devices}: {sum(self.group_devices)} devices in all, but "
                    f"trainer.devices_per_host={self.devices_per_host}"
                )
        if self.backend == "local" and self.hosts > 1:
            raise ValueError(
                f"trainer.hosts={self.hosts}: several hosts need trainer.backend=ray (local is one process)"
            )

    def group_shapes(self, groups: int) -> list[tuple[int, int]]:
        """(hosts, devices per host) of each of `groups` worker groups: whole hosts when there are several hosts,
        `group_devices` or an equal share of the one host's devices otherwise
        (`hfjax.controller.resource_pool.group_shapes`)."""
        shapes = group_shapes(self.hosts, self.devices_per_host, groups, self.group_devices)
        if shapes is not None:
            return shapes
        if self.group_devices is not None:
            raise ValueError(
                f"trainer.group_devices={self.group_devices}: placement {self.placement!r} has {groups} worker "
                f"group(s); give one device count for each"
            )
        if self.hosts == 1:
            raise ValueError(
                f"trainer.devices_per_host={self.devices_per_host} cannot give each of the {groups} worker groups "
                f"of placement {self.placement!r} a device"
            )
        raise ValueError(
            f"trainer.hosts={self.hosts}: placement {self.placement!r} has {groups} worker groups, each on whole "
            f"hosts; trainer.hosts must be a multiple of {groups}"
        )
