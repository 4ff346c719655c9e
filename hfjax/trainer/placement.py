"""Where the roles of an RL run live: `colocate` (one worker group holds every role), `split` (the actor on one set
of devices, critic and score models on another), `standalone` (every role its own group) or `disaggregated`
(generation on a rollout group, every other role on a trainer group), on Ray or — for
`colocate` — in this process (`backend: local`).

"""

from __future__ import annotations

import functools
from typing import Any

from hfjax.config.rl import RLConfig
from hfjax.controller import ResourcePool, colocate
from hfjax.controller.resource_pool import resolve_device
from hfjax.workers.actor import ActorRolloutRefWorker
from hfjax.workers.critic import CriticWorker
from hfjax.workers.reward_model import RewardModelWorker
from hfjax.workers.rollout import RolloutWorker


def role_workers(cfg: RLConfig) -> dict[str, functools.partial]:
    """The worker of each role this run needs (`cfg.role_names()`)."""
    steps = cfg.trainer.total_steps
    actor_role = ("actor" if cfg.disaggregated else "actor_rollout") + ("_ref" if cfg.uses_ref else "")
    workers = {
        "actor": functools.partial(
            ActorRolloutRefWorker,
            cfg.actor,
            cfg.rollout,
            actor_role,
            total_steps=steps,
            max_prompt_length=cfg.data.max_prompt_length,
        ),
        "rollout": functools.partial(
            RolloutWorker,
            cfg.actor,
            cfg.rollout,
            max_prompt_length=cfg.data.max_prompt_length,
            partial=cfg.async_.partial_rollout,
            check_every=cfg.async_.check_every,
            weight_swap=cfg.async_.weight_swap,
        ),
        "critic": functools.partial(CriticWorker, cfg.critic, total_steps=steps),
        "reward_model": functools.partial(RewardModelWorker, cfg.reward.reward_model, output_key="rm_scores"),
        "cost_model": functools.partial(RewardModelWorker, cfg.reward.cost_model, output_key="cost_scores"),
        "cost_critic": functools.partial(CriticWorker, cfg.critic, total_steps=steps),
    }
    return {name: workers[name] for name in cfg.role_names()}


def group_pools(cfg: RLConfig, groups: int) -> list[ResourcePool]:
    """One resource pool per worker group: whole hosts each when `trainer.hosts` > 1 (bundles strictly spread, one
    process per host), else a share of the one host's devices (`TrainerConfig.group_shapes`); devices of the kind
    `trainer.device` resolves to on the connected Ray cluster (`resolve_device`)."""
    import ray

    trainer = cfg.trainer
    shapes = trainer.group_shapes(groups)
    device = resolve_device(trainer.device, ray.cluster_resources())
    if trainer.hosts > 1:
        nodes = sum(1 for node in ray.nodes() if node["Alive"])
        if nodes < trainer.hosts:
            raise ValueError(
                f"trainer.hosts={trainer.hosts}, but the Ray cluster has {nodes} node(s): start Ray on every host "
                "(`ray start --head` on the first, `ray start --address=HEAD:6379` on the others) and point hfjax at "
                "it with RAY_ADDRESS or trainer.ray_address"
            )
    return [
        ResourcePool([per_host] * hosts, device=device, strategy="STRICT_SPREAD" if hosts > 1 else "PACK")
        for hosts, per_host in shapes
    ]


def spawn_roles(cfg: RLConfig) -> tuple[dict[str, Any], list[ResourcePool]]:
    """Starts the worker groups; returns a handle per role and the resource pools (release them at the end)."""
    trainer = cfg.trainer
    workers = role_workers(cfg)
    groups = [{name: workers[name] for name in names} for names in cfg.worker_groups()]
    if trainer.backend == "local":
        if len(groups) > 1:
            raise ValueError(
                f"trainer.placement={trainer.placement!r} runs roles on separate devices; it needs trainer.backend=ray"
            )
        return colocate(groups[0]).spawn(None), []
    handles: dict[str, Any] = {}
    pools = group_pools(cfg, len(groups))
    for group, pool in zip(groups, pools, strict=True):
        handles.update(colocate(group).spawn(pool, trainer.liveness))
    return handles, pools
