"""The model's attention: `causal_attention` (training and log-prob forwards, prompt prefill) with implementations
chosen by backend; the decode step's attention over the blocked KV cache is `hfjax.models.decode_attention`.

Both are grouped-query attention (query head h reads kv head h // (heads // kv_heads)) with scores and softmax in
float32. A query at position i sees the keys at positions j <= i that are real and, with a sliding `window`, have
i - j < window, and, when a row packs several sequences (segment ids), only keys of its own sequence. A query with
no key to see (a padding row) has an unspecified output that differs between implementations, but is never NaN;
real rows never see padding, so padding rows cannot reach them.

Implementations (`IMPLEMENTATIONS`):
- `xla`: plain XLA (the reference, and the default on CPU).
- `cudnn`: cuDNN flash attention through `jax.nn.dot_product_attention`, where `cudnn_supported` (bf16/fp16, head
  dims, GQA); elsewhere xla. Under a sequence axis it runs per position shard (`cudnn_split_positions_attention`).
  Decode has no cuDNN kernel here: it runs xla.
- `pallas_tpu`: the Pallas TPU kernels of `hfjax.models.attention_pallas` (splash attention, a decode kernel).
- `pallas_interpret`: the same kernels in Pallas interpret mode, on any backend (what CPU tests run).
- `auto`: `choose_implementation` for the program's platform (`hfjax.models.program.program_platform`: the devices
  of its layout, so a program compiled for a target chooses for the target): xla on CPU, cudnn on a CUDA GPU,
  pallas_tpu on a TPU when the program has one device or its layout is known (below); a TPU program over several
  devices with no known layout stays on xla (XLA cannot partition a Pallas kernel over devices by itself).
The choice is the `implementation` argument, else the `HFJAX_ATTENTION` environment variable, else `auto`, read when
the function is traced: a jitted function keeps the choice of its trace. Scores soft-capped by `softcap` (Gemma 2's
`cap * tanh(s / cap)`, `scale_scores`) exist only in xla: with a cap, the others run as xla and log why, once.

Layout: code that owns a program's `hfjax.parallel.Layout` enters `program_layout(layout)` inside the traced
function (the engine's steps, a model role's row functions, the training programs). A Pallas kernel traced under a
layout of several devices then runs per shard in a `jax.shard_map` over the layout's mesh (`hfjax.models.per_shard`:
batch rows over the batch mesh axes, query and kv heads over the tensor axis), or, where the operands do
not split so, as xla for that call. Outside any layout (a plain `model(...)` call) the kernels run unsplit.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from hfjax.models.config import MASKED_SCORE
from hfjax.models.per_shard import CAUSAL_AXES, SPLIT_CAUSAL_AXES, per_shard
from hfjax.models.program import (
    constrain,
    current_layout,
    length_parts,
    program_device,
    program_device_count,
    program_platform,
    program_platform_version,
    split_axes,
)

logger = logging.getLogger(__name__)
ENV_VAR = "HFJAX_ATTENTION"
IMPLEMENTATIONS = ("auto", "xla", "cudnn", "pallas_tpu", "pallas_interpret")
PALLAS = ("pallas_tpu", "pallas_interpret")


def choose_implementation(
    backend: str, platform_version: str = "", device_count: int = 1, in_layout: bool = False
) -> str:
    """What `auto` runs on `backend` (the program's platform): cudnn on a CUDA GPU, pallas_tpu on a TPU
    when the program has one device or runs `in_layout` (its layout known, so the kernels run per shard in a
    shard_map), else xla. XLA cannot partition a Pallas (Mosaic) kernel over devices by itself, so a program over
    several TPU devices with no known layout stays on xla."""
    if backend in ("gpu", "cuda") and any(vendor in platform_version.lower() for vendor in ("cuda", "nvidia")):
        return "cudnn"
    if backend == "tpu" and (device_count == 1 or in_layout):
        return "pallas_tpu"
    return "xla"


def configured_implementation() -> str:
    """The `HFJAX_ATTENTION` setting now (unset: `auto`): part of the key of a program shared between callers, since
    a trace keeps the choice it read."""
    return os.environ.get(ENV_VAR) or "auto"


def resolve_implementation(implementation: str | None = None) -> str:
    """The implementation that runs (`xla`, `cudnn`, `pallas_tpu` or `pallas_interpret`) for `implementation`,
    else for the `HFJAX_ATTENTION` environment variable (unset: `auto`). Raises ValueError on any other value."""
    if implementation is not None:
        source, name = "implementation", implementation
    else:
        source, name = ENV_VAR, configured_implementation()
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"{source}={name!r} is not an attention implementation: expected one of {IMPLEMENTATIONS}")
    if name != "auto":
        return name
    return choose_implementation(
        program_platform(), program_platform_version(), program_device_count(), current_layout() is not None
    )


def attention_mask(
    segments: jax.Array,
    query_index: jax.Array,
    key_index: jax.Array,
    window: int | None,
    blocks: jax.Array | None = None,
) -> jax.Array:
    """Boolean [batch, positions, positions] over `segments` [batch, positions] (0: padding; a row of 0/1 is one
    sequence, several increasing ids are packed sequences): causal, within the sliding window when one is set, and
    a query sees only real keys of its own segment. With `blocks` [batch, positions] (an image's soft tokens share
    an id >= 0, text is -1) the positions of one block also see each other (Gemma 3's bidirectional image
    attention): causal or same block, then the window (query - key < window: a later key of its block is in it)."""
    allowed = (key_index[None, :] <= query_index[:, None])[None, :, :]
    if blocks is not None:
        allowed = allowed | ((blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0))
    if window is not None:
        allowed &= (query_index[:, None] - key_index[None, :] < window)[None, :, :]
    same = (segments[:, :, None] == segments[:, None, :]) & (segments[:, None, :] > 0)
    return allowed & same


def scale_scores(scores: jax.Array, head_dim: int, softcap: float | None) -> jax.Array:
    """Raw float32 q.k products scaled by head_dim ** -0.5, then soft-capped to cap * tanh(scores / cap) when
    `softcap` is set (Gemma 2), before any mask."""
    scores = scores * (head_dim**-0.5)
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


@functools.cache
def fall_back(requested: str, reason: str) -> None:
    logger.warning("attention: %s runs as xla: %s", requested, reason)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, softcap: float | None = None) -> jax.Array:
    """q [b, t, heads, d]; k, v [b, s, kv_heads, d]; mask [b, t, s] -> [b, t, heads, d]. The query heads of one kv
    head are stacked along the query axis, so each product is one batched matmul per (batch, kv head)."""
    b, t, heads, d = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    q = q.reshape(b, t, kv_heads, group, d).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, group * t, d)
    scores = scale_scores(jnp.einsum("bkqd,bskd->bkqs", q, k, preferred_element_type=jnp.float32), d, softcap)
    scores = jnp.where(mask[:, None, None, :, :], scores.reshape(b, kv_heads, group, t, s), MASKED_SCORE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, kv_heads, group * t, s)
    out = jnp.einsum("bkqs,bskd->bkqd", probs, v).reshape(b, kv_heads, group, t, d)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, heads, d)


def split_positions_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, softcap: float | None = None
) -> jax.Array:
    """The xla implementation where the program's layout splits the positions of a row over the `sequence` mesh
    axis: the keys and values are gathered whole over it (`constrain`), so each device's queries attend to every key
    in one pass, and the queries, scores and outputs stay split by position (the query heads of a kv head are their
    own dimension, never merged with the positions). Shapes as `dot_product_attention`."""
    b, t, heads, d = q.shape
    kv_heads = k.shape[2]
    whole = ("batch", None, "kv_heads", "head_dim")
    k, v = constrain(k, whole), constrain(v, whole)
    mask = constrain(mask, ("batch", "length", None))
    q = q.reshape(b, t, kv_heads, heads // kv_heads, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scale_scores(scores, d, softcap), MASKED_SCORE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, heads, d)


def cudnn_split_positions_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_valid: jax.Array,
    valid: jax.Array,
    window: int | None,
    *,
    axes: tuple[str, ...],
    implementation: str = "cudnn",
) -> jax.Array:
    """cuDNN flash attention of one device's share of the positions (inside a `shard_map` whose mesh axes `axes`
    split them): q [b, t / N, heads, d] and `q_valid` [b, t / N] (segment ids) this device's positions, k, v
    [b, t, kv_heads, d] and `valid` [b, t] every position. cuDNN's causal mask is aligned at position 0 and cannot
    take the queries' offset, so causality at the device's offset, the window and the segments are one boolean mask
    [b, 1, t / N, t] that jax hands cuDNN as a bias (in the compute dtype, beside its gradient in a backward): every
    key block is computed (the last shard, which sets the pace, needs nearly all of them anyway) and no float32
    score block is held. `implementation="xla"` runs the same arguments through jax's XLA attention (CPU tests)."""
    local = q.shape[1]
    queries = jax.lax.axis_index(axes) * local + jnp.arange(local, dtype=jnp.int32)
    keys = jnp.arange(k.shape[1], dtype=jnp.int32)
    allowed = keys[None, :] <= queries[:, None]
    if window is not None:
        allowed &= queries[:, None] - keys[None, :] < window
    # as `cudnn_attention`: a padding query sees padding keys, so that no row is empty
    allowed = allowed[None] & (q_valid[:, :, None] == valid[:, None, :])
    return jax.nn.dot_product_attention(q, k, v, mask=allowed[:, None], implementation=implementation)


def extend_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, starts: jax.Array, window: int | None = None, softcap: float | None = None
) -> jax.Array:
    """Queries q [b, t, heads, d] at positions `starts` [b] + 0..t-1 over caches k, v [b, s, kv_heads, d] that
    already hold them (an observation appended to a running sequence): each query sees the cache positions up to its
    own (within `window`), so the history before `starts` is read, never recomputed. Scores in float32."""
    query_index = starts[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
    key_index = jnp.arange(k.shape[1], dtype=jnp.int32)
    allowed = key_index[None, None, :] <= query_index[:, :, None]
    if window is not None:
        allowed &= query_index[:, :, None] - key_index[None, None, :] < window
    return _attend(q, k, v, allowed, softcap)


def dot_product_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, causal_blocks: int = 4, softcap: float | None = None
) -> jax.Array:
    """The xla implementation: grouped-query attention, scores in float32. q [b, t, heads, d]; k, v
    [b, s, kv_heads, d]; mask [b, t, s] (causal within it) -> [b, t, heads, d]; `softcap` as `scale_scores`.

    When queries and keys are the same positions (t == s, e.g. a forward pass), the queries are cut into
    `causal_blocks` blocks and block i attends only to the keys up to its end: (n+1)/(2n) of the 4*b*t*s*heads*d
    FLOPs of the full product, with identical results (the skipped keys are masked anyway)."""
    t, s = q.shape[1], k.shape[1]
    if t != s or t % causal_blocks or t // causal_blocks < 32:
        return _attend(q, k, v, mask, softcap)
    size = t // causal_blocks
    outs = [
        _attend(
            q[:, i * size : (i + 1) * size],
            k[:, : (i + 1) * size],
            v[:, : (i + 1) * size],
            mask[:, i * size : (i + 1) * size, : (i + 1) * size],
            softcap,
        )
        for i in range(causal_blocks)
    ]
    return jnp.concatenate(outs, axis=1)


def cudnn_supported(
    q_shape: Sequence[int], k_shape: Sequence[int], dtype: jnp.dtype, *, with_mask: bool, head_dim_limit: int = 128
) -> bool:
    """Whether cuDNN flash attention takes these shapes: q [b, t, heads, d], k [b, s, kv_heads, d] in bf16/fp16, d a
    multiple of 8 up to `head_dim_limit` (128; 256 from Hopper on), heads a multiple of kv_heads, and even t and s when
    a mask is passed (jax turns it into a bias, which cuDNN's backward needs even lengths for)."""
    _, t, heads, d = q_shape
    _, s, kv_heads, key_dim = k_shape
    shapes_ok = d == key_dim and d % 8 == 0 and d <= head_dim_limit and heads % kv_heads == 0
    lengths_ok = not with_mask or (t % 2 == 0 and s % 2 == 0)
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and shapes_ok and lengths_ok


def _cudnn_head_dim_limit(head_dim: int) -> int:
    """128, or 256 from Hopper on. jax checks Hopper on this process's default backend, not the program's devices: a
    program compiled here for a GPU target (`hfjax compile`) gets 128, and its wider heads run as xla (logged)."""
    capability = str(getattr(program_device(), "compute_capability", "0"))
    if tuple(int(part) for part in capability.split(".")) < (9, 0):
        return 128
    if "cuda" not in str(getattr(jax.local_devices()[0].client, "platform_version", "")):
        if head_dim > 128:
            fall_back("cudnn", "jax allows heads over 128 only when this process runs on a Hopper GPU itself")
        return 128
    return 256


def cudnn_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    valid: jax.Array | None = None,
    lengths: jax.Array | None = None,
    window: int | None = None,
    implementation: str = "cudnn",
) -> jax.Array:
    """Causal self-attention as `jax.nn.dot_product_attention` arguments (its `implementation`: `cudnn`, or `xla` to
    run the same arguments through jax's XLA version, as CPU tests do). `lengths` [b] (real keys first) become
    sequence lengths; `valid` [b, t] (0/1, or packed segment ids) becomes the mask valid[query] == valid[key], so
    that a padding query sees padding keys and no row is empty. Causality and the window are cuDNN's own masks (it
    skips what they hide)."""
    local = None if window is None else (window - 1, 0)
    if lengths is not None:
        lengths = lengths.astype(jnp.int32)
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            query_seq_lengths=lengths,
            key_value_seq_lengths=lengths,
            local_window_size=local,
            implementation=implementation,
        )
    assert valid is not None, "cudnn_attention needs valid or lengths"
    same = valid[:, None, :, None] == valid[:, None, None, :]
    return jax.nn.dot_product_attention(
        q, k, v, mask=same, is_causal=True, local_window_size=local, implementation=implementation
    )


def _split_positions_kernel(
    name: str, q: jax.Array, k: jax.Array, window: int | None, parts: int
) -> functools.partial | None:
    """The per-shard kernel of `name` for attention whose positions a sequence axis splits into `parts` (inside
    `hfjax.models.per_shard`), or None where it runs as xla (`split_positions_attention`): xla itself, and cuDNN
    at shapes or dtypes it does not take (as without the axis)."""
    axes = split_axes("length", q.shape[1])
    if name in PALLAS:
        from hfjax.models import attention_pallas  # Pallas loads only when it runs

        return functools.partial(
            attention_pallas.splash_split_positions_attention, window=window, parts=parts, axes=axes,
            interpret=name == "pallas_interpret",
        )  # fmt: skip
    if name != "cudnn":
        return None
    local = (q.shape[0], q.shape[1] // parts, *q.shape[2:])
    if not cudnn_supported(local, k.shape, q.dtype, with_mask=True, head_dim_limit=_cudnn_head_dim_limit(q.shape[-1])):
        return None
    return functools.partial(cudnn_split_positions_attention, window=window, axes=axes)


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    valid: jax.Array | None = None,
    lengths: jax.Array | None = None,
    mask: jax.Array | None = None,
    window: int | None = None,
    softcap: float | None = None,
    implementation: str | None = None,
    sees_ahead: bool = False,
) -> jax.Array:
    """Causal self-attention of a batch: q [b, t, heads, d]; k, v [b, t, kv_heads, d] -> [b, t, heads, d].

    The real keys are `valid` [b, t] (any 0/1 pattern, e.g. left padding; or the segment ids of packed sequences,
    `attention_mask`), or `lengths` [b] (the first lengths[b] of each row: right padding), or else the diagonal of
    `mask`, which must then be `attention_mask(valid, index, index, window)` [b, t, t]. The xla implementation uses
    `mask` when given (one mask can serve every layer of a window) and builds it otherwise; the others use the
    structured form (pass `valid` with `mask` for packed segments: a diagonal holds no segment ids). Under an
    `program_layout` of several devices a Pallas kernel, and cuDNN where a sequence axis splits the positions, runs
    per shard (xla where the operands do not split by the layout). Scores are soft-capped when `softcap` is set
    (`scale_scores`): only xla does that, so the others fall back to it (logged once). `sees_ahead`: `mask` lets
    some queries see later keys (Gemma 3's image blocks, `attention_mask(..., blocks)`), which only xla's whole
    mask holds, so it runs (logged once), over every key."""
    if valid is None and lengths is None and mask is None:
        raise ValueError("causal_attention needs valid, lengths or mask")
    if sees_ahead and mask is None:
        raise ValueError("causal_attention: sees_ahead needs the mask that says what each query sees")
    name = resolve_implementation(implementation)
    if softcap is not None and name != "xla":
        fall_back(name, "score soft-capping (Gemma 2's attn_logit_softcapping) is not in its kernels")
        name = "xla"
    if sees_ahead and name != "xla":
        fall_back(name, "queries that see later keys (Gemma 3's image blocks) need the whole mask")
        name = "xla"
    parts = length_parts(q.shape[1])
    if parts > 1:
        index = jnp.arange(q.shape[1], dtype=jnp.int32)
        if valid is None:
            valid = index[None, :] < lengths[:, None] if lengths is not None else jnp.diagonal(mask, axis1=1, axis2=2)
        kernel = _split_positions_kernel(name, q, k, window, parts)
        if kernel is not None:
            out = per_shard(kernel, (q, k, v, valid, valid), SPLIT_CAUSAL_AXES, current_layout())
            if out is not None:
                return out
        mask = mask if mask is not None else attention_mask(valid, index, index, window)
        return split_positions_attention(q, k, v, mask, softcap)
    if name == "cudnn":
        limit = _cudnn_head_dim_limit(q.shape[-1])
        if not cudnn_supported(q.shape, k.shape, q.dtype, with_mask=lengths is None, head_dim_limit=limit):
            name = "xla"
    if name == "xla" and mask is not None:
        return dot_product_attention(q, k, v, mask, causal_blocks=1 if sees_ahead else 4, softcap=softcap)
    if name == "cudnn" and lengths is not None:
        return cudnn_attention(q, k, v, lengths=lengths, window=window)
    index = jnp.arange(q.shape[1], dtype=jnp.int32)
    if valid is None:
        valid = index[None, :] < lengths[:, None] if lengths is not None else jnp.diagonal(mask, axis1=1, axis2=2)
    if name == "cudnn":
        return cudnn_attention(q, k, v, valid=valid, window=window)
    if name in PALLAS:
        from hfjax.models import attention_pallas  # Pallas loads only when it runs

        kernel = functools.partial(
            attention_pallas.splash_causal_attention, window=window, interpret=name == "pallas_interpret"
        )
        out = per_shard(kernel, (q, k, v, valid), CAUSAL_AXES, current_layout())
        if out is not None:
            return out
    mask = mask if mask is not None else attention_mask(valid, index, index, window)
    return dot_product_attention(q, k, v, mask, softcap=softcap)
