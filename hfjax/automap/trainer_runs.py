"""The mappings `hfjax train` runs, and the run config each one becomes.

The trainer places its worker groups one of four ways (`trainer.placement`): `colocate` (every role in one group),
`split` (the actor in one group, every other role in another), `standalone` (each role its own group) or
`disaggregated` (a rollout group that only generates, and every role in a trainer group; priced as a synchronous
run). On one host the groups share its devices evenly, or as `trainer.group_devices` splits them (two groups); on
several hosts each group gets whole hosts (`trainer.hosts` a multiple of the group count) with all their devices
(`hfjax.controller.resource_pool.group_shapes`). Generation on a group of several hosts runs one loop per host, so
its layout's data-parallel replicas must each lie inside a host (`hfjax.parallel.host_local`). The reference policy
lives in the actor's worker with the actor's training layout, and the cost critic shares the critic's settings
(`critic.layout`). `trainer_candidates` enumerates exactly those mappings (every placement and split, every actor
training x generation layout; for the other roles, their own fastest layouts on their group) and predicts each with
the cost model; `run_config` writes the chosen one into a run config (`trainer.placement`, `trainer.hosts`,
`trainer.devices_per_host`, `trainer.group_devices`, `actor.train_layout`, `rollout.gen_layout`, `critic.layout`,
`reward.{reward_model,cost_model}.layout`; `trainer.backend: ray` for separate groups or several hosts);
`hfjax.predict.run_mapping.config_mapping` reads a run config's mapping back.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from hfjax.automap.search import Candidate, train_sizes
from hfjax.controller.resource_pool import group_shapes
from hfjax.parallel.host_local import check_per_host_generation
from hfjax.parallel.layout import LayoutError
from hfjax.predict.cluster import ClusterSpec
from hfjax.predict.cost import ROLLOUT, CostModel, DeviceMapping, InfeasibleError
from hfjax.predict.dataflow import ModelShape
from hfjax.predict.run_mapping import LAYOUT_KEYS, PLACEMENTS, SHARED_LAYOUT, Groups, placement_roles, trainer_groups
from hfjax.predict.sizes import GEN_RULES, TRAIN_RULES, Sizes, gen_sizes, layout_of


def host_gen_sizes(hosts: int, devices_per_host: int, tensor: int) -> Sizes | None:
    """The generation layout of `tensor`-way replicas on a group of `hosts` x `devices_per_host` devices, or None
    where it does not divide or (several hosts: one generation loop each) a replica would span hosts."""
    devices = hosts * devices_per_host
    if devices % tensor:
        return None
    sizes = gen_sizes(devices, tensor)
    try:
        check_per_host_generation(layout_of(sizes, GEN_RULES), hosts)  # data a multiple of hosts: t divides a host
    except LayoutError:
        return None
    return sizes


def _fastest_layouts(model: CostModel, role: str, shape: ModelShape, devices: int) -> list[Sizes]:
    """The layouts of `role` on `devices` devices that shard its parameters, its fastest alone first."""
    timed = []
    for sizes in train_sizes(devices):
        try:
            timed.append((model.role_cost(role, shape, sizes).total, sizes))
        except (LayoutError, InfeasibleError):
            continue
    return [sizes for _, sizes in sorted(timed)]


def _splits(hosts: int, devices_per_host: int, groups: int) -> list[tuple[int, int] | None]:
    """The device splits the trainer runs for `groups` worker groups: even (None), and on one host every uneven
    split between two groups (`trainer.group_devices`)."""
    if hosts != 1 or groups != 2:
        return [None]
    return [None, *((n, devices_per_host - n) for n in range(1, devices_per_host) if 2 * n != devices_per_host)]


def trainer_candidates(model: CostModel, shapes: Mapping[str, ModelShape]) -> list[Candidate]:
    """Every mapping the trainer runs for the roles of `shapes` on the model's cluster that fits, fastest first:
    each placement, each split of one host between two groups, each actor training x generation layout."""
    roles = tuple(r for r in model.flow.roles if r in shapes)
    hosts, per_host = model.cluster.hosts, model.cluster.devices_per_host
    seen, out = set(), []
    for placement in PLACEMENTS:
        names = placement_roles(roles, placement)
        for split in _splits(hosts, per_host, len(names)):
            group_shape = group_shapes(hosts, per_host, len(names), split)
            if group_shape is None or (names, split) in seen:
                continue
            seen.add((names, split))
            groups = tuple((g, h * n) for g, (h, n) in zip(names, group_shape, strict=True))
            out += _group_candidates(model, shapes, roles, groups, dict(zip(names, group_shape, strict=True)))
    return sorted(out, key=lambda c: c.iteration_seconds)


def _group_candidates(
    model: CostModel,
    shapes: Mapping[str, ModelShape],
    roles: tuple[str, ...],
    groups: Groups,
    shape_of: Mapping[tuple[str, ...], tuple[int, int]],
) -> list[Candidate]:
    """The candidates of one placement and split: every actor training layout x generation layout (on the actor's
    group, replicas that the HybridEngine's containment allows; on a rollout group, any), the other roles on their
    own fastest layouts that fit."""
    group_devices = {r: n for g, n in groups for r in g}
    generator = next((g for g, _ in groups if g == (ROLLOUT,)), None) or next(g for g, _ in groups if "actor" in g)
    others = {
        r: _fastest_layouts(model, r, shapes[r], group_devices[r])
        for r in roles
        if r != "actor" and r not in SHARED_LAYOUT
    }
    out = []
    for actor in train_sizes(group_devices["actor"]):
        widest = shape_of[generator][1] if generator == (ROLLOUT,) else actor.tensor
        for tensor in (2**i for i in range(widest.bit_length())):
            contained = generator == (ROLLOUT,) or actor.tensor % tensor == 0
            gen = host_gen_sizes(*shape_of[generator], tensor) if contained else None
            if gen is None:
                continue
            for rank in range(max((len(v) for v in others.values()), default=1)):
                layouts = {"actor": actor, **{r: v[min(rank, len(v) - 1)] for r, v in others.items() if v}}
                layouts.update({r: layouts[of] for r, of in SHARED_LAYOUT.items() if r in roles and of in layouts})
                mapping = DeviceMapping(groups, layouts, gen)
                try:
                    out.append(Candidate(mapping, model.predict(shapes, mapping)))
                    break  # the other roles' fastest layouts that fit
                except (LayoutError, InfeasibleError, KeyError):
                    continue
    return out


def trainer_placement(groups: Groups, cluster: ClusterSpec) -> tuple[str, tuple[int, ...] | None] | None:
    """The `trainer.placement` and `trainer.group_devices` (None: even) whose worker groups on `cluster` are
    `groups` (roles and devices), or None."""
    roles = tuple(r for g, _ in groups for r in g if r != ROLLOUT)
    wanted = {(frozenset(g), n) for g, n in groups}
    for placement in PLACEMENTS:
        for split in _splits(cluster.hosts, cluster.devices_per_host, len(groups)):
            try:
                found = trainer_groups(roles, cluster.hosts, cluster.devices_per_host, placement, split)
            except ValueError:  # a split of more than two groups
                continue
            if found is not None and {(frozenset(g), n) for g, n in found} == wanted:
                return placement, split
    return None


def run_config(candidate: Candidate, base: Mapping[str, Any], cluster: ClusterSpec) -> dict[str, Any]:
    """`base` (a run config dict) with the candidate's placement, layouts and settings on `cluster` filled in (its
    hosts and devices per host as `trainer.hosts` and `trainer.devices_per_host`; a `trainer.devices` key removed)."""
    mapping = candidate.mapping
    found = trainer_placement(mapping.groups, cluster)
    if found is None:
        raise ValueError(
            f"the trainer cannot run the placement {mapping.groups} on {cluster.hosts} host(s) x "
            f"{cluster.devices_per_host} devices; use trainer_candidates"
        )
    out = copy.deepcopy(dict(base))
    if isinstance(out.get("trainer"), dict):
        out["trainer"].pop("devices", None)  # replaced by hosts and devices_per_host: loading it is an error

    def put(keys: tuple[str, ...], value: Any) -> None:
        node = out
        for key in keys[:-1]:
            if node.get(key) is None:
                node[key] = {}
            node = node[key]
        node[keys[-1]] = value

    placement, split = found
    put(("trainer", "placement"), placement)
    put(("trainer", "hosts"), cluster.hosts)
    put(("trainer", "devices_per_host"), cluster.devices_per_host)
    if split is not None:
        put(("trainer", "group_devices"), list(split))
    if placement != "colocate" or cluster.hosts > 1:
        put(("trainer", "backend"), "ray")  # the in-process backend runs colocated roles on one host only
    for key, value in candidate.settings:
        put(tuple(key.split(".")), value)
    put(("actor", "train_layout"), mapping.layouts["actor"].config(TRAIN_RULES))
    put(("rollout", "gen_layout"), mapping.gen_layout.config(GEN_RULES))
    for role, keys in LAYOUT_KEYS.items():
        if role in mapping.layouts:
            put(keys, mapping.layouts[role].config(TRAIN_RULES))
    return out
