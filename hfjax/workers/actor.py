"""`ActorRolloutRefWorker`: the policy in its roles — `actor` (PPO updates), `rollout` (generation through the
HybridEngine and the `OfflineGenerator`), `ref` (frozen reference log probs) — or any `actor_rollout[_ref]` mix
sharing one process and its devices.

Generation: `HybridEngine.to_gen` moves the training parameters to the generation layout in the compute `dtype`
(zero-redundancy: the training buffers are released; with float32 master weights and a lower compute dtype the
master stays and the cast copy moves), the generator runs with a KV cache that lives only while it runs, and
`to_train` brings the training parameters back (cut out locally, or the master kept). A LoRA policy's frozen base
stays in the generation layout for the whole run (`rollout.lora_base_layout: gen`; the updates and log-prob passes
read it there), so the transitions move its adapters alone.
Log probs follow the engine's convention: log-softmax of logits / rollout temperature at the response tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from hfjax.algos import (
    actor_options,
    agg_loss,
    kl_penalty,
    mismatch_metrics,
    policy_loss,
)
from hfjax.config.roles import ActorConfig, RolloutConfig
from hfjax.controller import Dispatch, register
from hfjax.models.lora import LoraParam, adapter_dropout, adapters_off, merge_lora
from hfjax.models.model_io import save_model
from hfjax.models.moe import collect_router_stats
from hfjax.models.program import bind
from hfjax.models.vision_lm import VisionLanguageLM
from hfjax.optim.optimizer import make_optimizer
from hfjax.optim.train_state import TrainState, frozen_flags
from hfjax.parallel import HybridEngine, layout_or_default
from hfjax.parallel.host_local import local_view, process_layout, stationary_layout
from hfjax.protocol import ROW_IN_LOSS, DataProto
from hfjax.rollout import JaxEngine, OfflineGenerator
from hfjax.workers.generation import agent_generator, generate_batch, sampling_params
from hfjax.workers.model_role import (
    LORA_DROPOUT_SEED,
    LoadedModel,
    TrainedRole,
    load_trained,
    padding_masked,
    reports_usage,
    weighted_router_metrics,
)
from hfjax.workers.packing import response_positions, to_response_rows
from hfjax.workers.sequences import IMAGES, ROUTED_EXPERTS
from hfjax.workers.weight_sync import WeightShards, export_shards

ROLES = ("actor", "rollout", "ref", "actor_ref", "actor_rollout", "actor_rollout_ref")


def response_logprobs(
    model: Any, batch: dict[str, jax.Array], temperature: float, with_entropy: bool
) -> tuple[jax.Array, jax.Array | None]:
    """(log probs, entropies or None) [rows, response] of the response tokens under logits / temperature: the
    vocabulary projection runs on the response positions only, a chunk of tokens at a time (never the whole
    [rows, response, vocab] logits: `CausalLM.token_logprobs`); of a packed micro-batch, on its response tokens only
    (`hfjax.workers.packing`), with one row per sequence out. A batch with `ROUTED_EXPERTS` replays them; one with
    `IMAGES` reads them (a vision-language policy)."""
    if IMAGES in batch:  # a vision-language policy: the rows' images in place of their prompts' placeholders
        ids = batch["input_ids"]
        prompt_columns = ids.shape[1] - batch["responses"].shape[1]
        hidden = model.hidden(ids, batch["attention_mask"], batch["position_ids"], batch[IMAGES], prompt_columns)
    else:
        hidden = model.model(
            batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch.get(ROUTED_EXPERTS)
        )
    response, labels = response_positions(hidden, batch)
    logp, entropies = model.token_logprobs(response, labels, temperature=temperature, with_entropy=with_entropy)
    return to_response_rows(logp, batch), None if entropies is None else to_response_rows(entropies, batch)


def actor_loss(
    cfg: ActorConfig, temperature: float, response_length: int, model: Any, batch: dict[str, jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The PPO-family policy loss of one micro-batch (normalised by the mini-batch counts in the batch, and in
    seq-mean-token-sum-norm by the untrimmed `response_length`, whatever width the micro-batch is trimmed to), with
    the rollout-correction weights and the KL loss as configured, and its metrics (this micro-batch's shares of the
    mini-batch's values, which sum over micro-batches, or its extremes `..._max` / `..._min`). A module function
    bound to its settings (`hfjax.models.program.bind`), not a worker method: the compile cache keeps its static
    arguments alive (a bound method would keep the whole worker, parameters and optimizer state, alive after the
    run), and the next run in the process with equal settings reuses its trace."""
    mask = batch["response_mask"]
    counts = {
        "global_tokens": batch["global_tokens"][0],
        "global_seqs": batch["global_seqs"][0],
        "norm_length": response_length,
    }
    with collect_router_stats() as router, adapter_dropout(batch.get(LORA_DROPOUT_SEED)):
        logp, entropies = response_logprobs(model, batch, temperature, with_entropy=True)
    # Without old log probs they are the current policy's, i.e. this forward's until the update's single optimizer
    # step (`RLConfig.reuses_update_log_probs`), detached.
    old_log_probs = batch.get("old_log_probs", jax.lax.stop_gradient(logp))
    clip = {
        "clip_ratio_low": cfg.clip_ratio_low,
        "clip_ratio_high": cfg.clip_ratio_high,
        "clip_ratio_c": cfg.clip_ratio_c,
    }
    options = actor_options(cfg.policy_loss, **clip)  # the clip settings that the loss takes
    # off-policy correction (the controller's, before the advantages): weights; rejected tokens are out of the mask
    options["token_weights"] = batch.get("rollout_is_weights")
    correction = {}
    if "rollout_log_probs" in batch:  # the controller had no old log probs to measure the mismatch with
        correction = mismatch_metrics(
            old_log_probs, batch["rollout_log_probs"], mask, token_count=counts["global_tokens"]
        )
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = policy_loss(
        cfg.policy_loss,
        old_log_probs,
        logp,
        batch["advantages"],
        mask,
        loss_agg_mode=cfg.loss_agg_mode,
        **options,
        **counts,
    )
    if not cfg.entropy_coeff:  # a metric only: nothing flows back through it
        entropies = jax.lax.stop_gradient(entropies)
    entropy = agg_loss(entropies, mask, cfg.loss_agg_mode, **counts)
    loss = pg_loss - cfg.entropy_coeff * entropy if cfg.entropy_coeff else pg_loss
    metrics = {
        "actor/pg_loss": pg_loss,
        "actor/pg_clipfrac": clipfrac,
        "actor/ppo_kl": ppo_kl,
        "actor/pg_clipfrac_lower": clipfrac_lower,
        "actor/entropy": entropy,
        **correction,
    }
    if cfg.use_kl_loss:
        kl = agg_loss(kl_penalty(logp, batch["ref_log_prob"], cfg.kl_loss_type), mask, cfg.loss_agg_mode, **counts)
        loss = loss + cfg.kl_loss_coef * kl
        metrics["actor/kl_loss"] = kl
    if router:  # a mixture of experts: this micro-batch's figures, weighted by its share of the response tokens
        metrics.update(
            weighted_router_metrics(router, model.config.experts_per_token, mask, counts["global_tokens"], "actor")
        )
        if cfg.router_aux_loss_coef:
            loss = loss + cfg.router_aux_loss_coef * metrics["actor/router_aux_loss"]
    return loss, metrics


def logprob_rows(temperature: float, model: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The policy's log probs and entropies of a micro-batch's response tokens (`compute_log_prob`)."""
    logp, entropies = response_logprobs(model, batch, temperature, with_entropy=True)
    return {"log_probs": logp, "entropys": entropies}


def ref_logprob_rows(temperature: float, model: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The reference policy's log probs of a micro-batch's response tokens: the model without its LoRA adapters
    (a LoRA actor's base; a plain reference copy has none); no entropy (one reduction fewer over every chunk's
    logits)."""
    with adapters_off():
        return {"log_probs": response_logprobs(model, batch, temperature, with_entropy=False)[0]}


class ActorRolloutRefWorker(TrainedRole):
    """One policy checkpoint serving the roles named by `role` (one of `ROLES`)."""

    def __init__(
        self,
        actor: ActorConfig,
        rollout: RolloutConfig,
        role: str = "actor_rollout_ref",
        *,
        total_steps: int = 0,
        max_prompt_length: int = 512,
    ):
        if role not in ROLES:
            raise ValueError(f"role: expected one of {ROLES}, got {role!r}")
        self.cfg, self.rollout_cfg, self.role = actor, rollout, role
        self.total_steps = total_steps
        self.max_prompt_length = max_prompt_length
        self.has_actor, self.has_rollout, self.has_ref = "actor" in role, "rollout" in role, "ref" in role
        self.loss_fns: dict[int, Callable[..., Any]] = {}  # per response length; one object: one compile key

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Loads the policy (and the reference copy) under the training layout; builds optimizer and generator."""
        cfg, rollout = self.cfg, self.rollout_cfg
        layout = layout_or_default(cfg.train_layout, where="actor.train_layout")
        lora = cfg.lora.enabled
        gen = (
            layout_or_default(rollout.gen_layout, generation=True, where="rollout.gen_layout")
            if self.has_rollout
            else None
        )
        # a LoRA base that stays in the generation layout: loaded there, trained against there, never moved
        base_layout = (
            stationary_layout(layout, gen) if lora and gen is not None and rollout.lora_base_layout == "gen" else None
        )
        self.policy, trainable = load_trained(cfg, layout, "causal_lm", frozen_layout=base_layout)
        if cfg.router_replay and not any(self.policy.config.moe_layers):
            raise ValueError(f"actor.router_replay: {cfg.model_path} has no mixture-of-experts layers to replay")
        self.pad_id = self.policy.config.pad_token_id or 0
        self.state = None
        if self.has_actor:
            optimizer = make_optimizer(cfg.optim, self.total_steps * cfg.ppo_epochs or None)
            clip = cfg.optim.grad_clip
            self.state = TrainState(
                self.policy.model, layout, optimizer, clip, trainable=trainable, frozen_layout=base_layout
            )
        self.ref_params = None
        if self.has_ref and not lora:  # with LoRA the reference is the policy's own base (`ref_logprob_rows`)
            self.ref_params = LoadedModel(cfg.model_path, layout, dtype=cfg.dtype, head="causal_lm").params
        self._logprob = self.policy.rows_fn(bind(logprob_rows, rollout.temperature))
        self._ref_logprob = self.policy.rows_fn(bind(ref_logprob_rows, rollout.temperature))
        info: dict[str, Any] = {"train_layout": layout.describe(), "params": self.policy.config.num_params}
        if self.has_rollout:
            self.hybrid = HybridEngine(
                layout,
                gen,
                self.policy.params,
                mode=rollout.hybrid_engine,
                offload_optimizer=rollout.offload_optimizer and self.state is not None,
                keep_host_memory=rollout.keep_host_memory,
                # a LoRA base is already in the compute dtype; its float32 adapters are cast where they are used, so
                # nothing is cast and the engine keeps no training copy (zero redundancy)
                gen_dtype=None if lora else cfg.dtype,
                stationary=None if base_layout is None else frozen_flags(self.policy.params, trainable),
            )
            # one continuous-batching loop per process, over its own replicas of the generation layout
            self.local_gen_layout = process_layout(self.hybrid.gen_layout)
            self.engine = JaxEngine(
                self.policy.model,
                self.local_gen_layout,
                max_concurrent_decodes=rollout.slots,
                max_prefill_length=self.max_prompt_length,
                max_new_tokens=rollout.response_length,
                prompt_cache_tokens=rollout.prompt_cache_tokens,
                record_experts=cfg.router_replay,
            )
            self.generator = OfflineGenerator(self.engine, None, progress=False)
            self.agent = agent_generator(self.generator, rollout)
            self.hybrid.kv_cache_bytes_per_device = self.engine.kv_cache_bytes_per_device()
            info["gen_layout"] = self.hybrid.gen_layout.describe()
            info["gen_memory"] = {k: v for k, v in self.hybrid.stats().items() if k.endswith("bytes_per_device")}
        return info

    @property
    def params(self) -> Any:
        return self.state.params if self.state is not None else self.policy.params

    @params.setter
    def params(self, value: Any) -> None:
        if self.state is not None:
            self.state.params = value
        else:
            self.policy.params = value

    @register(Dispatch.DP_COMPUTE_PROTO)
    @reports_usage
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Prompts (left-padded `input_ids`, `attention_mask`) -> n responses each, interleaved: prompts, responses,
        input_ids, attention_mask, position_ids, response_mask, rollout_log_probs. `meta_info` may set `n`,
        `do_sample` (False = greedy), `seed`, `temperature`. In a group of several processes each process generates
        its own prompts in its own loop (no cross-host traffic per decode step; hosts finish when they finish)."""
        if not self.has_rollout:
            raise RuntimeError(f"generate_sequences: this worker's role {self.role!r} does not generate")
        sampling = sampling_params(self.rollout_cfg, prompts.meta_info)
        if self.hybrid.offload_optimizer:
            self.state.opt_state = self.hybrid.offload(self.state.opt_state)
        gen_params = self.hybrid.to_gen(self.params)
        try:
            self.generator.update_params(local_view(gen_params, self.local_gen_layout))
            batch, timing = generate_batch(self.generator, prompts, sampling, self.pad_id, agent=self.agent)
        finally:
            self.generator.update_params(None)
            self.params = self.hybrid.to_train(gen_params)
            if self.hybrid.offload_optimizer:
                self.state.opt_state = self.hybrid.reload(self.state.opt_state)
        transitions = self.hybrid.stats()
        timing["reshard_seconds"] = transitions["to_gen_s"][-1] + transitions["to_train_s"][-1]
        return DataProto.from_dict(batch, meta_info={"metrics": timing})

    def _log_probs(self, jitted: Any, params: Any, data: DataProto, replay: bool = False) -> dict[str, np.ndarray]:
        keys = ("input_ids", "attention_mask", "position_ids", "responses")
        keys += (ROUTED_EXPERTS,) if replay and self.cfg.router_replay else ()
        keys += self._image_keys(data)
        arrays = {k: data.batch[k] for k in keys}
        length = data.batch["responses"].shape[1]
        packed = self.cfg.packed_row_tokens
        trim = length if self.cfg.trim_padding or packed else None
        return self.policy.map_rows(jitted, params, arrays, self.cfg.micro_batch_size, trim, packed)

    def _image_keys(self, data: DataProto) -> tuple[str, ...]:
        """(`IMAGES`,) when the rows carry images, which a vision-language policy reads in every pass; else ().
        Raises naming the setting when the policy reads no images or the rows would be packed."""
        if IMAGES not in data.batch:
            return ()
        if not isinstance(self.policy.model, VisionLanguageLM):
            raise ValueError(f"actor.model_path: the rows carry images, but {self.cfg.model_path} reads text only")
        if self.cfg.packed_row_tokens:
            raise ValueError("actor.packed_row_tokens: rows with images are not packed; expected 0")
        return (IMAGES,)

    @register(Dispatch.DP_COMPUTE_PROTO)
    @reports_usage
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """`old_log_probs` and `entropys` [B, R] under the current policy."""
        out = self._log_probs(self._logprob, self.params, data, replay=True)
        return DataProto.from_dict({"old_log_probs": out["log_probs"], "entropys": out["entropys"]})

    @register(Dispatch.DP_COMPUTE_PROTO)
    @reports_usage
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """`ref_log_prob` [B, R] under the frozen reference policy."""
        if not self.has_ref:
            raise RuntimeError(f"compute_ref_log_prob: this worker's role {self.role!r} has no reference model")
        out = self._log_probs(self._ref_logprob, self.params if self.ref_params is None else self.ref_params, data)
        return DataProto.from_dict({"ref_log_prob": out["log_probs"]})

    @register(Dispatch.DP_COMPUTE_PROTO)
    @reports_usage
    def update_actor(self, data: DataProto) -> DataProto:
        """PPO epochs over mini-batches of `ppo_mini_batch_size` rows, each split into micro-batches whose losses
        are normalised by the mini-batch's counts (so accumulation equals the whole mini-batch). Metrics are means
        over optimizer steps, in `meta_info["metrics"]`."""
        cfg = self.cfg
        keys = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask", "advantages"]
        optional = ("old_log_probs", "ref_log_prob", "rollout_log_probs", "rollout_is_weights", ROW_IN_LOSS)
        keys += [k for k in optional if k in data.batch]
        keys += [ROUTED_EXPERTS] if cfg.router_replay else []
        keys += self._image_keys(data)
        arrays = padding_masked({k: np.asarray(data.batch[k]) for k in keys}, data)
        if "old_log_probs" not in arrays and (
            cfg.ppo_epochs > 1 or len(data) * jax.process_count() > cfg.ppo_mini_batch_size
        ):
            raise ValueError(
                "update_actor: no old_log_probs, but this update makes several optimizer steps "
                f"(ppo_epochs={cfg.ppo_epochs}, {len(data)} rows, ppo_mini_batch_size={cfg.ppo_mini_batch_size})"
            )
        arrays = self.with_dropout_seeds(arrays, cfg.lora)
        length = arrays["responses"].shape[1]
        loss_fn = self.loss_fns.setdefault(length, bind(actor_loss, cfg, self.rollout_cfg.temperature, length))
        return self.ppo_epochs(
            arrays,
            loss_fn,
            cfg.ppo_epochs,
            cfg.ppo_mini_batch_size,
            cfg.micro_batch_size,
            "actor",
            trim=cfg.trim_padding,
            row_tokens=cfg.packed_row_tokens,
        )

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def weights_for_rollout(self) -> WeightShards:
        """This process's blocks of the policy cast to the compute dtype, for a rollout group on other devices
        (`hfjax.trainer.rollout_stream.sync_weights`; non-blocking: the blocks stay in the cluster); of a LoRA
        policy, its float32 adapters only (the rollout holds the frozen base)."""
        if self.cfg.lora.enabled:
            return export_shards(nnx.split_state(self.params, LoraParam, ...)[0], "float32")
        return export_shards(self.params, self.cfg.dtype)

    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, out_dir: str, adapters: bool = False) -> None:
        """Writes the current policy as a Hugging Face checkpoint (LoRA adapters merged into their weights), or with
        `adapters` the LoRA adapters alone as a PEFT adapter directory for the base checkpoint. A vision-language
        policy is written whole (`save_model`), a frozen vision tower included."""
        from hfjax.models.peft_io import save_peft

        model = self.policy.merge(self.params)
        if adapters:
            save_peft(model, self.cfg.lora, out_dir, self.cfg.model_path)
        else:
            save_model(merge_lora(model), out_dir, overwrite=True)
