"""HybridFlow's device-mapping search (§6, Algorithm 1) over the cost model.

For every placement (a set partition of the roles into colocated groups: Bell(4) = 15 for PPO's four models),
every allocation of the cluster's devices to the groups (device counts: powers of two below a host, whole hosts
above; each group from its memory minimum upward; all devices used), and every layout of each role on its group
(data x fsdp x tensor; the actor also its generation tensor size t_g dividing t), the predicted iteration is
sum over stages of the max over groups of the sum of their roles' seconds. A group's best layouts are cached per
(group, device count), each role's layout costs per (role, device count).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from hfjax.parallel.layout import LayoutError
from hfjax.predict.cluster import ClusterSpec
from hfjax.predict.cost import (
    ROLLOUT,
    CostModel,
    CostOptions,
    DeviceMapping,
    Prediction,
    RoleCost,
    stage_seconds,
)
from hfjax.predict.dataflow import ModelShape, Workload, dataflow, role_shapes
from hfjax.predict.sizes import GEN_RULES, Sizes, gen_sizes, layout_of

Placement = tuple[tuple[str, ...], ...]


def set_partitions(items: Sequence[str]) -> list[Placement]:
    """All partitions of `items` into non-empty groups (order of groups and within groups follows `items`)."""
    if not items:
        return [()]
    first, rest = items[0], items[1:]
    out = []
    for partition in set_partitions(rest):
        out.append(((first,), *partition))
        for i in range(len(partition)):
            out.append((*partition[:i], (first, *partition[i]), *partition[i + 1 :]))
    return out


def device_counts(total: int, per_host: int) -> list[int]:
    """Device counts a group may get: powers of two below a host, multiples of a host, up to `total`."""
    small = [2**i for i in range(per_host.bit_length()) if 2**i < per_host]
    return sorted({c for c in [*small, *range(per_host, total + 1, per_host)] if c <= total})


def allocations(total: int, minimums: Sequence[int], counts: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Device counts per group, each from `counts` and at least its minimum, summing to `total`."""
    if not minimums:
        if total == 0:
            yield ()
        return
    rest_min = sum(minimums[1:])
    for c in counts:
        if minimums[0] <= c <= total - rest_min:
            for tail in allocations(total - c, minimums[1:], counts):
                yield (c, *tail)


def train_sizes(devices: int) -> list[Sizes]:
    """Every data x fsdp x tensor factorization of `devices` with a power-of-two tensor size."""
    out = []
    t = 1
    while t <= devices and devices % t == 0:
        rest = devices // t
        out += [Sizes(rest // f, f, t) for f in range(1, rest + 1) if rest % f == 0]
        t *= 2
    return out


def _pareto(costs: list[RoleCost], generating: bool) -> list[RoleCost]:
    """Costs not dominated in (seconds, resident bytes, transient bytes), fastest first. For the generating role
    also in tensor size (t bounds t_g) and fsdp x tensor (more training shards, more bytes moved to generate)."""

    def key(c: RoleCost) -> tuple:
        extra = (c.sizes.fsdp * c.sizes.tensor,) if generating else ()
        return (c.total, c.static_bytes, c.transient_bytes, *extra)

    def dominates(a: tuple, b: tuple) -> bool:
        return a != b and all(x <= y for x, y in zip(a, b, strict=True))

    keys = [key(c) for c in costs]
    same_t = [[o for o, oc in zip(keys, costs, strict=True) if oc.sizes.tensor == c.sizes.tensor] for c in costs]
    kept = [
        c
        for c, k, peers in zip(costs, keys, same_t, strict=True)
        if not any(dominates(o, k) for o in (peers if generating else keys))
    ]
    return sorted(kept, key=lambda c: c.total)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One mapping with its predicted iteration, and the run-config keys (`section.key`, value) it was priced
    with besides the mapping (the micro-batch sizes and rematerialisation an RL config search chose; empty: the
    run config's own)."""

    mapping: DeviceMapping
    prediction: Prediction
    settings: tuple[tuple[str, Any], ...] = ()

    @property
    def iteration_seconds(self) -> float:
        return self.prediction.iteration_seconds

    @property
    def kind(self) -> str:
        """`colocate` (one group), `disaggregated` (a rollout group beside the rest), `standalone` (every role
        alone) or `split`."""
        groups = self.mapping.groups
        if len(groups) == 1:
            return "colocate"
        if any(roles == (ROLLOUT,) for roles, _ in groups):
            return "disaggregated"
        return "standalone" if all(len(roles) == 1 for roles, _ in groups) else "split"


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """Ranked candidates, why placements were rejected, and how much was searched."""

    candidates: list[Candidate]
    rejected: dict[str, str]
    placements: int
    allocations: int
    seconds: float


class MappingSearch:
    """Algorithm 1 for the roles of `shapes` under `model`."""

    def __init__(self, model: CostModel, shapes: Mapping[str, ModelShape]):
        self.model, self.shapes = model, dict(shapes)
        self.roles = tuple(r for r in model.flow.roles if r in self.shapes)
        self.counts = device_counts(model.cluster.num_devices, model.cluster.devices_per_host)
        self.group_best = functools.cache(self._group_best)
        self.role_options = functools.cache(self._role_options)

    def _role_options(self, role: str, devices: int) -> tuple[list[RoleCost], str]:
        """Pareto-optimal layouts of `role` on `devices`, or an empty list and why none divides."""
        costs, problems = [], []
        for sizes in train_sizes(devices):
            try:
                costs.append(self.model.role_cost(role, self.shapes[role], sizes))
            except LayoutError as e:
                problems.append(f"{sizes.describe()}: {e}")
        return _pareto(costs, role in self.model.flow.generation), "; ".join(problems[:2])

    def _gen_options(self, role: str, devices: int, tensor: int) -> list[Sizes]:
        out = []
        for t_g in (2**i for i in range(tensor.bit_length()) if tensor % 2**i == 0):
            sizes = gen_sizes(devices, t_g)
            try:
                self.shapes[role].shard_elements(layout_of(sizes, GEN_RULES))
            except LayoutError:
                continue
            out.append(sizes)
        return out

    def _group_best(self, group: tuple[str, ...], devices: int) -> tuple[list[RoleCost], float] | str:
        """The fastest feasible layouts of colocated `group` on `devices`, with their peak bytes; else the reason.
        Branch and bound over the roles' Pareto layouts (generating role last), each bounded below by its
        seconds plus, for the generating role, its generation with unlimited KV memory at the best t_g."""
        gen_role = next((r for r in group if r in self.model.flow.generation), None)
        order = [r for r in group if r != gen_role] + ([gen_role] if gen_role else [])
        options: list[list[tuple[float, RoleCost]]] = []
        for role in order:
            opts, why = self.role_options(role, devices)
            if not opts:
                return f"{role}: no layout of {devices} devices divides the model ({why})"
            floors = [c.total + (self._generation_floor(c, devices) if role == gen_role else 0.0) for c in opts]
            options.append(sorted(zip(floors, opts, strict=True), key=lambda fc: fc[0]))
        bound = [0.0] * (len(order) + 1)
        for i in range(len(order) - 1, -1, -1):
            bound[i] = bound[i + 1] + options[i][0][0]
        usable = self.model.usable_bytes
        best: list = [math.inf, None, None]  # total, (costs, peak), the first failure's reason

        def leaf(chosen: list[RoleCost]) -> None:
            gens = [None] if gen_role is None else self._gen_options(gen_role, devices, chosen[-1].sizes.tensor)
            for gen in gens:
                done = self.model.finish_group(chosen, self.shapes, devices, gen)
                if isinstance(done, str):
                    best[2] = best[2] or done
                    continue
                total = sum(c.total for c in done[0])
                if total < best[0]:
                    best[0], best[1] = total, done

        def visit(i: int, chosen: list[RoleCost], static: float, transient: float, floor: float) -> None:
            if floor + bound[i] >= best[0]:
                return
            if static + transient > usable:
                best[2] = best[2] or self.model.memory_reason(chosen, devices)
                return
            if i == len(order):
                leaf(chosen)
                return
            for f, c in options[i]:
                visit(i + 1, [*chosen, c], static + c.static_bytes, max(transient, c.transient_bytes), floor + f)

        visit(0, [], 0.0, 0.0, 0.0)
        if best[1] is None:
            by_role = dict(zip(order, options, strict=True))
            smallest = [
                min((c for _, c in by_role[r]), key=lambda c: c.static_bytes + c.transient_bytes) for r in group
            ]
            return self.model.memory_reason(smallest, devices) or best[2] or f"{group}: no feasible layout"
        return best[1]

    def _generation_floor(self, cost: RoleCost, devices: int) -> float:
        """Fewest generation seconds of the actor under `cost`'s training layout: any KV budget takes as long."""
        shape = self.shapes[cost.role]
        gens = self._gen_options(cost.role, devices, cost.sizes.tensor)
        return min((self.model.generate(shape, cost.sizes, g, None)["seconds"] for g in gens), default=math.inf)

    def min_devices(self, group: tuple[str, ...]) -> tuple[int | None, str]:
        """The smallest device count on which `group` fits (Algorithm 1's get_min_alloc), or None and why."""
        reason = ""
        for count in self.counts:
            out = self.group_best(group, count)
            if not isinstance(out, str):
                return count, ""
            reason = out
        return None, reason

    def run(self, top: int | None = None) -> SearchResult:
        start = time.perf_counter()
        total = self.model.cluster.num_devices
        candidates, rejected, tried = [], {}, 0
        placements = set_partitions(self.roles)
        for placement in placements:
            minimums = []
            for group in placement:
                count, why = self.min_devices(group)
                if count is None:
                    rejected[_name(placement)] = why
                    break
                minimums.append(count)
            else:
                found, why = 0, ""
                for alloc in allocations(total, minimums, self.counts):
                    tried += 1
                    groups = [self.group_best(g, n) for g, n in zip(placement, alloc, strict=True)]
                    failed = [g for g in groups if isinstance(g, str)]
                    if failed:
                        why = why or failed[0]
                    else:
                        candidates.append(_candidate(placement, alloc, groups, self.model.concurrent_groups))
                        found += 1
                if not found:
                    mins = ", ".join(f"{'+'.join(g)} >= {n}" for g, n in zip(placement, minimums, strict=True))
                    rejected[_name(placement)] = (
                        f"no allocation of {total} devices with the group minimums ({mins}) fits"
                        + (f": {why}" if why else "")
                    )
        candidates.sort(key=lambda c: c.iteration_seconds)
        return SearchResult(
            candidates[:top] if top else candidates, rejected, len(placements), tried, time.perf_counter() - start
        )


def _name(placement: Placement) -> str:
    return " | ".join("+".join(g) for g in placement)


def _candidate(placement: Placement, alloc: tuple[int, ...], groups: list, concurrent: bool) -> Candidate:
    roles = {c.role: c for costs, _ in groups for c in costs}
    gen = next((c.gen for c in roles.values() if c.gen is not None), None)
    mapping = DeviceMapping(
        tuple(zip(placement, alloc, strict=True)), {r: c.sizes for r, c in roles.items()}, gen_layout=gen
    )
    stages = stage_seconds([[roles[r] for r in group] for group in placement], concurrent)
    return Candidate(mapping, Prediction(stages, roles, tuple(peak for _, peak in groups)))


def automap(
    cluster: ClusterSpec | str | Mapping[str, Any],
    algorithm: str,
    models: Mapping[str, Any],
    workload: Workload | Mapping[str, Any],
    top: int = 10,
    options: CostOptions | None = None,
) -> list[Candidate]:
    """The `top` mappings of `algorithm`'s roles (`models`: role -> ModelConfig, named shape, HF directory or
    config dict) on `cluster` (a spec, a YAML path or a dict) for `workload`, fastest predicted first."""
    if isinstance(cluster, str):
        cluster = ClusterSpec.from_yaml(cluster)
    elif isinstance(cluster, Mapping):
        cluster = ClusterSpec.from_dict(cluster)
    if isinstance(workload, Mapping):
        workload = Workload.from_dict(workload)
    flow = dataflow(algorithm)
    model = CostModel(cluster, flow, workload, options)
    return MappingSearch(model, role_shapes(flow, models)).run(top).candidates
