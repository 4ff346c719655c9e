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
`reward.{reward_model,cost_model}.layout`; `trainer.backend: ray` for separate groups or several hosts), and
`config_mapping` reads a run config's mapping back.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from hfjax.automap.cluster import ClusterSpec
from hfjax.automap.cost import ROLLOUT, CostModel, DeviceMapping, InfeasibleError
from hfjax.automap.dataflow import ModelShape
from hfjax.automap.search import Candidate, train_sizes
from hfjax.automap.sizes import GEN_RULES, TRAIN_RULES, Sizes, gen_sizes, layout_of
from hfjax.controller.resource_pool import group_shapes
from hfjax.parallel.host_local import check_per_host_generation
from hfjax.parallel.layout import LayoutError

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
