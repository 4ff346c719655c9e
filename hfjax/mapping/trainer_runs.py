"""The mappings `hfjax train` runs, and the run config each one becomes.

The trainer places its worker groups one of three ways (`trainer.placement`): `colocate` (every role in one group
on all devices), `split` (the actor on half the devices, every other role on the other half) or `standalone`
(each role its own group, the devices divided evenly). The reference policy lives in the actor's worker with the
actor's training layout, and the cost critic shares the critic's settings (`critic.layout`). `trainer_candidates`
enumerates exactly those mappings (every actor training x generation layout; for the other roles, their own fastest
layouts on their group) and predicts each with the cost model; `run_config` writes the chosen one into a run config
(`trainer.placement`, `trainer.devices`, `actor.train_layout`, `rollout.gen_layout`, `critic.layout`,
`reward.{reward_model,cost_model}.layout`; `trainer.backend: ray` for separate groups).
Imports `hfjax.parallel` and `hfjax.mapping.{cost,dataflow,search}`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from hfjax.mapping.cost import GEN_RULES, TRAIN_RULES, CostModel, DeviceMapping, InfeasibleError, Sizes, gen_sizes
from hfjax.mapping.dataflow import ModelShape
from hfjax.mapping.search import Candidate, train_sizes
from hfjax.parallel.layout import LayoutError

PLACEMENTS = ("colocate", "split", "standalone")
SHARED_LAYOUT = {"ref": "actor", "cost_critic": "critic"}  # role -> the role whose layout it runs with
LAYOUT_KEYS = {
    "critic": ("critic", "layout"),
    "reward": ("reward", "reward_model", "layout"),
    "cost": ("reward", "cost_model", "layout"),
}


def trainer_groups(roles: tuple[str, ...], devices: int, placement: str) -> tuple[tuple[tuple[str, ...], int], ...]:
    """The worker groups (roles, devices each) of `placement` for `roles` on `devices` devices."""
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


def _fastest_layouts(model: CostModel, role: str, shape: ModelShape, devices: int) -> list[Sizes]:
    """The layouts of `role` on `devices` devices that shard its parameters, its fastest alone first."""
    timed = []
    for sizes in train_sizes(devices):
        try:
            timed.append((model.role_cost(role, shape, sizes).total, sizes))
        except (LayoutError, InfeasibleError):
            continue
    return [sizes for _, sizes in sorted(timed)]


def trainer_candidates(model: CostModel, shapes: Mapping[str, ModelShape], devices: int) -> list[Candidate]:
    """Every mapping the trainer runs for the roles of `shapes` on `devices` devices that fits, fastest first."""
    roles = tuple(r for r in model.flow.roles if r in shapes)
    seen, out = set(), []
    for placement in PLACEMENTS:
        groups = trainer_groups(roles, devices, placement)
        if groups in seen or any(n < 1 for _, n in groups):
            continue
        seen.add(groups)
        group_devices = {r: n for g, n in groups for r in g}
        others = {
            r: _fastest_layouts(model, r, shapes[r], group_devices[r])
            for r in roles
            if r != "actor" and r not in SHARED_LAYOUT
        }
        for actor in train_sizes(group_devices["actor"]):
            for tensor in (2**i for i in range(actor.tensor.bit_length())):
                if actor.tensor % tensor:
                    continue
                for rank in range(max((len(v) for v in others.values()), default=1)):
                    layouts = {"actor": actor, **{r: v[min(rank, len(v) - 1)] for r, v in others.items() if v}}
                    layouts.update({r: layouts[of] for r, of in SHARED_LAYOUT.items() if r in roles and of in layouts})
                    mapping = DeviceMapping(groups, layouts, gen_sizes(group_devices["actor"], tensor))
                    try:
                        out.append(Candidate(mapping, model.predict(shapes, mapping)))
                        break  # the other roles' fastest layouts that fit
                    except (LayoutError, InfeasibleError, KeyError):
                        continue
    return sorted(out, key=lambda c: c.iteration_seconds)


def run_config(candidate: Candidate, base: Mapping[str, Any]) -> dict[str, Any]:
    """`base` (a run config dict) with the candidate's placement, devices and layouts filled in."""
    mapping = candidate.mapping
    roles = tuple(r for g, _ in mapping.groups for r in g)
    devices = sum(n for _, n in mapping.groups)
    placement = next(
        (
            p
            for p in PLACEMENTS
            if {frozenset(g) for g, _ in trainer_groups(roles, devices, p)} == {frozenset(g) for g, _ in mapping.groups}
        ),
        None,
    )
    if placement is None:
        raise ValueError(f"the trainer cannot run the placement {mapping.groups}; use trainer_candidates")
    out = copy.deepcopy(dict(base))

    def put(keys: tuple[str, ...], value: Any) -> None:
        node = out
        for key in keys[:-1]:
            if node.get(key) is None:
                node[key] = {}
            node = node[key]
        node[keys[-1]] = value

    put(("trainer", "placement"), placement)
    put(("trainer", "devices"), devices)
    if placement != "colocate":
        put(("trainer", "backend"), "ray")  # the in-process backend runs colocated roles only
    put(("actor", "train_layout"), mapping.layouts["actor"].config(TRAIN_RULES))
    put(("rollout", "gen_layout"), mapping.gen_layout.config(GEN_RULES))
    for role, keys in LAYOUT_KEYS.items():
        if role in mapping.layouts:
            put(keys, mapping.layouts[role].config(TRAIN_RULES))
    return out
