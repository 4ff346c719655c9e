"""`hfjax automap`: the auto-mapper (`hfjax.automap`) applied to an RL run config.

The run config (the one `hfjax train` reads) gives the algorithm, the models of each role and the workload (its own
placement, hosts, devices and layouts are ignored: they may be another cluster's); the search covers the mappings
the trainer runs on the cluster's hosts (`hfjax.automap.trainer_runs.trainer_candidates`: whole hosts per worker
group on several hosts, one generation loop per host); the best is written as the same run config with its
placement, the cluster as `trainer.hosts` and `trainer.devices_per_host` (an old `trainer.devices` removed) and its
layouts filled in, checked as `hfjax train` checks it, so `hfjax train MAPPED.yaml` runs it as is. `predict_run`
predicts a config's own mapping instead (e.g. to check that it fits its hardware's memory).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from hfjax.automap import ClusterSpec, CostModel, CostOptions, Workload, dataflow, print_candidates, role_shapes
from hfjax.automap.cost import Prediction
from hfjax.automap.dataflow import Dataflow
from hfjax.automap.trainer_runs import config_mapping, run_config, trainer_candidates, without_mapping
from hfjax.config.rl import RLConfig, load_rl_config
from hfjax.typed_config import to_dict


def run_dataflow(cfg: RLConfig) -> Dataflow:
    """The algorithm's roles per stage as `cfg` runs them: without the actor's old-log-prob pass where its update
    computes those itself (`RLConfig.reuses_update_log_probs`: GRPO's default with one optimizer step)."""
    flow = dataflow(cfg.algorithm.name)
    if cfg.reuses_update_log_probs:
        flow = dataclasses.replace(flow, inference=tuple(r for r in flow.inference if r != "actor"))
    return flow


def run_workload(cfg: RLConfig, batch_ranks: int = 1) -> Workload:
    """One iteration of `cfg` as the cost model's workload. `batch_ranks`: the data-parallel ranks (data x fsdp)
    of the actor's training layout, which split each micro-batch of `actor.micro_batch_size` rows (a whole group's);
    1 when the layout is still to be chosen (the search then assumes whole micro-batches per rank: an upper bound)."""
    sequences = cfg.data.train_batch_size * cfg.rollout.n
    return Workload(
        global_batch_prompts=cfg.data.train_batch_size,
        n_samples=cfg.rollout.n,
        prompt_len=cfg.data.max_prompt_length,
        response_len=cfg.rollout.response_length,
        ppo_epochs=cfg.actor.ppo_epochs,
        mini_batches=max(1, sequences // cfg.actor.ppo_mini_batch_size),
        micro_batch_seqs=max(1, -(-cfg.actor.micro_batch_size // batch_ranks)),
        kv_slots=cfg.rollout.slots,
    )


def run_cost_options(cfg: RLConfig) -> CostOptions:
    """The cost model's precision and rematerialisation for `cfg`: the actor's compute and master-weight dtypes and its
    `remat` setting."""
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}
    return CostOptions(
        param_bytes=itemsize[cfg.actor.dtype],
        master_bytes=itemsize[cfg.actor.param_dtype],
        remat=cfg.actor.remat != "none",
    )


def run_models(cfg: RLConfig) -> dict[str, str]:
    """The checkpoint of every role of `cfg`'s iteration that has a model."""
    models = {"actor": cfg.actor.model_path}
    if cfg.uses_ref:
        models["ref"] = cfg.actor.model_path
    if cfg.uses_critic:
        models["critic"] = cfg.critic.model_path
    if cfg.algorithm.name == "safe_rlhf":
        models["cost_critic"] = cfg.critic.model_path
    for role, section in (("reward", cfg.reward.reward_model), ("cost", cfg.reward.cost_model)):
        if section.enabled:
            models[role] = section.model_path
    return models


def predict_run(cfg: RLConfig, cluster: ClusterSpec, models: Mapping[str, Any] | None = None) -> Prediction:
    """The cost model's prediction (seconds, and memory per device: master copies, optimizer state, gradients,
    generation copy, KV cache, activations) for `cfg`'s own placement and layouts on `cluster`. `models`: each
    role's model (a `ModelConfig`, a preset name or a checkpoint path; default: the config's checkpoints).
    Raises `InfeasibleError` naming what does not fit."""
    if cfg.disaggregated and cfg.async_.max_staleness:
        raise ValueError(
            f"async.max_staleness={cfg.async_.max_staleness}: the cost model prices a disaggregated run as the "
            "synchronous loop (generation, then inference and training), not one that overlaps them"
        )
    flow = run_dataflow(cfg)
    shapes = role_shapes(flow, dict(models) if models is not None else run_models(cfg))
    mapping = config_mapping(to_dict(cfg), tuple(r for r in flow.roles if r in shapes))
    actor = mapping.layouts["actor"]
    model = CostModel(cluster, flow, run_workload(cfg, actor.data * actor.fsdp), run_cost_options(cfg))
    return model.predict(shapes, mapping)


def automap_run(cluster_path: str, config_path: str, out: str | None, top: int = 10) -> int:
    """Prints the `top` mappings of the run at `config_path` on the cluster at `cluster_path`; writes the best
    as a run config to `out`. Returns 0, or 1 when no mapping fits."""
    if out and Path(out).resolve() == Path(config_path).resolve():
        raise ValueError(f"--out {out}: would overwrite the run config it is computed from; choose another path")
    raw: dict[str, Any] = yaml.safe_load(Path(config_path).read_text()) or {}
    cfg = load_rl_config(without_mapping(raw))  # its layouts and devices may be another cluster's
    cluster = ClusterSpec.from_yaml(cluster_path)
    flow = run_dataflow(cfg)
    model = CostModel(cluster, flow, run_workload(cfg), run_cost_options(cfg))
    candidates = trainer_candidates(model, role_shapes(flow, run_models(cfg)))
    title = f"{cfg.algorithm.name} on {cluster.hosts}x{cluster.devices_per_host} devices (placements hfjax train runs)"
    print_candidates(candidates, title, top)
    if not candidates:
        print("no mapping fits: see the memory reasons above, or give the cluster more devices or memory")
        return 1
    if out:
        best = candidates[0]
        header = (
            f"# hfjax automap of {config_path} on {cluster_path}: predicted {best.iteration_seconds:.3f} s per "
            "iteration (" + ", ".join(f"{s} {v:.3f} s" for s, v in best.prediction.stage_seconds.items()) + ")\n"
        )
        mapped = run_config(best, raw, cluster)
        load_rl_config(mapped)  # what `hfjax train` checks first, before anything is written
        text = header + yaml.safe_dump(mapped, sort_keys=False)
        target = Path(out)
        with tempfile.NamedTemporaryFile("w", dir=target.parent or ".", delete=False, suffix=".yaml") as f:
            f.write(text)
        os.replace(f.name, target)  # never a half-written config
        print(f"wrote the best mapping as a run config to {out} (run it with: hfjax train {out})")
    return 0
