"""The vision side of Gemma 3 (`hfjax.models.vision`) on a tiny random checkpoint made with transformers: image
soft tokens equal transformers' `get_image_features` (float32, relative 1e-5), every vision parameter's gradient
equals PyTorch's (relative 1e-4), and under fsdp 4 x tensor 2 the soft tokens equal one device's."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from flax import nnx
from safetensors.numpy import load_file

from hfjax.models.vision import ImageEncoder, VisionConfig, tower_prefix, vision_plan
from hfjax.parallel import Layout

VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=32,
              patch_size=8, num_channels=3, layer_norm_eps=1e-6, vision_use_head=False)  # fmt: skip
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=300, sliding_window=16)  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[tf.Gemma3ForConditionalGeneration, Path]:
    config = tf.Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4, image_token_index=299,
                             boi_token_index=297, eoi_token_index=298)  # fmt: skip
    torch.manual_seed(0)
    model = tf.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # the projection starts at zero and norms at one: make every tensor matter
        for name, param in model.named_parameters():
            if "vision" in name or "projector" in name:
                param.add_(0.05 * torch.randn_like(param))
    path = tmp_path_factory.mktemp("gemma3_vision")
    model.save_pretrained(path)
    return model, path


def loaded(path: Path, layout: Layout | None = None) -> ImageEncoder:
    """An `ImageEncoder` with the checkpoint's weights, placed by `layout` (else on the default device)."""
    cfg = VisionConfig.from_hf(json.loads((path / "config.json").read_text()))
    tensors = load_file(path / "model.safetensors")
    encoder = nnx.eval_shape(lambda: ImageEncoder(cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(encoder)
    flat = dict(nnx.to_flat_state(state))
    for mapping in vision_plan(cfg, tower_prefix(tensors)):
        shape = flat[mapping.path].shape
        flat[mapping.path].set_value(jnp.asarray(mapping.to_model(tensors[mapping.hf_name], shape)))
    assert not [p for p, v in flat.items() if isinstance(v.get_value(), jax.ShapeDtypeStruct)], "unloaded parameters"
    nnx.update(encoder, state)
    if layout is not None:
        state = nnx.state(encoder)
        nnx.update(encoder, jax.device_put(state, layout.shardings(state)))
    return encoder


def images(n: int) -> np.ndarray:
    return np.random.default_rng(1).normal(size=(n, 3, 32, 32)).astype(np.float32)


def test_soft_tokens_and_gradients_equal_transformers(checkpoint):
    model, path = checkpoint
    pixels = images(2)
    weights = np.random.default_rng(2).normal(size=(2, 4, TEXT["hidden_size"])).astype(np.float32)
    pixels_t = torch.tensor(pixels)
    want = model.model.get_image_features(pixels_t, return_dict=True).pooler_output
    (want * torch.tensor(weights)).sum().backward()
    encoder = loaded(path)
    got = encoder(jnp.asarray(pixels))
    np.testing.assert_allclose(np.asarray(got), want.detach().numpy(), rtol=1e-5, atol=1e-6)

    graphdef, params = nnx.split(encoder)
    grads = jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(jnp.asarray(pixels)) * weights))(params)
    flat = dict(nnx.to_flat_state(grads))
    torch_grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    tensors = load_file(path / "model.safetensors")
    plan = vision_plan(VisionConfig.from_hf(json.loads((path / "config.json").read_text())), tower_prefix(tensors))
    pairs = {}
    for mapping in plan:
        ours = np.asarray(flat[mapping.path].get_value())
        pairs[mapping.hf_name] = (ours, mapping.to_model(torch_grads["model." + mapping.hf_name].numpy(), ours.shape))
    for name, (ours, theirs) in pairs.items():
        if name.endswith("k_proj.bias"):  # adds the same score to every key of a query: softmax ignores it
            scale = np.linalg.norm(pairs[name.replace("k_proj", "q_proj")][1])
            assert np.linalg.norm(ours) < 1e-5 * scale and np.linalg.norm(theirs) < 1e-5 * scale, name
            continue
        error = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
        assert error < 1e-4, (name, error)


def test_soft_tokens_under_fsdp_and_tensor_parallelism_equal_one_devices(checkpoint):
    _, path = checkpoint
    layout = Layout.from_config({"mesh": {"fsdp": 4, "tensor": 2}, "rules": "fsdp_tp"})
    pixels = images(4)
    one = np.asarray(loaded(path)(jnp.asarray(pixels)))
    sharded_encoder = loaded(path, layout)
    graphdef, state = nnx.split(sharded_encoder)
    from hfjax.models.program import program_layout

    def encode(state, pixels):
        with program_layout(layout):
            return nnx.merge(graphdef, state)(pixels)

    batch = jax.device_put(pixels, layout.sharding(("batch", None, None, None), pixels.shape))
    sharded = np.asarray(jax.jit(encode)(state, batch))
    np.testing.assert_allclose(sharded, one, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("per_device", [1, 3])
def test_encoding_a_few_images_at_a_time_gives_the_same_soft_tokens_and_gradients(checkpoint, per_device):
    """`images_per_step` under fsdp 4 x tensor 2 (the images split 4 ways): 16 images encoded a step of 4 x
    `per_device` after another (4 steps; 2 with the second padded) give the soft tokens and every gradient of all
    of them at once."""
    from hfjax.models.program import program_layout
    from hfjax.models.vision import set_images_per_step

    _, path = checkpoint
    layout = Layout.from_config({"mesh": {"fsdp": 4, "tensor": 2}, "rules": "fsdp_tp"})
    pixels = images(16)
    weights = np.random.default_rng(3).normal(size=(16, 4, TEXT["hidden_size"])).astype(np.float32)
    encoder = loaded(path, layout)
    graphdef, state = nnx.split(encoder)

    def loss(state, pixels):
        with program_layout(layout):
            tokens = nnx.merge(graphdef, state)(pixels)
        return jnp.sum(tokens * weights), tokens

    def run() -> tuple:
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(state, jnp.asarray(pixels))

    (_, at_once), grads_at_once = run()
    set_images_per_step(encoder, per_device)
    graphdef, state = nnx.split(encoder)
    (_, stepped), grads_stepped = run()
    assert np.linalg.norm(stepped - at_once) / np.linalg.norm(at_once) < 1e-6
    total = np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(grads_at_once)))
    for a, b in zip(jax.tree.leaves(grads_stepped), jax.tree.leaves(grads_at_once), strict=True):
        # the key biases' gradients are rounding noise (softmax ignores them): held to the whole gradient's scale
        assert np.linalg.norm(a - b) <= 1e-5 * max(np.linalg.norm(b), 1e-2 * total)
