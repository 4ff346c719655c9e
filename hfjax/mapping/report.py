"""Presenting search results: a rich table of the top candidates, and the best mapping as a plain config dict
(resource pools of device ranges, per-role layouts in `Layout.from_config` form, the prediction) that round-trips
back to a `DeviceMapping` for `CostModel.predict`. Imports `hfjax.mapping.{cluster,cost,search}` only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hfjax.mapping.cluster import GIB
from hfjax.mapping.cost import GEN_RULES, TRAIN_RULES, DeviceMapping, Sizes
from hfjax.mapping.dataflow import STAGES
from hfjax.mapping.search import Candidate


def device_ranges(groups: Sequence[tuple[tuple[str, ...], int]]) -> list[tuple[int, int]]:
    """(first device, count) per group: larger groups first, so whole-host groups start on a host boundary and
    groups smaller than a host (powers of two) never straddle one."""
    order = sorted(range(len(groups)), key=lambda i: -groups[i][1])
    ranges: dict[int, tuple[int, int]] = {}
    first = 0
    for i in order:
        ranges[i] = (first, groups[i][1])
        first += groups[i][1]
    return [ranges[i] for i in range(len(groups))]


def mapping_config(candidate: Candidate, algorithm: str = "") -> dict[str, Any]:
    """The candidate as plain data: `resource_pools` (roles, devices, first_device), per role its pool and
    `layout` (`train_layout` + `gen_layout` for the actor), and the predicted seconds."""
    mapping = candidate.mapping
    pools = []
    pool_of = {}
    for i, ((roles, count), (first, _)) in enumerate(zip(mapping.groups, device_ranges(mapping.groups), strict=True)):
        pools.append({"name": f"pool{i}", "roles": list(roles), "devices": count, "first_device": first})
        pool_of.update(dict.fromkeys(roles, f"pool{i}"))
    roles: dict[str, Any] = {}
    for role, sizes in mapping.layouts.items():
        cost = candidate.prediction.roles[role]
        if cost.gen is not None:
            roles[role] = {
                "pool": pool_of[role],
                "train_layout": sizes.config(TRAIN_RULES),
                "gen_layout": cost.gen.config(GEN_RULES),
            }
        else:
            roles[role] = {"pool": pool_of[role], "layout": sizes.config(TRAIN_RULES)}
    out: dict[str, Any] = {"algorithm": algorithm} if algorithm else {}
    out.update(
        placement=candidate.kind,
        resource_pools=pools,
        roles=roles,
        predicted={
            "iteration_s": round(candidate.iteration_seconds, 3),
            **{f"{s}_s": round(v, 3) for s, v in candidate.prediction.stage_seconds.items()},
        },
    )
    return out


def _sizes(layout: Mapping[str, Any], where: str) -> Sizes:
    mesh = layout.get("mesh") if isinstance(layout, Mapping) else None
    if not isinstance(mesh, Mapping) or set(mesh) - {"data", "fsdp", "tensor"}:
        raise ValueError(f"{where}.mesh: expected a mapping of data/fsdp/tensor sizes, got {mesh!r}")
    return Sizes(int(mesh.get("data", 1)), int(mesh.get("fsdp", 1)), int(mesh.get("tensor", 1)))


def mapping_from_config(config: Mapping[str, Any]) -> DeviceMapping:
    """The `DeviceMapping` of a dict written by `mapping_config` (or edited by hand)."""
    pools = {p["name"]: (tuple(p["roles"]), int(p["devices"])) for p in config["resource_pools"]}
    layouts, gen = {}, None
    for role, entry in config["roles"].items():
        if "train_layout" in entry:
            layouts[role] = _sizes(entry["train_layout"], f"roles.{role}.train_layout")
            gen = _sizes(entry["gen_layout"], f"roles.{role}.gen_layout")
        else:
            layouts[role] = _sizes(entry["layout"], f"roles.{role}.layout")
    return DeviceMapping(tuple(pools.values()), layouts, gen)


def write_mapping(candidate: Candidate, path: str | Path, algorithm: str = "") -> dict[str, Any]:
    """Writes `mapping_config(candidate)` as YAML and returns it."""
    import yaml

    config = mapping_config(candidate, algorithm)
    Path(path).write_text(yaml.safe_dump(config, sort_keys=False))
    return config


def _layouts(candidate: Candidate) -> str:
    parts = []
    for role, sizes in candidate.mapping.layouts.items():
        gen = candidate.prediction.roles[role].gen
        parts.append(f"{role} {sizes.describe()}" + (f" gen t{gen.tensor}" if gen else ""))
    return ", ".join(parts)


def print_candidates(candidates: Sequence[Candidate], title: str = "", top: int = 10) -> None:
    """A table of the `top` candidates: placement, layouts, seconds per stage and iteration, peak memory."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title or None)
    for col in ("#", "kind", "placement (devices)", "layouts", *STAGES, "iteration s", "peak GiB"):
        table.add_column(col, justify="right" if col in (*STAGES, "iteration s", "peak GiB", "#") else "left")
    for rank, c in enumerate(candidates[:top], 1):
        placement = " | ".join(f"{'+'.join(roles)}:{n}" for roles, n in c.mapping.groups)
        table.add_row(
            str(rank),
            c.kind,
            placement,
            _layouts(c),
            *(f"{c.prediction.stage_seconds[s]:.4g}" for s in STAGES),
            f"{c.iteration_seconds:.4g}",
            f"{max(c.prediction.group_peak_bytes) / GIB:.3g}",
        )
    Console(width=200).print(table)


def print_breakdown(candidate: Candidate) -> None:
    """Per role: its layout, seconds per stage, the terms behind them, and its bytes per device."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{candidate.kind}: {candidate.iteration_seconds:.4g} s per iteration")
    for col in ("role", "layout", *STAGES, "terms (s)", "memory (GiB per device)"):
        table.add_column(col)
    for role, cost in candidate.prediction.roles.items():
        layout = cost.sizes.describe() + (f" / gen {cost.gen.describe()}" if cost.gen else "")
        terms = ", ".join(f"{k} {v:.3g}" for k, v in cost.detail.items() if k not in ("gen_waves", "gen_kv_bytes"))
        if "gen_waves" in cost.detail:
            terms += f", waves {cost.detail['gen_waves']:.0f}"
        memory = ", ".join(f"{k} {v / GIB:.3g}" for k, v in cost.memory.items())
        table.add_row(role, layout, *(f"{cost.seconds[s]:.4g}" for s in STAGES), terms, memory)
    Console(width=220).print(table)
