"""Vision-language fixtures built locally: a Gemma 3 processor over a small BPE tokenizer with Gemma 3's image tokens
(32 x 32 images, 4 soft tokens each), images encoded as verl's prompt files hold them, and a tiny random
`Gemma3ForConditionalGeneration` on that processor's vocabulary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hfjax.data.shapes_task import png  # re-exported: the tests encode images as the quickstart does
from hfjax.models.local_tokenizer import GEMMA3_IMAGE_TOKENS
from hfjax.models.local_tokenizer import build_gemma3_processor as build_local_gemma3_processor

__all__ = [
    "BOI",
    "EOI",
    "SOFT",
    "build_gemma3_processor",
    "checkpoint_tensors",
    "only_the_tower_kept",
    "pixels",
    "png",
    "save_vision_policy",
]

BOI, EOI, SOFT = (GEMMA3_IMAGE_TOKENS[name] for name in ("boi_token", "eoi_token", "image_token"))
TOKENS_PER_IMAGE = 4


def pixels(seed: int, shape=(20, 30, 3)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def build_gemma3_processor() -> Any:
    """A `Gemma3Processor` for 32 x 32 images, `TOKENS_PER_IMAGE` soft tokens each, over a 300-entry BPE tokenizer."""
    return build_local_gemma3_processor(["user: how many shapes", "assistant: 3"], 300, 32, TOKENS_PER_IMAGE)


def save_vision_policy(directory: Path, processor: Any) -> Path:
    """A tiny random Gemma 3 vision-language checkpoint on `processor`'s vocabulary and image tokens, saved with the
    processor in `directory`; returns it."""
    import torch
    import transformers as tf

    tokenizer = processor.tokenizer
    ids = tokenizer.convert_tokens_to_ids
    text = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, vocab_size=len(tokenizer), sliding_window=8,
                layer_types=["sliding_attention", "full_attention"], pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)  # fmt: skip
    vision = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8, num_channels=3, layer_norm_eps=1e-6, vision_use_head=False)  # fmt: skip
    tokens = dict(image_token_index=ids(SOFT), boi_token_index=ids(BOI), eoi_token_index=ids(EOI))
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE, **tokens)
    torch.manual_seed(0)
    tf.Gemma3ForConditionalGeneration(config).save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def checkpoint_tensors(path: Path) -> dict[str, np.ndarray]:
    """The tensors of the Gemma 3 vision-language checkpoint `path` as transformers loads it, which must find every
    tensor it expects and no other."""
    import transformers as tf

    model, info = tf.Gemma3ForConditionalGeneration.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}


def only_the_tower_kept(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> bool:
    """Whether a run with the vision tower frozen kept every tower tensor of `before` bitwise and moved every
    projection kernel outside it (the language model's)."""
    tower = [name for name in before if ".vision_tower." in name]
    trained = [name for name in before if name.endswith("proj.weight") and ".vision_tower." not in name]
    return (
        before.keys() == after.keys()
        and bool(tower and trained)
        and all(np.array_equal(before[name], after[name]) for name in tower)
        and not any(np.array_equal(before[name], after[name]) for name in trained)
    )
