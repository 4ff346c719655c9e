"""The abstract micro-batches of the compiled programs (`hfjax.automap.compiled.programs`): the largest a run of
the config feeds each trained role's programs, as `jax.ShapeDtypeStruct`s with their row shardings, columns as the
workers build them (padded sequences, packed rows, recorded expert routes, the adapter dropout seed column)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from hfjax.config.rl import RLConfig
from hfjax.models.config import ModelConfig
from hfjax.models.moe import route_dtype
from hfjax.models.vision_lm import VisionLanguageConfig
from hfjax.optim.train_state import batch_sharding
from hfjax.parallel.layout import Layout
from hfjax.rollout.interface import power_of_two_at_least
from hfjax.workers.model_role import LORA_DROPOUT_SEED
from hfjax.workers.packing import PACKED_LABELS, PACKED_POSITIONS, RESPONSE_INDEX
from hfjax.workers.sequences import IMAGES, ROUTED_EXPERTS, SEQUENCE_KEYS


def sequence_batch(layout: Layout, rows: int, prompt: int, response: int, extra: Sequence[str]) -> dict[str, Any]:
    """A micro-batch of the RL layout (`hfjax.workers.sequences`) as `ShapeDtypeStruct`s, rows over the batch axes;
    `extra` names the float [rows, response] columns the program reads (advantages, old log probs, ...)."""
    shapes = {
        "input_ids": ((rows, prompt + response), jnp.int32),
        "attention_mask": ((rows, prompt + response), jnp.int32),
        "position_ids": ((rows, prompt + response), jnp.int32),
        "responses": ((rows, response), jnp.int32),
        **{name: ((rows, response), jnp.float32) for name in extra},
    }
    if "response_mask" in extra:
        shapes["response_mask"] = ((rows, response), jnp.int32)
        shapes["global_tokens"] = ((rows,), jnp.float32)
        shapes["global_seqs"] = ((rows,), jnp.float32)
    return {k: jax.ShapeDtypeStruct(s, d, sharding=batch_sharding(layout, s)) for k, (s, d) in shapes.items()}


def packed_batch(layout: Layout, row_tokens: int, response: int, extra: Sequence[str]) -> dict[str, Any]:
    """The largest packed micro-batch of `row_tokens` tokens per row (`hfjax.workers.packing`) as
    `ShapeDtypeStruct`s: one row per batch part, every token a response token, and as many sequence rows as
    sequences of two tokens would fill (the per-sequence arrays hold no vocabulary dimension: small either way)."""
    parts = layout.batch_parts
    seqs = parts * power_of_two_at_least(row_tokens // 2)
    batch = sequence_batch(layout, seqs, 0, response, extra)
    del batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    shapes = {
        **dict.fromkeys(SEQUENCE_KEYS, (parts, row_tokens)),
        PACKED_POSITIONS: (parts, row_tokens),
        PACKED_LABELS: (parts, row_tokens),
        RESPONSE_INDEX: (seqs, response),
    }
    for key, shape in shapes.items():
        batch[key] = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding(layout, shape))
    return batch


def micro_batch(
    cfg: RLConfig,
    section: Any,
    layout: Layout,
    extra: Sequence[str],
    routes: ModelConfig | None = None,
    images: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """The largest micro-batch of a trained role's `section` (actor or critic config): packed when it sets
    `packed_row_tokens`, else `micro_batch_size` rows of the longest prompt and response; with the rollout's
    `ROUTED_EXPERTS` of the mixture-of-experts model `routes` beside `input_ids` where given (routing replay), and
    with a vision-language policy's `IMAGES` of a row's pixel-value shape `images` where given."""
    response = cfg.rollout.response_length
    if section.packed_row_tokens:
        batch = packed_batch(layout, section.packed_row_tokens, response, extra)
    else:
        batch = sequence_batch(layout, section.micro_batch_size, cfg.data.max_prompt_length, response, extra)
    if routes is not None:
        shape = (*batch["input_ids"].shape, sum(routes.moe_layers), routes.experts_per_token)
        dtype = route_dtype(routes.num_experts)
        batch[ROUTED_EXPERTS] = jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(layout, shape))
    if images is not None:
        shape = (batch["input_ids"].shape[0], *images)
        batch[IMAGES] = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=batch_sharding(layout, shape))
    return batch


def with_seed_column(batch: dict[str, Any], section: Any, layout: Layout) -> dict[str, Any]:
    """An update's abstract micro-batch with the adapter dropout seed column the worker adds
    (`TrainedRole.with_dropout_seeds`) where `section.lora` drops out adapter inputs."""
    if not section.lora.drops_out:
        return batch
    rows = (batch["responses"].shape[0],)
    return {**batch, LORA_DROPOUT_SEED: jax.ShapeDtypeStruct(rows, jnp.int32, sharding=batch_sharding(layout, rows))}


def image_shape(cfg: RLConfig, vision: VisionLanguageConfig) -> tuple[int, ...]:
    """A row's pixel values (images, channels, height, width) at the most images it can carry: `data.max_images`,
    or as many as `data.max_prompt_length` has room for (each takes its soft tokens) if fewer."""
    tower = vision.vision
    per_row = max(1, min(cfg.data.max_images, cfg.data.max_prompt_length // tower.tokens_per_image))
    return (per_row, tower.num_channels, tower.image_size, tower.image_size)
