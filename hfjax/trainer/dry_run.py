"""`hfjax train --dry-run`: what a run would start, without starting it — the resolved config, the worker groups
(roles, processes, devices), each role's layouts, and the cost model's memory per device of each group (master
weights, optimizer state, gradients, generation copy, KV cache, activations) against the device's memory when known.
"""

from __future__ import annotations

import yaml

from hfjax.config.rl import RLConfig
from hfjax.parallel.layout import Layout, LayoutError
from hfjax.predict.cluster import GIB
from hfjax.predict.cost import InfeasibleError
from hfjax.trainer.preflight import device_memory, predict_memory
from hfjax.typed_config import to_dict

UNKNOWN_MEMORY_GIB = 1 << 20  # the cost model needs a capacity; with none known, one that every run fits


def role_layouts(cfg: RLConfig) -> dict[str, str]:
    """Each configured layout of the run's roles, described (`Layout.describe`); unset ones are the defaults."""
    configured = {
        "actor (training)": cfg.actor.train_layout,
        "rollout (generation)": cfg.rollout.gen_layout,
        "critic": cfg.critic.layout if cfg.uses_critic else None,
        "reward model": cfg.reward.reward_model.layout if cfg.reward.reward_model.enabled else None,
        "cost model": cfg.reward.cost_model.layout if cfg.reward.cost_model.enabled else None,
    }
    return {
        role: Layout.from_config(layout, role).describe() if layout is not None else "default (data parallel)"
        for role, layout in configured.items()
        if layout is not None or role.startswith(("actor", "rollout"))
    }


def describe_run(cfg: RLConfig) -> str:
    """The dry run's report, as text."""
    lines = ["# resolved config", yaml.safe_dump(to_dict(cfg), sort_keys=False).rstrip(), "", "# placement"]
    trainer = cfg.trainer
    groups = cfg.worker_groups()
    shapes = trainer.group_shapes(len(groups))
    lines.append(f"placement {trainer.placement!r} on {trainer.hosts} host(s) x {trainer.devices_per_host} devices")
    for i, (roles, (hosts, per_host)) in enumerate(zip(groups, shapes, strict=True)):
        lines.append(
            f"  group {i}: {' + '.join(roles)}: {hosts} process(es) (one per host) x {per_host} devices = "
            f"{hosts * per_host} devices"
        )
    lines.append("# layouts")
    lines += [f"  {role}: {layout}" for role, layout in role_layouts(cfg).items()]
    lines.append("# memory per device (cost model)")
    lines += memory_lines(cfg)
    return "\n".join(lines)


def memory_lines(cfg: RLConfig) -> list[str]:
    """Each group's predicted peak bytes per device and each role's resident bytes, or why there is no estimate."""
    known = device_memory(cfg)
    try:
        prediction = predict_memory(cfg, known[0] if known else UNKNOWN_MEMORY_GIB * GIB)
    except InfeasibleError as exc:
        return [f"  does not fit: {exc}"]
    except (LayoutError, ValueError, OSError) as exc:
        return [f"  no estimate: {exc}"]
    where = (
        f" of {known[0] / GIB:.1f} GiB ({known[1]})" if known else " (device memory unknown: trainer.device_memory_gib)"
    )
    lines = [f"  group {i}: peak {peak / GIB:.2f} GiB{where}" for i, peak in enumerate(prediction.group_peak_bytes)]
    for role, cost in prediction.roles.items():
        lines.append(
            f"    {role}: resident {cost.static_bytes / GIB:.2f} GiB, transient {cost.transient_bytes / GIB:.2f} GiB"
        )
    return lines
