"""Where the roles of an RL run live: `colocate` (one worker group holds every role), `split` (the actor on one set
of devices, critic and score models on another) or `standalone` (every role its own group), on Ray or — for
`colocate` — in this process (`backend: local`).

Imports `hfjax.controller`, `hfjax.workers` and `hfjax.config`.
"""

from __future__ import annotations

import functools
from typing import Any

from hfjax.config import RLConfig
from hfjax.controller import ResourcePool, colocate
from hfjax.workers.actor import ActorRolloutRefWorker
from hfjax.workers.critic import CriticWorker
from hfjax.workers.reward_model import RewardModelWorker


def role_workers(cfg: RLConfig) -> dict[str, functools.partial]:
    """The worker of each role this run needs."""
    steps = cfg.trainer.total_steps
    actor_role = "actor_rollout_ref" if cfg.uses_ref else "actor_rollout"
    roles = {
        "actor": functools.partial(
            ActorRolloutRefWorker,
            cfg.actor,
            cfg.rollout,
            actor_role,
            total_steps=steps,
            max_prompt_length=cfg.data.max_prompt_length,
        )
    }
    if cfg.uses_critic:
        roles["critic"] = functools.partial(CriticWorker, cfg.critic, total_steps=steps)
    if cfg.reward.reward_model.enabled:
        roles["reward_model"] = functools.partial(RewardModelWorker, cfg.reward.reward_model, output_key="rm_scores")
    if cfg.algorithm.name == "safe_rlhf":
        roles["cost_model"] = functools.partial(RewardModelWorker, cfg.reward.cost_model, output_key="cost_scores")
        roles["cost_critic"] = functools.partial(CriticWorker, cfg.critic, total_steps=steps)
    return roles


def _groups(cfg: RLConfig, roles: dict[str, functools.partial]) -> list[dict[str, functools.partial]]:
    placement = cfg.trainer.placement
    if placement == "colocate" or len(roles) == 1:
        return [roles]
    if placement == "split":
        return [{"actor": roles["actor"]}, {k: v for k, v in roles.items() if k != "actor"}]
    return [{name: worker} for name, worker in roles.items()]


def spawn_roles(cfg: RLConfig) -> tuple[dict[str, Any], list[ResourcePool]]:
    """Starts the worker groups; returns a handle per role and the resource pools (release them at the end).
    Devices: `trainer.devices` per host, divided evenly between the groups of a split placement."""
    trainer = cfg.trainer
    groups = _groups(cfg, role_workers(cfg))
    if trainer.backend == "local":
        if len(groups) > 1:
            raise ValueError(
                f"trainer.placement={trainer.placement!r} runs roles on separate devices; it needs trainer.backend=ray"
            )
        return colocate(groups[0]).spawn(None), []
    per_group = trainer.devices // len(groups)
    if per_group < 1:
        raise ValueError(f"trainer.devices={trainer.devices} cannot give each of {len(groups)} groups a device")
    handles: dict[str, Any] = {}
    pools = []
    for group in groups:
        pool = ResourcePool([per_group], device=trainer.device)
        pools.append(pool)
        handles.update(colocate(group).spawn(pool))
    return handles, pools
