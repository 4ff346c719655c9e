"""A tiny random Gemma 3 vision-language checkpoint (every tensor made to matter) and one batch over it with left
padding, two images in one row and a row without images, with transformers' and hfjax's losses over it: what the
vision-language model tests compare."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers as tf
from flax import nnx

VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=32,
              patch_size=8, num_channels=3, layer_norm_eps=1e-6, vision_use_head=False)  # fmt: skip
# a sliding layer whose window (6) is shorter than the rows, then a full one
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=300, sliding_window=6,
            layer_types=["sliding_attention", "full_attention"])  # fmt: skip
IMAGE, BOI, EOI, PAD = 299, 297, 298, 0
ARCH = "Gemma3ForConditionalGeneration"
TOKENS_PER_IMAGE = 4


def save_tiny_gemma3(path: Path) -> tf.Gemma3ForConditionalGeneration:
    """Saves the tiny random checkpoint in `path`; returns the transformers model (eval mode)."""
    config = tf.Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=TOKENS_PER_IMAGE,
                             image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI)  # fmt: skip
    torch.manual_seed(0)
    model = tf.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms start at zero (Gemma's 1 + w) and the projection small: make every tensor matter
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(path)
    return model


IMAGE_SPAN = [BOI, *[IMAGE] * TOKENS_PER_IMAGE, EOI]


def batch() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids, attention_mask) [3, 24] and pixel values [3 images, 3, 32, 32]: row 0 left-padded with one image
    mid-text, row 1 two images (one right after the other's end), row 2 left-padded text only."""
    rng = np.random.default_rng(3)

    def text(n: int) -> list[int]:
        return list(rng.integers(3, 290, n))

    rows = [
        [PAD] * 3 + text(5) + IMAGE_SPAN + text(10),
        text(2) + IMAGE_SPAN + text(3) + IMAGE_SPAN + text(7),
        [PAD] * 7 + text(17),
    ]
    ids = np.asarray(rows, np.int64)
    mask = (np.arange(ids.shape[1])[None, :] >= np.asarray([3, 0, 7])[:, None]).astype(np.int64)
    pixels = rng.normal(size=(3, 3, 32, 32)).astype(np.float32)
    return ids, mask, pixels


def per_row(pixels: np.ndarray) -> np.ndarray:
    """The batch's images as the model takes them, [rows, images per row, ...]: row 0 its one image and a zero
    padding image, row 1 its two, row 2 two padding images."""
    pad = np.zeros_like(pixels[0])
    return np.stack([np.stack([pixels[0], pad]), pixels[1:3], np.stack([pad, pad])])


def positions(mask: np.ndarray) -> np.ndarray:
    return np.maximum(np.cumsum(mask, axis=1) - 1, 0)


def torch_logits(model, ids, mask, pixels) -> torch.Tensor:
    images = {}
    if pixels is not None:
        images = {"pixel_values": torch.tensor(pixels), "token_type_ids": torch.tensor((ids == IMAGE).astype(np.int64))}
    return model(
        input_ids=torch.tensor(ids),
        attention_mask=torch.tensor(mask),
        position_ids=torch.tensor(positions(mask)),
        **images,
    ).logits


def loss_weights(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Random weights on each real position's log prob of the next token (0 on padding and the last position)."""
    weights = np.random.default_rng(4).normal(size=ids.shape).astype(np.float32)
    weights[:, -1] = 0
    return weights * mask


def hf_loss(model, ids, mask, pixels) -> torch.Tensor:
    logp = torch.log_softmax(torch_logits(model, ids, mask, pixels), -1)
    picked = torch.gather(logp[:, :-1], 2, torch.tensor(ids[:, 1:, None])).squeeze(-1)
    return (picked * torch.tensor(loss_weights(ids, mask)[:, :-1])).sum()


def our_loss(model, ids, mask, pixels) -> jax.Array:
    logits = model(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(positions(mask)), pixels)
    logp = jax.nn.log_softmax(logits, -1)
    picked = jnp.take_along_axis(logp[:, :-1], jnp.asarray(ids[:, 1:, None]), 2)[..., 0]
    return jnp.sum(picked * loss_weights(ids, mask)[:, :-1])


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def gradients(model, ids, mask, pixels) -> dict[tuple, np.ndarray]:
    graphdef, params = nnx.split(model)
    grads = jax.jit(jax.grad(lambda p, x: our_loss(nnx.merge(graphdef, p), ids, mask, x)))(params, pixels)
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(grads)}


def torch_name(saved: str) -> str:
    """A saved tensor's name in the PyTorch module (transformers 5 keeps the language model under `model.`)."""
    if saved.startswith("language_model.model."):
        return saved.replace("language_model.model.", "model.language_model.", 1)
    return f"model.{saved}"


RESPONSE = 6  # the batch's last columns, read as each row's response


def policy_rows() -> dict[str, np.ndarray]:
    """The batch as an RL step's rows: the last `RESPONSE` columns each row's response (row 0's ending 2 tokens
    early, right-padded), the images per row."""
    ids, mask, pixels = batch()
    ids[0, -2:], mask[0, -2:] = PAD, 0
    rows = {"input_ids": ids, "attention_mask": mask, "position_ids": positions(mask), "images": per_row(pixels)}
    return rows | {"responses": ids[:, -RESPONSE:], "response_mask": mask[:, -RESPONSE:]}
