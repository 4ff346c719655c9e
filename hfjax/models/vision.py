"""The vision side of a vision-language model: SigLIP's vision transformer (Gemma 3's vision tower) and Gemma 3's
multimodal projector, which turn images into the soft tokens a language model reads in place of its image
placeholders.

`VisionTower(images)`: pixel values [images, channels, height, width] -> patch states [images, patches, vision
embed]: non-overlapping patches (SigLIP's stride-`patch_size` convolution as one matmul over each patch's pixels), a
learnt position embedding, pre-norm encoder layers (LayerNorm, bidirectional multi-head attention with biases, a
gelu-tanh MLP) and a last LayerNorm. `ImageProjector(states)`: average pooling of the patch grid down to
`tokens_per_image` tokens, Gemma's RMSNorm and a projection into the language model's embedding width.

Weights are stored as the Hugging Face checkpoint stores them (`vision_plan` names every tensor), with logical axes
like the decoder's (heads and MLP over `tensor`, `embed` over `fsdp`; images are rows of the `batch` axis), so one
layout shards the whole model. Norms and softmax run in float32, matmuls in the compute dtype.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hfjax.models.attention import dot_product_attention
from hfjax.models.dense import dense
from hfjax.models.hf import ParamMapping
from hfjax.models.layers import rms_normalize_offset
from hfjax.models.primitives import logical_param, normal_init
from hfjax.models.program import constrain, split_parts

PATCHES = ("batch", "patches", "embed")  # logical axes of the tower's hidden states (images split over rows)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """A SigLIP vision tower (HF's `SiglipVisionConfig`) and Gemma 3's projector onto `text_hidden_size`."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    tokens_per_image: int = 256  # soft tokens per image after pooling (Gemma 3's mm_tokens_per_image)
    text_hidden_size: int = 0  # the language model's embedding width

    def __post_init__(self) -> None:
        side, tokens_side = self.patches_per_side, math.isqrt(self.tokens_per_image)
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision_config: hidden_size {self.hidden_size} not a multiple of {self.num_heads} heads")
        if self.image_size % self.patch_size or tokens_side**2 != self.tokens_per_image or side % tokens_side:
            raise ValueError(
                f"vision_config: image_size {self.image_size} / patch_size {self.patch_size} = {side} patches a side, "
                f"and mm_tokens_per_image {self.tokens_per_image}: expected a square number of tokens whose side "
                "divides the patches' side"
            )

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> VisionConfig:
        """From a Gemma 3 multimodal `config.json` (its `vision_config`, `text_config` and `mm_tokens_per_image`)."""
        vision, text = config["vision_config"], config["text_config"]
        act = vision.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"vision_config.hidden_act: {act!r} is not supported; expected gelu_pytorch_tanh")
        return cls(
            hidden_size=vision["hidden_size"],
            intermediate_size=vision["intermediate_size"],
            num_layers=vision["num_hidden_layers"],
            num_heads=vision["num_attention_heads"],
            image_size=vision["image_size"],
            patch_size=vision["patch_size"],
            num_channels=vision.get("num_channels", 3),
            layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
            tokens_per_image=config.get("mm_tokens_per_image", 256),
            text_hidden_size=text["hidden_size"],
        )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class LayerNorm(nnx.Module):
    """LayerNorm with weight and bias over the last axis, in float32."""

    def __init__(self, size: int, eps: float, param_dtype: jnp.dtype, rngs: nnx.Rngs | None):
        self.weight = logical_param(rngs, jax.nn.initializers.ones, (size,), ("embed",), param_dtype)
        self.bias = logical_param(rngs, jax.nn.initializers.zeros, (size,), ("embed",), param_dtype)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def _linear(x: jax.Array, kernel: nnx.Param, bias: nnx.Param, dtype: jnp.dtype) -> jax.Array:
    """x [..., in] @ kernel [out..., in].T + bias, the kernel's output dims flattened."""
    flat = kernel[...].astype(dtype).reshape(-1, kernel.shape[-1])
    return dense(x, flat) + bias[...].astype(dtype).reshape(-1)


class VisionLayer(nnx.Module):
    """One pre-norm encoder layer: x + attention(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: VisionConfig, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs | None):
        d, h, hd, m = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
        init, zeros = normal_init(0.02), jax.nn.initializers.zeros
        for name in ("q", "k", "v"):
            setattr(
                self,
                f"{name}_kernel",
                logical_param(rngs, init, (h, hd, d), ("heads", "head_dim", "embed"), param_dtype),
            )
            setattr(self, f"{name}_bias", logical_param(rngs, zeros, (h, hd), ("heads", "head_dim"), param_dtype))
        self.o_kernel = logical_param(rngs, init, (d, h, hd), ("embed", "heads", "head_dim"), param_dtype)
        self.o_bias = logical_param(rngs, zeros, (d,), ("embed",), param_dtype)
        self.fc1_kernel = logical_param(rngs, init, (m, d), ("mlp", "embed"), param_dtype)
        self.fc1_bias = logical_param(rngs, zeros, (m,), ("mlp",), param_dtype)
        self.fc2_kernel = logical_param(rngs, init, (d, m), ("embed", "mlp"), param_dtype)
        self.fc2_bias = logical_param(rngs, zeros, (d,), ("embed",), param_dtype)
        self.layer_norm1 = LayerNorm(d, cfg.layer_norm_eps, param_dtype, rngs)
        self.layer_norm2 = LayerNorm(d, cfg.layer_norm_eps, param_dtype, rngs)
        self.heads, self.head_dim, self.dtype = h, hd, dtype

    def _attention(self, x: jax.Array) -> jax.Array:
        images, patches, _ = x.shape
        q, k, v = (
            constrain(
                _linear(x, getattr(self, f"{n}_kernel"), getattr(self, f"{n}_bias"), self.dtype).reshape(
                    images, patches, self.heads, self.head_dim
                ),
                ("batch", "patches", "heads", "head_dim"),
            )
            for n in ("q", "k", "v")
        )
        every_patch = jnp.ones((images, patches, patches), bool)  # bidirectional: one block of every key
        attended = dot_product_attention(q, k, v, every_patch, causal_blocks=1).reshape(images, patches, -1)
        flat = self.o_kernel[...].astype(self.dtype).reshape(self.o_kernel.shape[0], -1)
        return dense(attended, flat) + self.o_bias[...].astype(self.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = constrain(x + self._attention(self.layer_norm1(x)), PATCHES)
        hidden = jax.nn.gelu(_linear(self.layer_norm2(x), self.fc1_kernel, self.fc1_bias, self.dtype), approximate=True)
        hidden = constrain(hidden, ("batch", "patches", "mlp"))
        return constrain(x + _linear(hidden, self.fc2_kernel, self.fc2_bias, self.dtype), PATCHES)


class VisionTower(nnx.Module):
    """SigLIP's vision transformer: images [n, channels, height, width] -> patch states [n, patches, embed]."""

    def __init__(self, cfg: VisionConfig, *, dtype: Any = jnp.float32, param_dtype: Any = None, rngs: nnx.Rngs | None):
        param_dtype = param_dtype or dtype
        d, p, c = cfg.hidden_size, cfg.patch_size, cfg.num_channels
        init = normal_init(0.02)
        axes = ("embed", "patch_pixels", "patch_pixels", "patch_pixels")
        self.patch_kernel = logical_param(rngs, init, (d, c, p, p), axes, param_dtype)
        self.patch_bias = logical_param(rngs, jax.nn.initializers.zeros, (d,), ("embed",), param_dtype)
        self.position_embedding = logical_param(
            rngs, init, (cfg.patches_per_side**2, d), ("patches", "embed"), param_dtype
        )
        self.layers = nnx.List([VisionLayer(cfg, dtype, param_dtype, rngs) for _ in range(cfg.num_layers)])
        self.post_layernorm = LayerNorm(d, cfg.layer_norm_eps, param_dtype, rngs)
        self.config, self.dtype = cfg, dtype

    def __call__(self, images: jax.Array) -> jax.Array:
        cfg = self.config
        n, c, height, width = images.shape
        if (c, height, width) != (cfg.num_channels, cfg.image_size, cfg.image_size):
            raise ValueError(
                f"images: expected [n, {cfg.num_channels}, {cfg.image_size}, {cfg.image_size}], got {images.shape}"
            )
        p, side = cfg.patch_size, cfg.patches_per_side
        # each patch's pixels in the convolution kernel's (channel, row, column) order
        patches = images.astype(self.dtype).reshape(n, c, side, p, side, p).transpose(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(n, side * side, c * p * p)
        kernel = self.patch_kernel[...].astype(self.dtype).reshape(cfg.hidden_size, -1)
        x = dense(patches, kernel) + self.patch_bias[...].astype(self.dtype)
        x = constrain(x + self.position_embedding[...].astype(self.dtype), PATCHES)
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)


class ImageProjector(nnx.Module):
    """Gemma 3's multimodal projector: patch states [n, patches, vision embed] -> soft tokens [n, tokens_per_image,
    text embed] (average pooling of the patch grid, Gemma's RMSNorm, a projection)."""

    def __init__(self, cfg: VisionConfig, *, dtype: Any = jnp.float32, param_dtype: Any = None, rngs: nnx.Rngs | None):
        param_dtype = param_dtype or dtype
        d, text = cfg.hidden_size, cfg.text_hidden_size
        self.norm_weight = logical_param(rngs, jax.nn.initializers.zeros, (d,), ("embed",), param_dtype)
        # stored [vision embed, text embed] as HF stores it; the text side is the language model's `embed`
        self.projection = logical_param(rngs, normal_init(0.02), (d, text), ("mlp", "embed"), param_dtype)
        self.config, self.dtype = cfg, dtype

    def __call__(self, states: jax.Array) -> jax.Array:
        cfg = self.config
        n, _, d = states.shape
        side, tokens_side = cfg.patches_per_side, math.isqrt(cfg.tokens_per_image)
        k = side // tokens_side
        grid = states.reshape(n, tokens_side, k, tokens_side, k, d).astype(jnp.float32)
        pooled = jnp.mean(grid, axis=(2, 4)).reshape(n, cfg.tokens_per_image, d)
        normed = rms_normalize_offset(pooled, self.norm_weight[...], cfg.layer_norm_eps).astype(self.dtype)
        tokens = jnp.einsum("ntd,de->nte", normed, self.projection[...].astype(self.dtype))
        return constrain(tokens.astype(states.dtype), ("batch", "length", "embed"))


class ImageEncoder(nnx.Module):
    """Images [n, channels, height, width] -> soft tokens [n, tokens_per_image, text embed]: `VisionTower` then
    `ImageProjector` (Gemma 3's `get_image_features`). With `images_per_step` (`set_images_per_step`), each device
    puts at most that many of its images through the tower at once, one step after another (`jax.lax.map`), which
    bounds the tower's activations (its attention's scores grow with the images encoded together); the soft tokens
    are the same."""

    def __init__(self, cfg: VisionConfig, *, dtype: Any = jnp.float32, param_dtype: Any = None, rngs: nnx.Rngs | None):
        self.vision_tower = VisionTower(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.projector = ImageProjector(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.images_per_step = 0  # 0: every image at once (static: it keys the compiled programs)

    def _encode(self, images: jax.Array) -> jax.Array:
        return self.projector(self.vision_tower(images))

    def __call__(self, images: jax.Array) -> jax.Array:
        n = images.shape[0]
        step = self.images_per_step * split_parts("batch", n)  # images at once over the devices the rows split over
        if not step or n <= step:
            return self._encode(images)
        steps = -(-n // step)
        padded = jnp.pad(images, ((0, steps * step - n),) + ((0, 0),) * (images.ndim - 1))
        # image i = (j, k) with i = j * steps + k: step k takes images k, k + steps, ..., so each step's images spread
        # over the devices as the whole batch is, `images_per_step` on each
        grouped = padded.reshape(step, steps, *images.shape[1:]).swapaxes(0, 1)
        tokens = jax.lax.map(self._encode, grouped)  # [steps, step, tokens, embed]
        return tokens.swapaxes(0, 1).reshape(steps * step, *tokens.shape[2:])[:n]


def set_images_per_step(encoder: ImageEncoder, images: int) -> None:
    """Encodes at most `images` images at once on each device (0: all at once); changes no value, only memory and
    scheduling."""
    if images < 0:
        raise ValueError(f"images_per_step: expected 0 (all at once) or a positive count, got {images}")
    encoder.images_per_step = images


# Where a checkpoint keeps the vision tower: the Hub's Gemma 3 checkpoints under `vision_tower.vision_model.`,
# transformers 5's `save_pretrained` under `vision_tower.` (its loader reads both)
TOWER_PREFIXES = ("vision_tower.vision_model.", "vision_tower.")


def tower_prefix(names: Collection[str]) -> str:
    """The prefix of the vision tower's tensors among a checkpoint's tensor `names`."""
    for prefix in TOWER_PREFIXES:
        if f"{prefix}embeddings.patch_embedding.weight" in names:
            return prefix
    raise ValueError(f"no vision tower in the checkpoint: expected tensors under one of {TOWER_PREFIXES}")


def vision_plan(cfg: VisionConfig, tower: str = TOWER_PREFIXES[0]) -> list[ParamMapping]:
    """The HF name and conversion of every parameter of an `ImageEncoder` in a Gemma 3 multimodal checkpoint whose
    tower tensors are under `tower`."""
    ours = ("vision_tower",)
    plan = [
        ParamMapping(f"{tower}embeddings.patch_embedding.weight", (*ours, "patch_kernel")),
        ParamMapping(f"{tower}embeddings.patch_embedding.bias", (*ours, "patch_bias")),
        ParamMapping(f"{tower}embeddings.position_embedding.weight", (*ours, "position_embedding")),
        ParamMapping(f"{tower}post_layernorm.weight", (*ours, "post_layernorm", "weight")),
        ParamMapping(f"{tower}post_layernorm.bias", (*ours, "post_layernorm", "bias")),
        ParamMapping("multi_modal_projector.mm_soft_emb_norm.weight", ("projector", "norm_weight")),
        ParamMapping("multi_modal_projector.mm_input_projection_weight", ("projector", "projection")),
    ]
    for i in range(cfg.num_layers):
        hf, layer = f"{tower}encoder.layers.{i}.", (*ours, "layers", i)
        for name in "qkv":
            plan.append(ParamMapping(f"{hf}self_attn.{name}_proj.weight", (*layer, f"{name}_kernel"), "q_kernel"))
            plan.append(ParamMapping(f"{hf}self_attn.{name}_proj.bias", (*layer, f"{name}_bias"), "bias"))
        plan.append(ParamMapping(f"{hf}self_attn.out_proj.weight", (*layer, "o_kernel"), "o_kernel"))
        plan.append(ParamMapping(f"{hf}self_attn.out_proj.bias", (*layer, "o_bias")))
        for name in ("fc1", "fc2"):
            plan.append(ParamMapping(f"{hf}mlp.{name}.weight", (*layer, f"{name}_kernel")))
            plan.append(ParamMapping(f"{hf}mlp.{name}.bias", (*layer, f"{name}_bias")))
        for name in ("layer_norm1", "layer_norm2"):
            plan += [ParamMapping(f"{hf}{name}.{p}", (*layer, name, p)) for p in ("weight", "bias")]
    return plan
