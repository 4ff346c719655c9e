"""Building blocks of the decoder: logical-axis parameters, RMSNorm, rotary embedding, attention, gated MLP.

Every parameter carries `logical_axes` metadata (names from `LOGICAL_AXES`); a `Layout` maps them to mesh axes.
Weights are stored output-major like HF's `[out, in]` (loading is a reshape, never a transpose; XLA's CPU matmuls
were also faster this way on our shapes).
Compute runs in `dtype`; parameters are stored in `param_dtype`; norms and softmax run in float32.
The attention step is `hfjax.models.attention.causal_attention`.
Activations are pinned to their logical axes (`hfjax.models.program.constrain`: the residual stream, q/k/v, the
attention output, the MLP hidden), so that the program's layout, not propagation from the weights, splits them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hfjax.models.attention import causal_attention
from hfjax.models.config import ModelConfig, RopeConfig
from hfjax.models.dense import dense
from hfjax.models.lora import LoraAdapter, with_adapter
from hfjax.models.moe import SparseMoE
from hfjax.models.primitives import ACTIVATION_FUNCTIONS, logical_param, normal_init
from hfjax.models.program import constrain

RESIDUAL = ("batch", "length", "embed")  # logical axes of the residual stream (rows split; embed never)
Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def _normalized32(x: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def rms_normalize(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF RMSNorm: normalise in float32, cast back to the input dtype, then scale."""
    return _normalized32(x, eps).astype(x.dtype) * weight.astype(x.dtype)


def rms_normalize_offset(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: normalise and scale by (1 + weight) in float32, then cast to the input dtype."""
    return (_normalized32(x, eps) * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis; with `offset` (Gemma) the stored weight is the scale minus one (initialised 0)."""

    def __init__(
        self, size: int, axis: str, eps: float, param_dtype: jnp.dtype, rngs: nnx.Rngs | None, offset: bool = False
    ):
        init = jax.nn.initializers.zeros if offset else jax.nn.initializers.ones
        self.weight = logical_param(rngs, init, (size,), (axis,), param_dtype)
        self.eps = eps
        self.offset = offset

    def __call__(self, x: jax.Array) -> jax.Array:
        normalize = rms_normalize_offset if self.offset else rms_normalize
        return normalize(x, self.weight[...], self.eps)


def norm(cfg: ModelConfig, size: int, axis: str, param_dtype: jnp.dtype, rngs: nnx.Rngs | None) -> RMSNorm:
    """The RMSNorm of `cfg`'s family over `size` features of logical axis `axis`."""
    return RMSNorm(size, axis, cfg.rms_norm_eps, param_dtype, rngs, offset=cfg.norm_offset)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequency per rotary pair in float32, with `linear` or `llama3` scaling (HF's arithmetic)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / (np.float32(rope.theta) ** exponents)).astype(np.float32)
    if rope.rope_type == "linear":
        return (inv / np.float32(rope.factor)).astype(np.float32)
    if rope.rope_type == "llama3":
        old_len = np.float32(rope.original_max_position_embeddings)
        low, high, factor = (np.float32(v) for v in (rope.low_freq_factor, rope.high_freq_factor, rope.factor))
        wavelen = np.float32(2 * np.pi) / inv
        scaled = np.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin of shape [batch, length, head_dim] for integer positions [batch, length]."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates [batch, length, heads, head_dim] by the half-split convention of HF Llama."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


class Attention(nnx.Module):
    """Multi-head attention with GQA/MQA, optional q/k/v/o biases, per-head q/k RMSNorm (Qwen3, Gemma 3) and
    Gemma's query scale (the attention functions scale scores by head_dim ** -0.5: the queries carry the rest)."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs | None, std: float):
        d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        init = normal_init(std)
        zeros = jax.nn.initializers.zeros
        self.q_kernel = logical_param(rngs, init, (h, hd, d), ("heads", "head_dim", "embed"), param_dtype)
        self.k_kernel = logical_param(rngs, init, (kv, hd, d), ("kv_heads", "head_dim", "embed"), param_dtype)
        self.v_kernel = logical_param(rngs, init, (kv, hd, d), ("kv_heads", "head_dim", "embed"), param_dtype)
        self.o_kernel = logical_param(rngs, init, (d, h, hd), ("embed", "heads", "head_dim"), param_dtype)
        self.q_bias = logical_param(rngs, zeros, (h, hd), ("heads", "head_dim"), param_dtype) if cfg.qkv_bias else None
        self.k_bias = (
            logical_param(rngs, zeros, (kv, hd), ("kv_heads", "head_dim"), param_dtype) if cfg.qkv_bias else None
        )
        self.v_bias = (
            logical_param(rngs, zeros, (kv, hd), ("kv_heads", "head_dim"), param_dtype) if cfg.qkv_bias else None
        )
        self.o_bias = logical_param(rngs, zeros, (d,), ("embed",), param_dtype) if cfg.o_bias else None
        self.q_norm = norm(cfg, hd, "head_dim", param_dtype, rngs) if cfg.qk_norm else None
        self.k_norm = norm(cfg, hd, "head_dim", param_dtype, rngs) if cfg.qk_norm else None
        scalar = cfg.query_pre_attn_scalar
        self.query_factor = None if scalar is None or scalar == hd else float((hd / scalar) ** 0.5)
        self.dtype = dtype
        self.q_lora = self.k_lora = self.v_lora = self.o_lora = None  # LoRA adapters (`hfjax.models.lora`)

    def _project(
        self, x: jax.Array, kernel: nnx.Param, bias: nnx.Param | None, adapter: LoraAdapter | None
    ) -> jax.Array:
        # As one [heads * head_dim, embed] matrix (a free reshape): a 3-D contraction makes XLA:CPU transpose the
        # kernel on every call, a 2-D one multiplies by its transpose in place.
        heads, head_dim, embed = kernel.shape
        flat = kernel[...].astype(self.dtype).reshape(heads * head_dim, embed)
        y = with_adapter(dense(x, flat), x, adapter, self.dtype).reshape(*x.shape[:2], heads, head_dim)
        return y if bias is None else y + bias[...].astype(self.dtype)

    def project_qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries, keys (both rotated) and values for hidden states x [b, t, embed]."""
        q = self._project(x, self.q_kernel, self.q_bias, self.q_lora)
        k = self._project(x, self.k_kernel, self.k_bias, self.k_lora)
        v = self._project(x, self.v_kernel, self.v_bias, self.v_lora)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.query_factor is not None:
            q = q * jnp.asarray(self.query_factor, q.dtype)
        heads, kv_heads = ("batch", "length", "heads", "head_dim"), ("batch", "length", "kv_heads", "head_dim")
        q, k = constrain(apply_rope(q, cos, sin), heads), constrain(apply_rope(k, cos, sin), kv_heads)
        return q, k, constrain(v, kv_heads)

    def project_out(self, attended: jax.Array) -> jax.Array:
        embed, heads, head_dim = self.o_kernel.shape
        flat = self.o_kernel[...].astype(self.dtype).reshape(embed, heads * head_dim)
        attended = constrain(attended, ("batch", "length", "heads", "head_dim"))
        attended = attended.reshape(*attended.shape[:2], heads * head_dim)
        y = with_adapter(dense(attended, flat), attended, self.o_lora, self.dtype)
        return y if self.o_bias is None else y + self.o_bias[...].astype(self.dtype)


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), act silu (SwiGLU) or tanh-approximated GELU (GeGLU, Gemma)."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs | None, std: float):
        d, m = cfg.hidden_size, cfg.intermediate_size
        init, zeros = normal_init(std), jax.nn.initializers.zeros
        self.gate_kernel = logical_param(rngs, init, (m, d), ("mlp", "embed"), param_dtype)
        self.up_kernel = logical_param(rngs, init, (m, d), ("mlp", "embed"), param_dtype)
        self.down_kernel = logical_param(rngs, init, (d, m), ("embed", "mlp"), param_dtype)
        self.gate_bias = logical_param(rngs, zeros, (m,), ("mlp",), param_dtype) if cfg.mlp_bias else None
        self.up_bias = logical_param(rngs, zeros, (m,), ("mlp",), param_dtype) if cfg.mlp_bias else None
        self.down_bias = logical_param(rngs, zeros, (d,), ("embed",), param_dtype) if cfg.mlp_bias else None
        self.hidden_act = cfg.hidden_act
        self.dtype = dtype
        self.gate_lora = self.up_lora = self.down_lora = None  # LoRA adapters (`hfjax.models.lora`)

    def _dense(self, x: jax.Array, kernel: nnx.Param, bias: nnx.Param | None, adapter: LoraAdapter | None) -> jax.Array:
        y = with_adapter(dense(x, kernel[...].astype(self.dtype)), x, adapter, self.dtype)
        return y if bias is None else y + bias[...].astype(self.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        act = ACTIVATION_FUNCTIONS[self.hidden_act]
        gate = self._dense(x, self.gate_kernel, self.gate_bias, self.gate_lora)
        hidden = act(gate) * self._dense(x, self.up_kernel, self.up_bias, self.up_lora)
        hidden = constrain(hidden, ("batch", "length", "mlp"))
        return self._dense(hidden, self.down_kernel, self.down_bias, self.down_lora)


class DecoderLayer(nnx.Module):
    """Layer `index` of `cfg`: attention (with that layer's window and rotary embedding) and the MLP (the mixture
    of experts where `cfg.moe_layers` says), each behind an RMSNorm, with Gemma's norms on their outputs too when
    `cfg.sandwich_norms`. The attributes are HF's names."""

    def __init__(
        self, cfg: ModelConfig, index: int, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs | None, std: float
    ):
        d = cfg.hidden_size
        self.input_layernorm = norm(cfg, d, "embed", param_dtype, rngs)
        self.self_attn = Attention(cfg, dtype, param_dtype, rngs, std)
        self.post_attention_layernorm = norm(cfg, d, "embed", param_dtype, rngs)
        self.pre_feedforward_layernorm = norm(cfg, d, "embed", param_dtype, rngs) if cfg.sandwich_norms else None
        self.post_feedforward_layernorm = norm(cfg, d, "embed", param_dtype, rngs) if cfg.sandwich_norms else None
        if cfg.moe_layers[index]:
            self.mlp = SparseMoE(cfg, dtype, param_dtype, rngs, std, moe_index=sum(cfg.moe_layers[:index]))
        else:
            self.mlp = MLP(cfg, dtype, param_dtype, rngs, std)
        self.window = cfg.sliding_windows[index]
        self.rope = cfg.layer_ropes[index]
        self.softcap = cfg.attn_softcap

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        mask: jax.Array,
        segments: jax.Array,
        expert_choices: jax.Array | None = None,
        *,
        sees_ahead: bool = False,
    ) -> jax.Array:
        """The block over a batch of `segments` [b, t] (0/1 real tokens, or packed segment ids); `mask` is
        `attention_mask(segments, index, index, self.window)` [b, t, t]; cos and sin are of `self.rope`;
        `expert_choices` replays a mixture of experts' routes (`hfjax.models.moe`). `sees_ahead`: the mask lets
        image blocks see ahead (`attention_mask(..., blocks)`)."""

        def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            return causal_attention(
                q, k, v, valid=segments, mask=mask, window=self.window, softcap=self.softcap, sees_ahead=sees_ahead
            )

        return self.block(x, cos, sin, attend, expert_choices, segments > 0)

    def block(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        attend: Attend,
        expert_choices: jax.Array | None = None,
        valid: jax.Array | None = None,
    ) -> jax.Array:
        """The residual block with the attention step given as `attend(q, k, v) -> attended` (a full forward
        attends over k, v; generation writes them to its KV cache first and attends over the cache); `valid`
        [b, t] marks the real tokens for a mixture of experts' router statistics."""
        attn = self.self_attn
        q, k, v = attn.project_qkv(self.input_layernorm(x), cos, sin)
        attended = attn.project_out(attend(q, k, v))
        if self.pre_feedforward_layernorm is None:
            x = constrain(x + attended, RESIDUAL)
            return constrain(x + self._mlp(self.post_attention_layernorm(x), expert_choices, valid), RESIDUAL)
        x = constrain(x + self.post_attention_layernorm(attended), RESIDUAL)
        mlp = self._mlp(self.pre_feedforward_layernorm(x), expert_choices, valid)
        return constrain(x + self.post_feedforward_layernorm(mlp), RESIDUAL)

    def _mlp(self, x: jax.Array, expert_choices: jax.Array | None, valid: jax.Array | None) -> jax.Array:
        return self.mlp(x, expert_choices, valid) if isinstance(self.mlp, SparseMoE) else self.mlp(x)
