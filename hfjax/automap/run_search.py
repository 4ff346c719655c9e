"""`hfjax automap`: the auto-mapper applied to an RL run config.

The run config (the one `hfjax train` reads) gives the algorithm, the models of each role and the workload (its own
placement, hosts, devices and layouts are ignored: they may be another cluster's); the search covers the mappings
the trainer runs on the cluster's hosts (`hfjax.automap.trainer_runs.trainer_candidates`: whole hosts per worker
group on several hosts, one generation loop per host); the best is written as the same run config with its
placement, the cluster as `trainer.hosts` and `trainer.devices_per_host` (an old `trainer.devices` removed) and its
layouts filled in, checked as `hfjax train` checks it, so `hfjax train MAPPED.yaml` runs it as is. The prediction
for a config's own mapping is `hfjax.predict.run_config.predict_run`.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from hfjax.automap.report import print_candidates
from hfjax.automap.search import Candidate
from hfjax.automap.trainer_runs import run_config, trainer_candidates
from hfjax.config.rl import RLConfig, load_rl_config
from hfjax.predict.cluster import ClusterSpec
from hfjax.predict.cost import CostModel, DeviceMapping
from hfjax.predict.dataflow import role_shapes
from hfjax.predict.run_config import run_cost_options, run_dataflow, run_models, run_workload
from hfjax.predict.run_mapping import without_mapping

REMAT_CHOICES = ("none", "full")  # what the cost model prices (`dots` it does not tell apart from `none`)


def _micro_batch_rows(cfg: RLConfig, mapping: DeviceMapping, per_rank: int, per_host: int) -> dict[str, int] | None:
    """`actor.micro_batch_size` (and the critic's) that give `per_rank` sequences per data-parallel rank of each
    role's layout in `mapping` (on hosts of `per_host` devices), or None where one would not divide its mini-batch
    or, on several hosts, its hosts' equal shares."""
    hosts = max(1, next(n for g, n in mapping.groups if "actor" in g) // per_host)  # every group's: whole hosts
    out = {}
    for role in ("actor", "critic") if "critic" in mapping.layouts else ("actor",):
        sizes, section = mapping.layouts[role], getattr(cfg, role)
        rows = per_rank * sizes.batch_parts
        if rows > section.ppo_mini_batch_size or section.ppo_mini_batch_size % rows or rows % hosts:
            return None
        out[f"{role}.micro_batch_size"] = rows
    return out


def run_candidates(cfg: RLConfig, cluster: ClusterSpec, tune: bool = True) -> list[Candidate]:
    """The mappings the trainer runs for `cfg` on `cluster` that fit, fastest predicted first. `tune`: each also
    under every per-rank micro-batch size (powers of two up to a mini-batch) and rematerialisation the cost model
    prices (`REMAT_CHOICES`), the chosen ones in the candidate's `settings` (`actor.micro_batch_size`,
    `actor.remat`, the critic's too); else priced with `cfg`'s own. Sequence packing is not searched: at the
    cost model's fixed lengths it is the micro-batch it amounts to (the sweep measures it)."""
    flow = run_dataflow(cfg)
    shapes = role_shapes(flow, run_models(cfg))
    workload, options = run_workload(cfg), run_cost_options(cfg)
    if not tune:
        return trainer_candidates(CostModel(cluster, flow, workload, options), shapes)
    trained = ("actor", "critic") if cfg.uses_critic else ("actor",)
    rows = min(cfg.actor.ppo_mini_batch_size, cfg.data.train_batch_size * cfg.rollout.n)
    out = []
    for remat in REMAT_CHOICES:
        priced = dataclasses.replace(options, remat=remat != "none")
        for per_rank in reversed([2**i for i in range(rows.bit_length())]):
            model = CostModel(cluster, flow, dataclasses.replace(workload, micro_batch_seqs=per_rank), priced)
            for candidate in trainer_candidates(model, shapes):
                sizes = _micro_batch_rows(cfg, candidate.mapping, per_rank, cluster.devices_per_host)
                if sizes is not None:
                    settings = (*sizes.items(), *((f"{role}.remat", remat) for role in trained))
                    out.append(dataclasses.replace(candidate, settings=settings))
    # of two predicted equally fast (the model prices no per-row kernel efficiency), the one with more memory left
    return sorted(out, key=lambda c: (c.iteration_seconds, max(c.prediction.group_peak_bytes)))


Check = Callable[[RLConfig], str | None]  # a mapped run config -> why it cannot run there, or None


def automap_run(
    cluster_path: str,
    config_path: str,
    out: str | None,
    top: int = 10,
    tune: bool = True,
    check: Check | None = None,
) -> int:
    """Prints the `top` mappings of the run at `config_path` on the cluster at `cluster_path` (`tune`: with
    micro-batch sizes and rematerialisation searched, `run_candidates`); writes the best as a run config to `out`.
    `check` (e.g. the compiler's memory check for a target): the best is the first of the `top` whose run config it
    passes, and those it drops are printed with its reason. Returns 0, or 1 when no mapping fits."""
    if out and Path(out).resolve() == Path(config_path).resolve():
        raise ValueError(f"--out {out}: would overwrite the run config it is computed from; choose another path")
    raw: dict[str, Any] = yaml.safe_load(Path(config_path).read_text()) or {}
    cfg = load_rl_config(without_mapping(raw))  # its layouts and devices may be another cluster's
    cluster = ClusterSpec.from_yaml(cluster_path)
    candidates = run_candidates(cfg, cluster, tune)
    title = f"{cfg.algorithm.name} on {cluster.hosts}x{cluster.devices_per_host} devices (placements hfjax train runs)"
    print_candidates(candidates, title, top)
    if not candidates:
        print("no mapping fits: see the memory reasons above, or give the cluster more devices or memory")
        return 1
    best, mapped = _first_passing(candidates[:top], raw, cluster, check)
    if best is None:
        print(f"none of the {min(top, len(candidates))} best mappings passes the check: raise --top, or see above")
        return 1
    if out:
        header = (
            f"# hfjax automap of {config_path} on {cluster_path}: predicted {best.iteration_seconds:.3f} s per "
            "iteration (" + ", ".join(f"{s} {v:.3f} s" for s, v in best.prediction.stage_seconds.items()) + ")\n"
        )
        text = header + yaml.safe_dump(mapped, sort_keys=False)
        target = Path(out)
        with tempfile.NamedTemporaryFile("w", dir=target.parent or ".", delete=False, suffix=".yaml") as f:
            f.write(text)
        os.replace(f.name, target)  # never a half-written config
        print(f"wrote the best mapping as a run config to {out} (run it with: hfjax train {out})")
    return 0


def _first_passing(
    candidates: list[Candidate], raw: Mapping[str, Any], cluster: ClusterSpec, check: Check | None
) -> tuple[Candidate | None, dict[str, Any] | None]:
    """The first candidate whose run config loads as `hfjax train` loads it and passes `check`, with that config."""
    for rank, candidate in enumerate(candidates, 1):
        mapped = run_config(candidate, raw, cluster)
        loaded = load_rl_config(mapped)  # what `hfjax train` checks first, before anything is written
        reason = check(loaded) if check is not None else None
        if reason is None:
            if check is not None:
                print(f"mapping {rank} passes the check")
            return candidate, mapped
        print(f"mapping {rank} dropped: {reason}")
    return None, None
