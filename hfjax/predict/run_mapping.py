"""A run config's mapping as the cost model reads it: the worker groups `hfjax train` makes of each placement
(`trainer.placement`: `colocate`, `split`, `standalone`, `disaggregated`) on its hosts (`trainer_groups`, through
`hfjax.controller.resource_pool.group_shapes`), and `config_mapping`, the `DeviceMapping` of a run config dict (its
groups and every role's layout). The reference policy lives in the actor's worker with the actor's training layout,
and the cost critic shares the critic's settings (`critic.layout`). Writing a chosen mapping into a run config is
`hfjax.automap.trainer_runs.run_config`; `without_mapping` removes the keys it writes."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from hfjax.controller.resource_pool import group_shapes
from hfjax.predict.cost import ROLLOUT, DeviceMapping
from hfjax.predict.sizes import Sizes

PLACEMENTS = ("colocate", "split", "standalone", "disaggregated")
SHARED_LAYOUT = {"ref": "actor", "cost_critic": "critic"}  # role -> the role whose layout it runs with
LAYOUT_KEYS = {
    "critic": ("critic", "layout"),
    "reward": ("reward", "reward_model", "layout"),
    "cost": ("reward", "cost_model", "layout"),
}
# `devices`: the older spelling that `hosts` and `devices_per_host` replace
TRAINER_KEYS = ("placement", "hosts", "devices_per_host", "group_devices", "devices")
MAPPED_KEYS = (
    *(("trainer", key) for key in TRAINER_KEYS),
    ("actor", "train_layout"),
    ("rollout", "gen_layout"),
    *LAYOUT_KEYS.values(),
)
Groups = tuple[tuple[tuple[str, ...], int], ...]


def placement_roles(roles: tuple[str, ...], placement: str) -> tuple[tuple[str, ...], ...]:
    """The roles of each worker group of `placement` (the reference policy with the actor; a disaggregated
    placement's rollout group, `ROLLOUT`, first)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"trainer.placement: expected one of {PLACEMENTS}, got {placement!r}")
    if placement == "disaggregated":
        return ((ROLLOUT,), tuple(roles))
    workers = [r for r in roles if r != "ref"]
    ref = ("ref",) if "ref" in roles else ()
    if placement == "colocate" or len(workers) == 1:
        return (tuple(roles),)
    if placement == "split":
        return (("actor", *ref), tuple(r for r in workers if r != "actor"))
    return tuple((r, *ref) if r == "actor" else (r,) for r in workers)


def trainer_groups(
    roles: tuple[str, ...],
    hosts: int,
    devices_per_host: int,
    placement: str,
    group_devices: Sequence[int] | None = None,
) -> Groups | None:
    """The worker groups (roles, devices each) of `placement` for `roles` on `hosts` x `devices_per_host`
    devices (`group_devices`: the trainer's uneven split of one host in `placement_roles`'s group order), or None
    where the trainer cannot run that placement there."""
    names = placement_roles(roles, placement)
    if group_devices is not None and len(names) > 2:
        raise ValueError(
            f"trainer.group_devices with placement {placement!r}: the cost model takes uneven splits of two "
            "groups only (split, disaggregated)"
        )
    shapes = group_shapes(hosts, devices_per_host, len(names), group_devices)
    return None if shapes is None else tuple((g, h * n) for g, (h, n) in zip(names, shapes, strict=True))


def _sizes(config: Mapping[str, Any] | None, devices: int, where: str) -> Sizes:
    """A layout config (`Layout.from_config` form; None: fsdp over every device) as mesh sizes."""
    if config is None:
        return Sizes(1, devices, 1)
    mesh = dict(config.get("mesh") or {})
    unknown = sorted(set(mesh) - {"data", "fsdp", "expert", "sequence", "tensor"})
    if unknown:
        raise ValueError(
            f"{where}: mesh axes {unknown} are not modelled; expected data, fsdp, expert, sequence and tensor"
        )
    sizes = (int(mesh.get(axis, 1)) for axis in ("data", "fsdp", "tensor", "expert", "sequence"))
    return Sizes(*sizes)


def config_mapping(config: Mapping[str, Any], roles: tuple[str, ...]) -> DeviceMapping:
    """The mapping a run config dict (`trainer`, `actor.train_layout`, `rollout.gen_layout`, role layouts) gives
    `roles` (the dataflow's roles that have a model), for `CostModel.predict`."""
    trainer = config.get("trainer") or {}
    hosts, per_host = int(trainer.get("hosts", 1)), int(trainer.get("devices_per_host", 8))
    placement = trainer.get("placement", "colocate")
    groups = trainer_groups(roles, hosts, per_host, placement, trainer.get("group_devices"))
    if groups is None:
        raise ValueError(f"trainer.placement={placement!r} cannot run on {hosts} host(s) x {per_host} devices")
    devices = {r: n for g, n in groups for r in g}
    generator = ROLLOUT if placement == "disaggregated" else "actor"

    def layout(keys: tuple[str, ...], role: str) -> Sizes:
        node: Any = config
        for key in keys:
            node = node.get(key) if isinstance(node, Mapping) else None
        return _sizes(node, devices[role], ".".join(keys))

    layouts = {"actor": layout(("actor", "train_layout"), "actor")}
    layouts.update({r: layout(keys, r) for r, keys in LAYOUT_KEYS.items() if r in roles})
    layouts.update({r: layouts[of] for r, of in SHARED_LAYOUT.items() if r in roles and of in layouts})
    gen = config.get("rollout", {}).get("gen_layout")
    return DeviceMapping(groups, layouts, _sizes(gen, devices[generator], "rollout.gen_layout") if gen else None)


def without_mapping(base: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `base` (a run config dict) without the keys `run_config` writes, nor `trainer.devices`: what is
    left loads whichever cluster the original was written for."""
    out = copy.deepcopy(dict(base))
    for keys in MAPPED_KEYS:
        node = out
        for key in keys[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(keys[-1], None)
    return out
