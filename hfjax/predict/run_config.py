"""The cost model's predictions for an RL run config (the one `hfjax train` reads): its dataflow, workload, cost
options and models as the cost model takes them, and `predict_run`, the prediction for the config's own placement
and layouts (what the preflight's memory check, `hfjax train --dry-run` and `hfjax compile` set beside the
compiler). The search over a config's mappings is `hfjax.automap.run_search`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hfjax.config.rl import RLConfig
from hfjax.models.attention import configured_implementation
from hfjax.predict.cluster import ClusterSpec
from hfjax.predict.cost import CostModel, Prediction
from hfjax.predict.dataflow import Dataflow, Workload, dataflow, role_shapes
from hfjax.predict.memory_terms import CostOptions
from hfjax.predict.run_mapping import config_mapping
from hfjax.predict.sizes import MLP_TENSORS_KEPT
from hfjax.typed_config import to_dict


def run_dataflow(cfg: RLConfig) -> Dataflow:
    """The algorithm's roles per stage as `cfg` runs them: without the actor's old-log-prob pass where its update
    computes those itself (`RLConfig.reuses_update_log_probs`: GRPO's default with one optimizer step)."""
    flow = dataflow(cfg.algorithm.name)
    if cfg.reuses_update_log_probs:
        flow = dataclasses.replace(flow, inference=tuple(r for r in flow.inference if r != "actor"))
    return flow


def run_workload(cfg: RLConfig, batch_ranks: int = 1) -> Workload:
    """One iteration of `cfg` as the cost model's workload. `batch_ranks`: the data-parallel ranks (data x fsdp x
    expert) of the actor's training layout, which split each micro-batch of `actor.micro_batch_size` rows (a whole
    group's); 1 when the layout is still to be chosen (the search then assumes whole micro-batches per rank: an upper
    bound)."""
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
    """The cost model's precision and rematerialisation for `cfg`: the actor's compute and master-weight dtypes, its
    `remat` setting, its LoRA adapters (and the critic's) and where its base lives, a frozen vision tower, its
    experts' capacity factor, whether its optimizer state leaves the device while it generates, how attention under
    a sequence axis runs (`split_attention_path`) and what its platform's compiler keeps of the MLP
    (`MLP_TENSORS_KEPT`)."""
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}
    lora = cfg.actor.lora.enabled  # the base is stored in the compute dtype
    return CostOptions(
        param_bytes=itemsize[cfg.actor.dtype],
        master_bytes=itemsize[cfg.actor.dtype if lora else cfg.actor.param_dtype],
        remat=cfg.actor.remat != "none",
        actor_lora=cfg.actor.lora if lora else None,
        lora_base_in_gen=cfg.keeps_lora_base_in_gen,
        critic_lora=cfg.critic.lora if cfg.uses_critic and cfg.critic.lora.enabled else None,
        freeze_vision_tower=cfg.actor.freeze_vision_tower,
        expert_capacity_factor=cfg.actor.expert_capacity_factor,
        router_replay=cfg.actor.router_replay,
        offload_optimizer=cfg.rollout.offload_optimizer,
        split_attention=split_attention_path(cfg.trainer.device, configured_implementation()),
        mlp_tensors=MLP_TENSORS_KEPT.get(cfg.trainer.device, MLP_TENSORS_KEPT["cpu"]),
    )


def split_attention_path(device: str, implementation: str) -> str:
    """How attention runs under a sequence axis on `device` (`trainer.device`) with `implementation`
    (`HFJAX_ATTENTION`): the splash kernels per position shard on a TPU, cuDNN per position shard on a GPU, else xla
    (`CostOptions.split_attention`). `trainer.device: auto` is priced as CPU (xla, and CPU's `MLP_TENSORS_KEPT`):
    the conservative case, as the cluster is not known before start."""
    if device == "tpu" and implementation in ("auto", "pallas_tpu"):
        return "splash"
    if device == "gpu" and implementation in ("auto", "cudnn"):
        return "cudnn"
    return "xla"


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
    model = CostModel(cluster, flow, run_workload(cfg, actor.batch_parts), run_cost_options(cfg))
    return model.predict(shapes, mapping)
