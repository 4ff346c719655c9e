"""Attention implementations against the XLA reference (itself against float64 numpy): the cuDNN argument translation
(run through jax's XLA attention), the Pallas kernels in interpret mode (forward, gradients, decode), selection by
argument, environment and backend, lowering of the Pallas kernels for TPU, and a tiny model's logits and greedy
generation under each implementation. Only rows with a key to see are compared; every output is checked for NaN."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_models import TINY, random_model

from hfjax.models import attention_pallas
from hfjax.models.attention import (
    attend_blocks,
    attention_mask,
    causal_attention,
    choose_implementation,
    cudnn_attention,
    cudnn_supported,
    decode_attention,
    decode_mask,
    dot_product_attention,
    resolve_implementation,
)
from hfjax.rollout import JaxEngine, OfflineGenerator, SamplingParams

BF16 = jnp.bfloat16
# Float32: both sides compute float32 scores and softmax and differ only in summation order (eps 1.2e-7, sums of a
# few dozen O(1) terms: differences of a few 1e-7), so 1e-5. Bfloat16 has an 8-bit significand: a value x is stored
# to within 2^-8 |x|, one unit in its last place is at most 2^-7 |x|. The implementations round at different points
# (the reference rounds normalised probabilities and each block's product to bf16, splash rounds the pre-scaled
# query, the decode kernel accumulates in float32), and each output or gradient is a sum of terms as large as the
# array's largest values, so results may differ by up to two units of their own (rtol 2^-6) plus one unit of the
# array's largest value (atol 2^-7 max|x|), which is what near-zero sums of large terms carry.
F32 = dict(atol=1e-5, rtol=1e-5)


def _tolerance(dtype, want: np.ndarray) -> dict:
    return F32 if dtype == jnp.float32 else dict(atol=2**-7 * float(np.abs(want).max()), rtol=2**-6)


# (heads, kv_heads, dtype, window): each GQA ratio 1, 2, 4 in both dtypes, with and without a sliding window.
CASES = [
    (4, 4, jnp.float32, None),
    (4, 2, jnp.float32, 5),
    (4, 1, jnp.float32, 3),
    (4, 4, BF16, 5),
    (4, 2, BF16, None),
    (4, 1, BF16, 3),
]
CASE_IDS = [f"h{h}kv{kv}-{jnp.dtype(dt).name}-w{w}" for h, kv, dt, w in CASES]


def _qkv(seed: int, b: int, t: int, heads: int, kv_heads: int, d: int, dtype) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    shapes = [(b, t, heads, d), (b, t, kv_heads, d), (b, t, kv_heads, d)]
    return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)


def _left_padded(t: int, lengths: list[int]) -> jax.Array:
    return jnp.asarray(np.arange(t)[None, :] >= t - np.asarray(lengths)[:, None])


def _numpy_attention(q, k, v, allowed: np.ndarray) -> np.ndarray:
    """Float64 attention, one (row, head, query) at a time over its allowed keys; NaN where none is allowed."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, heads, d = q.shape
    group = heads // k.shape[2]
    out = np.full(q.shape, np.nan)
    for row, query, head in np.ndindex(b, t, heads):
        seen = allowed[row, query]
        if seen.any():
            scores = k[row, seen, head // group] @ q[row, query, head] / np.sqrt(d)
            probs = np.exp(scores - scores.max())
            out[row, query, head] = probs @ v[row, seen, head // group] / probs.sum()
    return out


def _assert_close(got, want, real: np.ndarray, dtype) -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[real], want[real], **_tolerance(dtype, want[real]))


# ------------------------------------------------------------------------------------------------------- selection
def test_auto_picks_by_backend():
    assert choose_implementation("cpu", "cpu", 8) == "xla"
    assert choose_implementation("gpu", "PJRT C API\ncuda 12080", 8) == "cudnn"
    assert choose_implementation("gpu", "rocm 6.0", 1) == "xla"  # cuDNN is CUDA only
    assert choose_implementation("tpu", "", 1) == "pallas_tpu"
    assert choose_implementation("tpu", "", 4) == "xla"  # a Mosaic kernel is not partitioned over devices by XLA
    assert choose_implementation("metal", "", 1) == "xla"


def test_resolve_by_argument_then_environment(monkeypatch):
    monkeypatch.delenv("HFJAX_ATTENTION", raising=False)
    assert resolve_implementation() == "xla"  # auto on CPU
    monkeypatch.setenv("HFJAX_ATTENTION", "pallas_interpret")
    assert resolve_implementation() == "pallas_interpret"
    assert resolve_implementation("cudnn") == "cudnn"  # the argument wins
    assert resolve_implementation("auto") == "xla"
    monkeypatch.setenv("HFJAX_ATTENTION", "flash")
    with pytest.raises(ValueError, match=r"HFJAX_ATTENTION='flash'.*'auto', 'xla', 'cudnn', 'pallas_tpu'"):
        resolve_implementation()
    with pytest.raises(ValueError, match=r"implementation='XLA'.*pallas_interpret"):
        resolve_implementation("XLA")


def test_cudnn_supported():
    q, k = (2, 64, 8, 128), (2, 64, 2, 128)
    assert cudnn_supported(q, k, BF16, with_mask=True)
    assert cudnn_supported(q, k, jnp.float16, with_mask=True)
    assert not cudnn_supported(q, k, jnp.float32, with_mask=True)  # bf16/fp16 only
    assert not cudnn_supported((2, 64, 8, 12), (2, 64, 2, 12), BF16, with_mask=True)  # head dim not a multiple of 8
    assert not cudnn_supported((2, 64, 8, 256), (2, 64, 2, 256), BF16, with_mask=True)
    assert cudnn_supported((2, 64, 8, 256), (2, 64, 2, 256), BF16, with_mask=True, head_dim_limit=256)  # Hopper
    assert not cudnn_supported((2, 64, 6, 128), (2, 64, 4, 128), BF16, with_mask=True)  # heads not a multiple
    assert not cudnn_supported((2, 63, 8, 128), (2, 63, 2, 128), BF16, with_mask=True)  # a bias needs even lengths
    assert cudnn_supported((2, 63, 8, 128), (2, 63, 2, 128), BF16, with_mask=False)  # sequence lengths do not


# ----------------------------------------------------------------------------------------------- full attention
@pytest.mark.parametrize("t", [12, 128])  # 128: the reference's causal-blocks path
@pytest.mark.parametrize("window", [None, 5])
def test_xla_reference_matches_numpy(t, window):
    q, k, v = _qkv(0, 3, t, 4, 2, 8, jnp.float32)
    valid = _left_padded(t, [t, t - 4, 0])
    index = jnp.arange(t)
    mask = attention_mask(valid, index, index, window)
    got = dot_product_attention(q, k, v, mask)
    want = _numpy_attention(q, k, v, np.asarray(mask))
    real = np.asarray(valid)
    assert not real[2].any()  # a row of padding only: no NaN, no value to compare
    _assert_close(got, want, real, jnp.float32)


def _grads(fn, q, k, v, real: jax.Array):
    """The output and the gradients w.r.t. q, k, v of a random weighting of the output's real rows."""
    weights = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape), jnp.float32) * real[:, :, None, None]

    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * weights), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


@pytest.mark.parametrize("implementation", ["pallas_interpret", "cudnn_translation"])
@pytest.mark.parametrize(("heads", "kv_heads", "dtype", "window"), CASES, ids=CASE_IDS)
def test_causal_attention_matches_reference(implementation, heads, kv_heads, dtype, window):
    t = 12
    q, k, v = _qkv(1, 4, t, heads, kv_heads, 16, dtype)
    valid = _left_padded(t, [t, 9, 1, 0])  # left padding, and a row with nothing to see
    index = jnp.arange(t)
    mask = attention_mask(valid, index, index, window)
    if implementation == "cudnn_translation":  # the cuDNN arguments, run by jax's XLA attention
        fn = lambda q, k, v: cudnn_attention(q, k, v, valid=valid, window=window, implementation="xla")  # noqa: E731
    else:  # the valid keys read from the mask's diagonal, as DecoderLayer passes them
        fn = lambda q, k, v: causal_attention(q, k, v, mask=mask, window=window, implementation=implementation)  # noqa: E731
    out, grads = _grads(fn, q, k, v, valid)
    want, want_grads = _grads(lambda q, k, v: dot_product_attention(q, k, v, mask), q, k, v, valid)
    real = np.asarray(valid)
    _assert_close(out, want, real, dtype)
    everywhere = np.ones(real.shape, bool)  # padding rows of q and padding keys have zero gradient on both sides
    for got, expected in zip(grads, want_grads, strict=True):
        _assert_close(got, expected, everywhere, dtype)


@pytest.mark.parametrize("implementation", ["pallas_interpret", "cudnn_translation", "xla"])
@pytest.mark.parametrize("dtype", [jnp.float32, BF16])
def test_right_padded_lengths(implementation, dtype):
    """Prefill's form: real keys are the first `lengths` of each row (cuDNN gets them as sequence lengths)."""
    t, window = 10, 4
    q, k, v = _qkv(2, 3, t, 4, 2, 8, dtype)
    lengths = jnp.asarray([10, 6, 1], jnp.int32)
    valid = jnp.arange(t)[None, :] < lengths[:, None]
    mask = attention_mask(valid, jnp.arange(t), jnp.arange(t), window)
    if implementation == "cudnn_translation":
        fn = lambda q, k, v: cudnn_attention(q, k, v, lengths=lengths, window=window, implementation="xla")  # noqa: E731
    else:
        fn = lambda q, k, v: causal_attention(q, k, v, lengths=lengths, window=window, implementation=implementation)  # noqa: E731
    out, grads = _grads(fn, q, k, v, valid)
    want, want_grads = _grads(lambda q, k, v: dot_product_attention(q, k, v, mask), q, k, v, valid)
    real = np.asarray(valid)
    _assert_close(out, want, real, dtype)
    for got, expected in zip(grads, want_grads, strict=True):
        _assert_close(got, expected, np.ones(real.shape, bool), dtype)


def test_cudnn_falls_back_to_xla_where_unsupported():
    q, k, v = _qkv(3, 2, 8, 4, 2, 8, jnp.float32)  # float32: not for cuDNN
    valid = _left_padded(8, [8, 5])
    mask = attention_mask(valid, jnp.arange(8), jnp.arange(8), None)
    got = causal_attention(q, k, v, mask=mask, implementation="cudnn")
    assert np.array_equal(np.asarray(got), np.asarray(dot_product_attention(q, k, v, mask)))
    with pytest.raises(ValueError, match="needs valid, lengths or mask"):
        causal_attention(q, k, v, implementation="xla")


# ------------------------------------------------------------------------------------------------------- decode
def _cache(seed: int, slots: int, kv_heads: int, d: int, block: int, blocks: int, dtype):
    rng = np.random.default_rng(seed)
    keys = [jnp.asarray(rng.standard_normal((slots, kv_heads, d, block)), dtype) for _ in range(blocks)]
    values = [jnp.asarray(rng.standard_normal((slots, kv_heads, block, d)), dtype) for _ in range(blocks)]
    return keys, values


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dtype", "window"),
    [*CASES, (8, 1, jnp.float32, 6), (8, 1, BF16, None)],  # 8 query heads per kv head: the kernel's other layout
    ids=[*CASE_IDS, "h8kv1-float32-w6", "h8kv1-bfloat16-wNone"],
)
def test_decode_kernel_matches_attend_blocks(heads, kv_heads, dtype, window):
    block, blocks, d = 16, 3, 16
    keys, values = _cache(4, 6, kv_heads, d, block, blocks, dtype)
    q = jnp.asarray(np.random.default_rng(5).standard_normal((6, 1, heads, d)), dtype)
    lengths = jnp.asarray([0, 5, 16, 33, 47, 60], jnp.int32)  # block edges, the last position, past the blocks
    got = jax.jit(lambda q: decode_attention(q, keys, values, lengths, window, implementation="pallas_interpret"))(q)
    allowed = decode_mask(lengths, block * blocks, window)
    want = attend_blocks(q, keys, values, allowed)
    seen = np.asarray(allowed.any(axis=1))  # with a window, the slot past the blocks sees nothing
    assert seen[:5].all() and seen[5] == (window is None)
    _assert_close(got, want, np.broadcast_to(seen[:, None, None], got.shape[:3]), dtype)
    if window is None:  # and the xla implementation is the reference itself
        xla = decode_attention(q, keys, values, lengths, window, implementation="xla")
        assert np.array_equal(np.asarray(xla), np.asarray(want))


def test_pallas_kernels_lower_for_tpu():
    """Pallas -> Mosaic lowering for TPU from this machine (jax.export); the TPU compiler itself does not run here."""
    for heads in (4, 16):  # 4 and 8 query heads per kv head: both query layouts of the decode kernel
        q = jax.ShapeDtypeStruct((8, 1, heads, 128), BF16)
        keys = [jax.ShapeDtypeStruct((8, 2, 128, 128), BF16)] * 2
        values = [jax.ShapeDtypeStruct((8, 2, 128, 128), BF16)] * 2
        lengths = jax.ShapeDtypeStruct((8,), jnp.int32)

        def decode(q, keys, values, lengths):
            return attention_pallas.decode_attention(q, keys, values, lengths, 64, interpret=False)

        jax.export.export(jax.jit(decode), platforms=["tpu"])(q, keys, values, lengths)

    def loss(q, k, v, valid):
        out = attention_pallas.splash_causal_attention(q, k, v, valid, 100, interpret=False)
        return out.astype(jnp.float32).sum()

    q, kv = jax.ShapeDtypeStruct((2, 200, 8, 128), BF16), jax.ShapeDtypeStruct((2, 200, 2, 128), BF16)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.export.export(grad, platforms=["tpu"])(q, kv, kv, jax.ShapeDtypeStruct((2, 200), jnp.bool_))


# ------------------------------------------------------------------------------------------------- whole model
TWO_LAYERS = dataclasses.replace(TINY, num_layers=2, sliding_windows=(None, 3))


def _count_kernel_calls(monkeypatch) -> dict[str, int]:
    calls = {"splash_causal_attention": 0, "decode_attention": 0}
    for name in calls:
        original = getattr(attention_pallas, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(attention_pallas, name, counted)
    return calls


def test_model_logits_under_each_implementation(monkeypatch):
    model = random_model(TWO_LAYERS, seed=1)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(6)
    mask = np.asarray(_left_padded(10, [10, 7, 2]), np.int32)
    ids = np.where(mask, rng.integers(1, TINY.vocab_size, mask.shape), 0).astype(np.int32)
    calls = _count_kernel_calls(monkeypatch)
    logits = {}
    for name in ("xla", "pallas_interpret", "cudnn"):
        monkeypatch.setenv("HFJAX_ATTENTION", name)
        forward = jax.jit(lambda state, ids, mask: nnx.merge(graphdef, state)(ids, mask))  # traced under `name`
        logits[name] = np.asarray(forward(state, ids, mask))
        assert np.isfinite(logits[name]).all()
    assert calls["splash_causal_attention"] == TWO_LAYERS.num_layers  # the pallas forward ran the kernel per layer
    real = mask.astype(bool)
    np.testing.assert_allclose(logits["pallas_interpret"][real], logits["xla"][real], **F32)
    assert np.array_equal(logits["cudnn"], logits["xla"])  # a float32 model is not for cuDNN: xla, bit for bit


def test_greedy_generation_under_pallas_equals_xla(monkeypatch):
    model = random_model(TWO_LAYERS, seed=2)
    _, params, _ = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, TINY.vocab_size, n).tolist() for n in (5, 11, 3, 16, 9)]
    sampling = SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=())
    calls = _count_kernel_calls(monkeypatch)
    tokens = {}
    for name in ("xla", "pallas_interpret"):
        monkeypatch.setenv("HFJAX_ATTENTION", name)
        engine = JaxEngine(model, max_concurrent_decodes=4, max_prefill_length=16, max_new_tokens=10)
        outs = OfflineGenerator(engine, params, progress=False).generate(prompts, sampling)
        tokens[name] = [o.tokens.tolist() for o in outs]
        assert all(np.isfinite(o.logprobs).all() for o in outs)
    assert calls["splash_causal_attention"] > 0 and calls["decode_attention"] > 0
    assert all(len(t) == 10 for t in tokens["xla"])
    assert tokens["pallas_interpret"] == tokens["xla"]
