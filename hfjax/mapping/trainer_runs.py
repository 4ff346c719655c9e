"""The placements `hfjax train` runs, and the run-config overrides a mapping becomes.

The trainer places its worker groups one of three ways (`trainer.placement`): `colocate` (every role in one group
on all devices), `split` (the actor on half the devices, every other role on the other half) or `standalone`
(each role its own group, the devices divided evenly, the remainder idle), all on one host. The reference policy
lives in the actor's worker with the actor's training layout, and the cost critic runs with the critic's settings
(`critic.layout`). `trainer_groups` gives the groups of a placement (`MappingSearch(..., placements="trainer")`
enumerates their layouts); `run_overrides` turns a mapping into the run-config keys (`trainer.placement`,
`trainer.devices`, `actor.train_layout`, `rollout.gen_layout`, `critic.layout`,
`reward.{reward_model,cost_model}.layout`; `trainer.backend: ray` for separate groups) and `run_config` sets them
in a run config dict. Imports `hfjax.mapping.cost` only (not `hfjax.config`: the caller validates).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from hfjax.mapping.cost import GEN_RULES, TRAIN_RULES, DeviceMapping

PLACEMENTS = ("colocate", "split", "standalone")
SHARED_LAYOUT = {"ref": "actor", "cost_critic": "critic"}  # role -> the role whose layout it runs with
LAYOUT_KEYS = {"critic": "critic.layout", "reward": "reward.reward_model.layout", "cost": "reward.cost_model.layout"}
Groups = tuple[tuple[tuple[str, ...], int], ...]


def trainer_groups(roles: tuple[str, ...], devices: int, placement: str) -> Groups:
    """The worker groups (roles, devices each) of `placement` for `roles` on `devices` devices; the reference
    always in the actor's group (a placement with one worker is `colocate`)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"trainer.placement: expected one of {PLACEMENTS}, got {placement!r}")
    workers = [r for r in roles if r != "ref"]
    ref = ("ref",) if "ref" in roles else ()
    if placement == "colocate" or len(workers) == 1:
        groups = [tuple(roles)]
    elif placement == "split":
        groups = [("actor", *ref), tuple(r for r in workers if r != "actor")]
    else:
        groups = [(r, *ref) if r == "actor" else (r,) for r in workers]
    return tuple((g, devices // len(groups)) for g in groups)


def trainer_placement(mapping: DeviceMapping) -> str | None:
    """The `trainer.placement` that runs `mapping`'s groups with its device counts, or None."""
    roles = tuple(r for g, _ in mapping.groups for r in g)
    devices = sum(n for _, n in mapping.groups)
    target = {(frozenset(g), n) for g, n in mapping.groups}
    if any(mapping.layouts.get(r) != mapping.layouts.get(of) for r, of in SHARED_LAYOUT.items() if r in roles):
        return None
    for placement in PLACEMENTS:
        if {(frozenset(g), n) for g, n in trainer_groups(roles, devices, placement)} == target:
            return placement
    return None


def run_overrides(mapping: DeviceMapping) -> dict[str, Any]:
    """The run-config keys (dotted paths, as `hfjax train` takes `key=value` overrides) that make `hfjax train`
    run `mapping`; raises if the trainer cannot."""
    placement = trainer_placement(mapping)
    if placement is None or mapping.gen_layout is None:
        raise ValueError(
            f"hfjax train cannot run the mapping {mapping.groups} (reference and cost critic must share the "
            "actor's and critic's layouts; a generation layout is needed): search with placements='trainer'"
        )
    out: dict[str, Any] = {"trainer.placement": placement, "trainer.devices": sum(n for _, n in mapping.groups)}
    if placement != "colocate":
        out["trainer.backend"] = "ray"  # the in-process backend runs colocated roles only
    out["actor.train_layout"] = mapping.layouts["actor"].config(TRAIN_RULES)
    out["rollout.gen_layout"] = mapping.gen_layout.config(GEN_RULES)
    for role, key in LAYOUT_KEYS.items():
        if role in mapping.layouts:
            out[key] = mapping.layouts[role].config(TRAIN_RULES)
    return out


def run_config(mapping: DeviceMapping, base: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `base` (a run config dict, as `hfjax train` reads it) with `run_overrides(mapping)` set; each
    override replaces the whole value at its path (a layout replaces the base's layout, never merges into it)."""
    out = copy.deepcopy(dict(base))
    for path, value in run_overrides(mapping).items():
        *parents, leaf = path.split(".")
        node = out
        for key in parents:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[leaf] = value
    return out
