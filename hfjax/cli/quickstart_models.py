"""The quickstarts' random base models, saved as Hugging Face checkpoints with their tokenizer or processor: a Llama
for the text tasks and a Gemma 3 vision-language model (SigLIP tower, projector, Gemma 3 language model) for the
image task. Built with hfjax's own modules (no PyTorch)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class VisionTowerSection:
    """Shape of the vision tower of the image task's random Gemma 3 (its image size is the task's)."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    patch_size: int = 8
    tokens_per_image: int = 4  # soft tokens per image after pooling


@dataclasses.dataclass
class BaseModelSection:
    """Shape of the random model the pipeline starts from (a Llama; the image task's Gemma 3 language model)."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    seed: int = 0
    vision: VisionTowerSection = dataclasses.field(default_factory=VisionTowerSection)  # the image task only


def build_base_model(out_dir: Path, spec: BaseModelSection, tokenizer: Any) -> Path:
    """A random Llama of `spec` with the tokenizer's special ids, saved as a Hugging Face checkpoint."""
    from flax import nnx

    from hfjax.models import CausalLM, config_from_hf, save_hf

    raw = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(tokenizer),
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        **_special_ids(tokenizer),
    }
    cfg, _ = config_from_hf(raw, "quickstart base model")
    model = CausalLM(cfg, rngs=nnx.Rngs(spec.seed))
    return save_hf(model, out_dir, tokenizer=tokenizer, overwrite=True)


def build_vision_base_model(out_dir: Path, spec: BaseModelSection, processor: Any) -> Path:
    """A random `Gemma3ForConditionalGeneration` of `spec` on `processor`'s vocabulary, image tokens and image size
    (its language model alternating sliding and full attention layers), saved with the processor."""
    from flax import nnx
    from transformers import Gemma3Config

    from hfjax.models.vision_lm import ARCHITECTURE, VisionLanguageConfig, VisionLanguageLM, save_vision_lm

    tokenizer, tower = processor.tokenizer, spec.vision
    head_dim = spec.hidden_size // spec.num_heads
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "max_position_embeddings": 128,
        "sliding_window": 16,
        "layer_types": [("sliding_attention", "full_attention")[i % 2] for i in range(spec.num_layers)],
        **_special_ids(tokenizer),
    }
    vision = {
        "hidden_size": tower.hidden_size,
        "intermediate_size": tower.intermediate_size,
        "num_hidden_layers": tower.num_layers,
        "num_attention_heads": tower.num_heads,
        "image_size": processor.image_processor.size["height"],
        "patch_size": tower.patch_size,
        "vision_use_head": False,
    }
    ids = tokenizer.convert_tokens_to_ids
    raw = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=tower.tokens_per_image,
        image_token_index=ids(tokenizer.image_token),
        boi_token_index=ids(tokenizer.boi_token),
        eoi_token_index=ids(tokenizer.eoi_token),
    ).to_dict()
    raw["architectures"] = [ARCHITECTURE]
    model = VisionLanguageLM(VisionLanguageConfig.from_hf(raw, "quickstart base model"), rngs=nnx.Rngs(spec.seed))
    return save_vision_lm(model, out_dir, tokenizer=processor, overwrite=True)


def _special_ids(tokenizer: Any) -> dict[str, int]:
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
