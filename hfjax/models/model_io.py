"""Loading, saving and building (abstractly) the models hfjax trains, text or vision-language alike: which loader,
saver and trained parameters a checkpoint takes is read from its `config.json` (`is_vision_language_checkpoint`)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from flax import nnx

from hfjax.models.config import ModelConfig
from hfjax.models.hf import abstract_model, load_hf, save_hf
from hfjax.models.vision_lm import (
    VisionLanguageConfig,
    VisionLanguageLM,
    check_policy_head,
    is_vision_language_checkpoint,
    load_vision_lm,
    save_vision_lm,
    set_model_images_per_step,
)
from hfjax.parallel.layout import Layout

ALL_BUT_THE_TOWER = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("vision_tower")))  # a frozen tower's trained params


def load_model(
    path: str, *, dtype: str, param_dtype: str | None, layout: Layout | None, head: str | None
) -> nnx.Module:
    """`load_hf` of the checkpoint `path`, or `load_vision_lm` of a vision-language one, which serves as a policy (or
    its reference) only; raises naming what cannot be, before loading anything. LoRA adapters (`add_lora`) attach to
    either alike: on a vision-language model, to its language model's projections only."""
    if not is_vision_language_checkpoint(path):
        return load_hf(path, dtype=dtype, param_dtype=param_dtype, layout=layout, head=head)
    check_policy_head(path, head)
    return load_vision_lm(path, dtype=dtype, param_dtype=param_dtype, layout=layout)


def save_model(model: nnx.Module, path: str | os.PathLike, **options: Any) -> Path:
    """`save_vision_lm` of a `VisionLanguageLM`, else `save_hf` (same `options`): what transformers reads back as the
    checkpoint the model was loaded from. A vision-language model's processor goes as `tokenizer`."""
    if isinstance(model, VisionLanguageLM):
        return save_vision_lm(model, path, **options)
    return save_hf(model, path, **options)


def trained_parameters(path: str | os.PathLike, freeze_vision_tower: bool) -> nnx.filterlib.Filter:
    """The parameters a model loaded from checkpoint `path` trains: all (`nnx.Param`), or with `freeze_vision_tower`
    all but a vision-language model's vision tower (the projector into the language model still trains, as the
    language model does); raises ValueError naming the setting when `path` holds a text model."""
    if not freeze_vision_tower:
        return nnx.Param
    if not is_vision_language_checkpoint(path):
        raise ValueError(f"freeze_vision_tower: {path} is a text model without a vision tower; expected false")
    return ALL_BUT_THE_TOWER


def abstract_policy(
    config: ModelConfig,
    head: str,
    dtype: str,
    param_dtype: str | None,
    vision: VisionLanguageConfig | None,
    images_per_step: int = 0,
) -> nnx.Module:
    """`abstract_model`, or with `vision` the abstract `VisionLanguageLM` whose language model is `config`'s (encoding
    `images_per_step` images at once)."""
    if vision is None:
        return abstract_model(config, head, dtype, param_dtype)
    cfg = dataclasses.replace(vision, text=config)
    model = VisionLanguageLM(cfg, dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(param_dtype or dtype), rngs=None)
    return set_model_images_per_step(model, images_per_step)
