"""`CriticWorker`: the value model — per-token values of the responses and clipped value-loss updates.

A causal-LM checkpoint gets a fresh value head (`Critic`, saved as `*ForTokenClassification`). Values are read at
the positions that predict each response token (the same positions as the policy's log probs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from hfjax.algos import value_loss
from hfjax.config.roles import CriticConfig
from hfjax.controller import Dispatch, register
from hfjax.models.hf import HEAD_PARAMS
from hfjax.models.lora import adapter_dropout
from hfjax.models.moe import collect_router_stats
from hfjax.models.program import bind
from hfjax.optim.optimizer import make_optimizer
from hfjax.optim.train_state import TrainState
from hfjax.parallel import layout_or_default
from hfjax.protocol import DataProto
from hfjax.workers.model_role import (
    LORA_DROPOUT_SEED,
    TrainedRole,
    load_trained,
    padding_masked,
    reports_usage,
    weighted_router_metrics,
)
from hfjax.workers.packing import response_positions, to_response_rows

VALUE_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")


def response_values(model: Any, batch: dict[str, jax.Array]) -> jax.Array:
    """Values [rows, response] at the positions that predict the response tokens (of a packed micro-batch: one row
    per sequence, `hfjax.workers.packing`)."""
    values = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    return to_response_rows(response_positions(values, batch)[0], batch)


def value_rows(model: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The critic's values of a micro-batch's response positions (`compute_values`)."""
    return {"values": response_values(model, batch)}


def critic_loss(
    cfg: CriticConfig, response_length: int, model: Any, batch: dict[str, jax.Array]
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The clipped value loss of one micro-batch and its metrics, normalised as `actor_loss` is (mini-batch counts,
    untrimmed `response_length`; the metrics are shares that sum over micro-batches). A module function bound with
    `hfjax.models.program.bind`, for the reasons `actor_loss` gives."""
    with collect_router_stats() as router, adapter_dropout(batch.get(LORA_DROPOUT_SEED)):
        vpreds = response_values(model, batch)
    loss, clipfrac = value_loss(
        vpreds,
        batch["returns"],
        batch["values"],
        batch["response_mask"],
        cliprange_value=cfg.cliprange_value,
        loss_agg_mode=cfg.loss_agg_mode,
        global_tokens=batch["global_tokens"][0],
        global_seqs=batch["global_seqs"][0],
        norm_length=response_length,
    )
    metrics = {"critic/vf_loss": loss, "critic/vf_clipfrac": clipfrac}
    if router:  # a mixture of experts: its router's figures, as the actor reports them
        mask, tokens = batch["response_mask"], batch["global_tokens"][0]
        metrics.update(weighted_router_metrics(router, model.config.experts_per_token, mask, tokens, "critic"))
    return loss, metrics


class CriticWorker(TrainedRole):
    """A value model trained with PPO's clipped value loss."""

    def __init__(self, critic: CriticConfig, *, total_steps: int = 0):
        self.cfg = critic
        self.total_steps = total_steps
        self.loss_fns: dict[int, Callable[..., Any]] = {}  # per response length; one object: one compile key

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        cfg = self.cfg
        layout = layout_or_default(cfg.layout, where="critic.layout")
        # with LoRA: the adapters and the value head (new, or a reward model's) train
        self.critic, trainable = load_trained(cfg, layout, "token_cls", HEAD_PARAMS["token_cls"])
        optimizer = make_optimizer(cfg.optim, self.total_steps * cfg.ppo_epochs or None)
        self.state = TrainState(self.critic.model, layout, optimizer, cfg.optim.grad_clip, trainable=trainable)
        self._values = self.critic.rows_fn(value_rows)
        return {"layout": layout.describe(), "params": self.critic.config.num_params}

    @register(Dispatch.DP_COMPUTE_PROTO)
    @reports_usage
    def compute_values(self, data: DataProto) -> DataProto:
        """`values` [B, R]."""
        arrays = {k: data.batch[k] for k in VALUE_KEYS}
        packed = self.cfg.packed_row_tokens
        trim = arrays["responses"].shape[1] if self.cfg.trim_padding or packed else None
        out = self.critic.map_rows(self._values, self.state.params, arrays, self.cfg.micro_batch_size, trim, packed)
        return DataProto.from_dict({"values": out["values"]})

    @register(Dispatch.DP_COMPUTE_PROTO)
    @reports_usage
    def update_critic(self, data: DataProto) -> DataProto:
        """Clipped value-loss epochs over mini-batches (micro-batch accumulation normalised by mini-batch counts)."""
        cfg = self.cfg
        keys = (*VALUE_KEYS, "response_mask", "values", "returns")
        arrays = self.with_dropout_seeds(padding_masked({k: np.asarray(data.batch[k]) for k in keys}, data), cfg.lora)
        length = arrays["responses"].shape[1]
        loss_fn = self.loss_fns.setdefault(length, bind(critic_loss, cfg, length))
        return self.ppo_epochs(
            arrays,
            loss_fn,
            cfg.ppo_epochs,
            cfg.ppo_mini_batch_size,
            cfg.micro_batch_size,
            "critic",
            trim=cfg.trim_padding,
            row_tokens=cfg.packed_row_tokens,
        )
