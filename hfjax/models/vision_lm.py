"""Gemma 3's vision-language model (`Gemma3ForConditionalGeneration`): images read as soft tokens by the language
model.

The prompt holds `tokens_per_image` placeholder tokens (`image_token_id`) per image. `ImageEncoder` turns each
image into that many soft tokens, which replace the placeholders' embeddings in order of appearance within each row
(images come per row, [rows, images per row, ...]; Gemma's embedding scale applies to text tokens only, as in
transformers). The language model then
runs as `CausalLM` does, except that the tokens of one image see each other both ways (`attention_mask(...,
blocks)`: a run of consecutive placeholders is one block; on sliding-window layers the window still applies), so
its attention runs as xla. Rows without images, or a batch without any, are plain text.

`load_vision_lm` reads the checkpoint (`language_model.model.*`, the Hub's `vision_tower.vision_model.*` or
transformers 5's `vision_tower.*`, `multi_modal_projector.*`) and `save_vision_lm` writes what transformers reads.
Logical axes are the decoder's and the vision tower's, so one layout shards the whole model.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hfjax.models.config import ModelConfig, config_from_hf
from hfjax.models.hf import (
    ParamMapping,
    check_tensors,
    checked_dtype,
    checkpoint_index,
    load_planned,
    param_plan,
    read_config,
    save_planned,
)
from hfjax.models.safetensors_io import CheckpointError
from hfjax.models.transformer import CausalLM
from hfjax.models.vision import ImageEncoder, VisionConfig, set_images_per_step, tower_prefix, vision_plan
from hfjax.parallel.layout import Layout

ARCHITECTURE = "Gemma3ForConditionalGeneration"
TEXT_BLOCK = -1  # the block id of a text position (`image_blocks`)


@dataclasses.dataclass(frozen=True)
class VisionLanguageConfig:
    """The language model's config, the vision side's and the placeholder token of an image's soft tokens."""

    text: ModelConfig
    vision: VisionConfig
    image_token_id: int
    hf_config: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)  # config.json as read

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], source: str = "config.json") -> VisionLanguageConfig:
        """From a `Gemma3ForConditionalGeneration` `config.json` (its `text_config` read as `Gemma3ForCausalLM`)."""
        archs = raw.get("architectures") or []
        if archs != [ARCHITECTURE]:
            raise ValueError(f"{source}: architectures {archs!r}; expected [{ARCHITECTURE!r}]")
        text = {**raw["text_config"], "architectures": ["Gemma3ForCausalLM"]}
        text["tie_word_embeddings"] = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
        token = raw.get("image_token_index", raw.get("image_token_id"))
        if token is None:
            raise ValueError(f"{source}: no image_token_index; expected the id of the image placeholder token")
        cfg, _ = config_from_hf(text, f"{source} text_config")
        return cls(cfg, VisionConfig.from_hf(raw), int(token), dict(raw))


def image_placeholders(input_ids: jax.Array, image_token_id: int, prompt_columns: int | None = None) -> jax.Array:
    """[rows, length] bool: the positions that read an image's soft token, `image_token_id`'s; with `prompt_columns`,
    within the first that many columns only (a response token that happens to be the placeholder id is text: the
    rollout sampled and decoded it as such)."""
    is_image = input_ids == image_token_id
    if prompt_columns is not None:
        is_image &= jnp.arange(input_ids.shape[1]) < prompt_columns
    return is_image


def image_blocks(is_image: jax.Array) -> jax.Array:
    """[rows, length] int32: the block of each position of `is_image` (`image_placeholders`), a run of consecutive
    image placeholders being one block (0, 1, .. within a row), `TEXT_BLOCK` elsewhere (transformers'
    `get_block_sequence_ids_for_mask`)."""
    starts = is_image & ~jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
    return jnp.where(is_image, jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1, TEXT_BLOCK)


def merge_soft_tokens(embeddings: jax.Array, is_image: jax.Array, soft_tokens: jax.Array) -> jax.Array:
    """`embeddings` [rows, length, embed] with each row's placeholders (`is_image`) replaced, in order, by its images'
    soft tokens `soft_tokens` [rows, images per row x tokens, embed] (a row's padding images after its own, never
    read): row by row, so rows split over devices merge where they live (transformers' `masked_scatter` over the
    flattened batch gives the same where each row's images are its own)."""
    order = jnp.clip(jnp.cumsum(is_image, axis=1, dtype=jnp.int32) - 1, 0, soft_tokens.shape[1] - 1)
    picked = jnp.take_along_axis(soft_tokens, order[..., None], axis=1).astype(embeddings.dtype)
    return jnp.where(is_image[..., None], picked, embeddings)


class VisionLanguageLM(nnx.Module):
    """`ImageEncoder` + `CausalLM` (Gemma 3). Call -> logits [rows, length, vocab_size] float32 (HF's shape). Its
    `config`, dtypes, `logits` and `token_logprobs` are the language model's, so code written for a `CausalLM`'s
    head and config reads it alike; `vision_language` is the whole config."""

    head_kind = "causal_lm"

    def __init__(
        self,
        cfg: VisionLanguageConfig,
        *,
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
        rngs: nnx.Rngs | None,
        init_std: float = 0.02,
    ):
        self.language_model = CausalLM(cfg.text, dtype=dtype, param_dtype=param_dtype, rngs=rngs, init_std=init_std)
        self.vision = ImageEncoder(cfg.vision, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.image_token_id = cfg.image_token_id
        self.vision_language = cfg
        self.config = cfg.text
        self.dtype, self.param_dtype = self.language_model.dtype, self.language_model.param_dtype

    def hidden(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        images: jax.Array | None = None,
        prompt_columns: int | None = None,
    ) -> jax.Array:
        """Hidden states [rows, length, embed] of `input_ids` with `images` [rows, images per row, channels, height,
        width] (pixel values as the checkpoint's processor makes them; a row with fewer images pads with any, never
        read) read in place of each row's placeholders, in order (with `prompt_columns`, those of the prompt
        columns only: `image_placeholders`); None: text only."""
        decoder = self.language_model.model
        if images is None or images.shape[1] == 0:
            return decoder(input_ids, attention_mask, positions)
        embeddings, blocks = self.embed_with_images(input_ids, images, prompt_columns)
        return decoder(input_ids, attention_mask, positions, embeddings=embeddings, blocks=blocks)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """`CausalLM.logits` of the language model."""
        return self.language_model.logits(hidden)

    def token_logprobs(
        self, hidden: jax.Array, labels: jax.Array, **options: Any
    ) -> tuple[jax.Array, jax.Array | None]:
        """`CausalLM.token_logprobs` of the language model."""
        return self.language_model.token_logprobs(hidden, labels, **options)

    def embed_with_images(
        self, input_ids: jax.Array, images: jax.Array, prompt_columns: int | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """(input embeddings [rows, length, embed] with the soft tokens of the rows' `images` (as `hidden` takes
        them) in place of the placeholders (`image_placeholders`), the image blocks [rows, length] (`image_blocks`))."""
        embeddings = self.language_model.model.embed(input_ids)
        rows, per_row = images.shape[:2]
        soft = self.vision(images.reshape(rows * per_row, *images.shape[2:]))
        soft = soft.reshape(rows, per_row * soft.shape[1], soft.shape[2])
        is_image = image_placeholders(input_ids, self.image_token_id, prompt_columns)
        return merge_soft_tokens(embeddings, is_image, soft), image_blocks(is_image)

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        images: jax.Array | None = None,
    ) -> jax.Array:
        lm = self.language_model
        return lm.logits(self.hidden(input_ids, attention_mask, positions, images))[..., : lm.config.vocab_size]


def set_model_images_per_step(model: nnx.Module, images: int) -> nnx.Module:
    """`set_images_per_step` of a `VisionLanguageLM`'s encoder; raises ValueError naming the setting on a text model
    (unless `images` is 0). Returns `model`."""
    if isinstance(model, VisionLanguageLM):
        set_images_per_step(model.vision, images)
    elif images:
        raise ValueError(f"images_per_step: {images} on a text model without a vision tower; expected 0")
    return model


def language_model(model: CausalLM | VisionLanguageLM) -> CausalLM:
    """The causal LM in `model`: `model` itself, or a vision-language model's language model (what generation
    decodes with, and what remat and the head settings apply to)."""
    return model.language_model if isinstance(model, VisionLanguageLM) else model


def is_vision_language_checkpoint(path: str | os.PathLike) -> bool:
    """Whether the checkpoint directory `path` holds a vision-language model (`load_vision_lm` reads it)."""
    file = Path(path) / "config.json"
    return file.is_file() and (json.loads(file.read_text()).get("architectures") or []) == [ARCHITECTURE]


@dataclasses.dataclass(frozen=True)
class CheckpointNames:
    """Where a checkpoint keeps the language model's decoder and head (the prefixes replacing `param_plan`'s
    `model.` and `lm_head.`) and the vision tower (`vision_plan`)."""

    decoder: str
    head: str
    tower: str


# as transformers 5 saves (and `save_vision_lm` writes) a Gemma 3 multimodal checkpoint, and as the Hub holds them
SAVED_NAMES = CheckpointNames("language_model.model.", "language_model.lm_head.", "vision_tower.")


def checkpoint_names(names: Collection[str]) -> CheckpointNames:
    """The `CheckpointNames` of a checkpoint's tensor `names` (an untied head as `language_model.lm_head.` or
    `lm_head.`; the tower as `tower_prefix` finds it)."""
    head = SAVED_NAMES.head if f"{SAVED_NAMES.head}weight" in names else "lm_head."
    return CheckpointNames(SAVED_NAMES.decoder, head, tower_prefix(names))


def vision_lm_plan(cfg: VisionLanguageConfig, names: CheckpointNames = SAVED_NAMES) -> list[ParamMapping]:
    """The HF name and conversion of every parameter of a `VisionLanguageLM` under the checkpoint's `names`."""
    text = [
        dataclasses.replace(
            m,
            hf_name=m.hf_name.replace("model.", names.decoder, 1) if m.path[0] == "model" else f"{names.head}weight",
            path=("language_model", *m.path),
        )
        for m in param_plan(cfg.text, "causal_lm")
    ]
    vision = [dataclasses.replace(m, path=("vision", *m.path)) for m in vision_plan(cfg.vision, names.tower)]
    return text + vision


def vision_lm_config(path: str | os.PathLike) -> VisionLanguageConfig:
    """The `VisionLanguageConfig` of the checkpoint directory `path` (no weights read)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path}: no config.json; expected a Hugging Face model directory")
    return VisionLanguageConfig.from_hf(json.loads(file.read_text()), str(file))


def check_policy_head(path: str | os.PathLike, head: str | None) -> None:
    """Raises ValueError unless `head` is the causal LM's: a vision-language checkpoint serves as a policy only."""
    if head != "causal_lm":
        raise ValueError(f"{path}: a vision-language checkpoint; expected it as the policy, not as a {head} model")


def load_processor(path: str | os.PathLike) -> Any:
    """The checkpoint's processor (images and text) through `transformers.AutoProcessor` (local files only)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot load a processor for its images ({e})") from e


def language_model_config(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` of the checkpoint directory `path` (`read_config`), or of a vision-language checkpoint's
    language model (what sizes its memory and layouts beside the vision tower)."""
    return vision_lm_config(path).text if is_vision_language_checkpoint(path) else read_config(path)[0]


def _checked(path: str | os.PathLike, dtype: Any, param_dtype: Any) -> tuple[VisionLanguageLM, list[ParamMapping], Any]:
    """(the abstract model, its plan, the checkpoint's tensor index) of `path`, its tensors checked against the
    model's (names, shapes) without reading any."""
    cfg = vision_lm_config(path)
    compute = checked_dtype(dtype, "load_vision_lm(dtype)")
    storage = checked_dtype(param_dtype or dtype, "load_vision_lm(param_dtype)")
    model = VisionLanguageLM(cfg, dtype=compute, param_dtype=storage, rngs=None)  # abstract: no memory
    index = checkpoint_index(path)
    plan = vision_lm_plan(cfg, checkpoint_names(index))
    shapes = {p: v.shape for p, v in nnx.to_flat_state(nnx.state(model))}
    tied_heads = {f"{SAVED_NAMES.head}weight", "lm_head.weight"} if cfg.text.tie_word_embeddings else set()
    check_tensors(plan, shapes, index, set(), tied_heads, str(path))
    return model, plan, index


def check_vision_lm_checkpoint(path: str | os.PathLike) -> None:
    """Raises `CheckpointError` naming missing, unexpected or mis-shaped tensors of the checkpoint `path` (its
    safetensors headers against the model its config builds; no tensor read)."""
    _checked(path, "float32", None)


def load_vision_lm(
    path: str | os.PathLike,
    *,
    dtype: Any = "float32",
    param_dtype: Any = None,
    layout: Layout | Mapping[str, Any] | None = None,
) -> VisionLanguageLM:
    """Loads a `Gemma3ForConditionalGeneration` checkpoint directory; parameters go straight to their shardings
    under `layout` (else the first device), stored in `param_dtype` (default: `dtype`). Raises `CheckpointError`
    naming missing, unexpected or mis-shaped tensors before reading any."""
    model, plan, index = _checked(path, dtype, param_dtype)
    return load_planned(model, plan, index, path, layout)


def save_vision_lm(
    model: VisionLanguageLM,
    path: str | os.PathLike,
    *,
    dtype: Any = None,
    tokenizer: Any = None,
    overwrite: bool = False,
) -> Path:
    """Writes the model as transformers 5 saves a `Gemma3ForConditionalGeneration` (`SAVED_NAMES`, the checkpoint's
    own `config.json` with `dtype`), which transformers and `load_vision_lm` read back; as `save_hf` otherwise."""
    out_dtype = checked_dtype(dtype or model.language_model.param_dtype, "save_vision_lm(dtype)")
    cfg = model.vision_language
    config = {**cfg.hf_config, "dtype": str(jnp.dtype(out_dtype))}
    return save_planned(model, vision_lm_plan(cfg), config, path, out_dtype, tokenizer, overwrite=overwrite)
