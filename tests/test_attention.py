"""Attention implementations against the XLA reference (itself against float64 numpy): the cuDNN argument translation
(run through jax's XLA attention), the Pallas kernels in interpret mode (forward, gradients, decode), selection by
argument, environment and backend, and lowering of the Pallas kernels for TPU. Only rows with a key to see are
compared; every output is checked for NaN."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.attention_cases import (
    BF16,
    CASE_IDS,
    CASES,
    assert_close,
    cache_blocks,
    left_padded,
    numpy_attention,
    output_and_grads,
    qkv_inputs,
)

from hfjax.models import attention, attention_pallas
from hfjax.models.attention import (
    attention_mask,
    causal_attention,
    choose_implementation,
    cudnn_attention,
    cudnn_supported,
    dot_product_attention,
    resolve_implementation,
)
from hfjax.models.decode_attention import attend_blocks, decode_attention, decode_mask


# ------------------------------------------------------------------------------------------------------- selection
def test_auto_picks_by_backend():
    assert choose_implementation("cpu", "cpu", 8) == "xla"
    assert choose_implementation("gpu", "PJRT C API\ncuda 12080", 8) == "cudnn"
    assert choose_implementation("gpu", "rocm 6.0", 1) == "xla"  # cuDNN is CUDA only
    assert choose_implementation("tpu", "", 1) == "pallas_tpu"
    assert choose_implementation("tpu", "", 4) == "xla"  # a Mosaic kernel is not partitioned over devices by XLA
    assert choose_implementation("metal", "", 1) == "xla"
    assert choose_implementation("tpu", "", 8, in_layout=True) == "pallas_tpu"  # run per shard in a shard_map
    assert choose_implementation("cpu", "", 8, in_layout=True) == "xla"


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
    q, k, v = qkv_inputs(0, 3, t, 4, 2, 8, jnp.float32)
    valid = left_padded(t, [t, t - 4, 0])
    index = jnp.arange(t)
    mask = attention_mask(valid, index, index, window)
    got = dot_product_attention(q, k, v, mask)
    want = numpy_attention(q, k, v, np.asarray(mask))
    real = np.asarray(valid)
    assert not real[2].any()  # a row of padding only: no NaN, no value to compare
    assert_close(got, want, real, jnp.float32)


@pytest.mark.parametrize("implementation", ["pallas_interpret", "cudnn_translation"])
@pytest.mark.parametrize(("heads", "kv_heads", "dtype", "window"), CASES, ids=CASE_IDS)
def test_causal_attention_matches_reference(implementation, heads, kv_heads, dtype, window):
    t = 12
    q, k, v = qkv_inputs(1, 4, t, heads, kv_heads, 16, dtype)
    valid = left_padded(t, [t, 9, 1, 0])  # left padding, and a row with nothing to see
    index = jnp.arange(t)
    mask = attention_mask(valid, index, index, window)
    if implementation == "cudnn_translation":  # the cuDNN arguments, run by jax's XLA attention
        fn = lambda q, k, v: cudnn_attention(q, k, v, valid=valid, window=window, implementation="xla")  # noqa: E731
    else:  # the valid keys read from the mask's diagonal, as DecoderLayer passes them
        fn = lambda q, k, v: causal_attention(q, k, v, mask=mask, window=window, implementation=implementation)  # noqa: E731
    out, grads = output_and_grads(fn, q, k, v, valid)
    want, want_grads = output_and_grads(lambda q, k, v: dot_product_attention(q, k, v, mask), q, k, v, valid)
    real = np.asarray(valid)
    assert_close(out, want, real, dtype)
    everywhere = np.ones(real.shape, bool)  # padding rows of q and padding keys have zero gradient on both sides
    for got, expected in zip(grads, want_grads, strict=True):
        assert_close(got, expected, everywhere, dtype)


@pytest.mark.parametrize("implementation", ["pallas_interpret", "cudnn_translation", "xla"])
@pytest.mark.parametrize("dtype", [jnp.float32, BF16])
def test_right_padded_lengths(implementation, dtype):
    """Prefill's form: real keys are the first `lengths` of each row (cuDNN gets them as sequence lengths)."""
    t, window = 10, 4
    q, k, v = qkv_inputs(2, 3, t, 4, 2, 8, dtype)
    lengths = jnp.asarray([10, 6, 1], jnp.int32)
    valid = jnp.arange(t)[None, :] < lengths[:, None]
    mask = attention_mask(valid, jnp.arange(t), jnp.arange(t), window)
    if implementation == "cudnn_translation":
        fn = lambda q, k, v: cudnn_attention(q, k, v, lengths=lengths, window=window, implementation="xla")  # noqa: E731
    else:
        fn = lambda q, k, v: causal_attention(q, k, v, lengths=lengths, window=window, implementation=implementation)  # noqa: E731
    out, grads = output_and_grads(fn, q, k, v, valid)
    want, want_grads = output_and_grads(lambda q, k, v: dot_product_attention(q, k, v, mask), q, k, v, valid)
    real = np.asarray(valid)
    assert_close(out, want, real, dtype)
    for got, expected in zip(grads, want_grads, strict=True):
        assert_close(got, expected, np.ones(real.shape, bool), dtype)


def _packed_segments() -> np.ndarray:
    """Two rows of 12 positions: sequences of 5, 4 and 2 tokens then one of padding; one of 12 tokens."""
    return np.asarray([[1] * 5 + [2] * 4 + [3] * 2 + [0], [1] * 12], np.int32)


def _separate_sequences(segments: np.ndarray, window: int | None) -> np.ndarray:
    """What each query sees when every segment is its own sequence: its earlier keys of the same segment (within the
    window), padding nothing; [b, t, t], built one (row, query) at a time."""
    b, t = segments.shape
    allowed = np.zeros((b, t, t), bool)
    for row, query in np.ndindex(b, t):
        for key in range(query + 1):
            near = window is None or query - key < window
            allowed[row, query, key] = near and segments[row, key] == segments[row, query] != 0
    return allowed


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret", "cudnn_translation"])
@pytest.mark.parametrize(("dtype", "window"), [(jnp.float32, None), (jnp.float32, 3), (BF16, None)])
def test_packed_segments_attend_only_within_their_sequence(implementation, dtype, window):
    """Several sequences packed in a row (segment ids 1, 2, ...; 0 padding): every implementation gives each real
    token what it would see in its own sequence (float64 reference), gradients included."""
    segments = _packed_segments()
    q, k, v = qkv_inputs(4, 2, 12, 4, 2, 8, dtype)
    index = jnp.arange(12)
    mask = attention_mask(jnp.asarray(segments), index, index, window)
    allowed = _separate_sequences(segments, window)
    np.testing.assert_array_equal(np.asarray(mask), allowed)
    if implementation == "cudnn_translation":
        fn = lambda q, k, v: cudnn_attention(q, k, v, valid=segments, window=window, implementation="xla")  # noqa: E731
    else:  # as DecoderLayer passes them: the segments beside the mask (its diagonal has no segment ids)
        fn = lambda q, k, v: causal_attention(  # noqa: E731
            q, k, v, valid=jnp.asarray(segments), mask=mask, window=window, implementation=implementation
        )
    real = segments > 0
    out, grads = output_and_grads(fn, q, k, v, jnp.asarray(real))
    assert_close(out, numpy_attention(q, k, v, allowed), real, dtype)
    _, want_grads = output_and_grads(lambda q, k, v: dot_product_attention(q, k, v, mask), q, k, v, jnp.asarray(real))
    for got, expected in zip(grads, want_grads, strict=True):
        assert_close(got, expected, np.ones(real.shape, bool), dtype)


def test_cudnn_falls_back_to_xla_where_unsupported():
    q, k, v = qkv_inputs(3, 2, 8, 4, 2, 8, jnp.float32)  # float32: not for cuDNN
    valid = left_padded(8, [8, 5])
    mask = attention_mask(valid, jnp.arange(8), jnp.arange(8), None)
    got = causal_attention(q, k, v, mask=mask, implementation="cudnn")
    assert np.array_equal(np.asarray(got), np.asarray(dot_product_attention(q, k, v, mask)))
    with pytest.raises(ValueError, match="needs valid, lengths or mask"):
        causal_attention(q, k, v, implementation="xla")


@pytest.mark.parametrize("t", [12, 128])  # 128: the causal-blocks path
def test_soft_capped_scores_match_numpy_and_every_implementation_falls_back_to_them(t, caplog):
    """Gemma 2's score soft cap: the xla attention against float64 numpy; the kernels have no cap, so asking for
    them with one runs xla (the same values, and a logged reason), in full attention and in decode."""
    softcap = 0.5  # scores of these inputs reach ~2: the cap changes them
    attention.fall_back.cache_clear()  # each reason is logged once per process
    q, k, v = qkv_inputs(0, 3, t, 4, 2, 8, jnp.float32)
    valid = left_padded(t, [t, t - 4, 3])
    index = jnp.arange(t)
    mask = attention_mask(valid, index, index, 5)
    want = dot_product_attention(q, k, v, mask, softcap=softcap)
    real = np.asarray(valid)
    assert_close(want, numpy_attention(q, k, v, np.asarray(mask), softcap), real, jnp.float32)
    uncapped = numpy_attention(q, k, v, np.asarray(mask))
    assert np.abs(np.asarray(want)[real] - uncapped[real]).max() > 1e-2
    for name in ("pallas_interpret", "cudnn"):
        got = causal_attention(q, k, v, mask=mask, valid=valid, window=5, softcap=softcap, implementation=name)
        assert np.array_equal(np.asarray(got), np.asarray(want)), name
    assert "soft-capping" in caplog.text
    keys, values = cache_blocks(4, 3, 2, 8, 16, 2, jnp.float32)
    lengths = jnp.asarray([3, 17, 30], jnp.int32)
    q1 = q[:, :1]
    got = decode_attention(q1, keys, values, lengths, 5, softcap=softcap, implementation="pallas_interpret")
    allowed = decode_mask(lengths, 32, 5)
    assert np.array_equal(np.asarray(got), np.asarray(attend_blocks(q1, keys, values, allowed, softcap)))


# ------------------------------------------------------------------------------------------------------- decode


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dtype", "window"),
    [*CASES, (8, 1, jnp.float32, 6), (8, 1, BF16, None)],  # 8 query heads per kv head: the kernel's other layout
    ids=[*CASE_IDS, "h8kv1-float32-w6", "h8kv1-bfloat16-wNone"],
)
def test_decode_kernel_matches_attend_blocks(heads, kv_heads, dtype, window):
    block, blocks, d = 16, 3, 16
    keys, values = cache_blocks(4, 6, kv_heads, d, block, blocks, dtype)
    q = jnp.asarray(np.random.default_rng(5).standard_normal((6, 1, heads, d)), dtype)
    lengths = jnp.asarray([0, 5, 16, 33, 47, 60], jnp.int32)  # block edges, the last position, past the blocks
    got = jax.jit(lambda q: decode_attention(q, keys, values, lengths, window, implementation="pallas_interpret"))(q)
    allowed = decode_mask(lengths, block * blocks, window)
    want = attend_blocks(q, keys, values, allowed)
    seen = np.asarray(allowed.any(axis=1))  # with a window, the slot past the blocks sees nothing
    assert seen[:5].all() and seen[5] == (window is None)
    assert_close(got, want, np.broadcast_to(seen[:, None, None], got.shape[:3]), dtype)
    if window is None:  # and the xla implementation is the reference itself
        xla = decode_attention(q, keys, values, lengths, window, implementation="xla")
        assert np.array_equal(np.asarray(xla), np.asarray(want))


@pytest.mark.parametrize("most_positions", [16, 8, 4])
def test_decode_kernel_streams_blocks_in_sub_blocks(most_positions):
    """The decode kernel's grid through each block a sub-block at a time (here 1, 2 and 4 steps per block of 16,
    with shared-prompt blocks first and a window) gives the whole-block reference's output."""
    block, blocks, d, prompt_blocks = 16, 4, 16, 2
    keys, values = cache_blocks(4, 6, 2, d, block, blocks, jnp.float32)
    q = jnp.asarray(np.random.default_rng(7).standard_normal((6, 1, 8, d)), jnp.float32)
    prompt_lengths = jnp.asarray([1, 16, 20, 32, 7, 32], jnp.int32)
    lengths = prompt_lengths + jnp.asarray([0, 3, 16, 31, 9, 0], jnp.int32)
    for window in (None, 10):
        got = attention_pallas.decode_attention(
            q, keys, values, lengths, window, prompt_lengths, prompt_blocks=prompt_blocks, interpret=True,
            most_positions=most_positions,
        )  # fmt: skip
        allowed = decode_mask(
            lengths, block * (blocks - prompt_blocks), window,
            prompt_lengths=prompt_lengths, prompt_positions=block * prompt_blocks,
        )  # fmt: skip
        want = attend_blocks(q, keys, values, allowed)
        assert_close(got, want, np.ones(got.shape[:3], bool), jnp.float32)
    assert attention_pallas.sub_block(16, most_positions) == most_positions
    assert attention_pallas.sub_block(2176, 512) == 128 and attention_pallas.sub_block(2048, 512) == 512


@pytest.mark.parametrize("parts", [1, 2])
def test_decode_kernel_reads_the_prompt_pool_in_place(parts):
    """Prompt blocks given as a shared pool and each slot's table (slots of one prompt share blocks; with 2 parts
    each half of the slots reads its own part of the pool): the kernel's output equals xla over the gathered blocks."""
    block, d, pool_blocks, slots = 16, 16, 5, 6
    rng = np.random.default_rng(11)
    pool_keys = jnp.asarray(rng.standard_normal((parts, pool_blocks, 2, d, block)), jnp.float32)
    pool_values = jnp.asarray(rng.standard_normal((parts, pool_blocks, 2, block, d)), jnp.float32)
    table = jnp.asarray(rng.integers(0, pool_blocks, (slots, 2)), jnp.int32)
    keys, values = cache_blocks(4, slots, 2, d, block, 2, jnp.float32)
    q = jnp.asarray(rng.standard_normal((slots, 1, 8, d)), jnp.float32)
    prompt_lengths = jnp.asarray([1, 16, 20, 32, 7, 30], jnp.int32)
    lengths = prompt_lengths + jnp.asarray([0, 3, 16, 31, 9, 1], jnp.int32)
    pool = (pool_keys, pool_values, table)
    got = decode_attention(
        q, keys, values, lengths, 12, prompt_lengths=prompt_lengths, prompt_pool=pool, implementation="pallas_interpret"
    )
    want = decode_attention(q, keys, values, lengths, 12, prompt_lengths=prompt_lengths, prompt_pool=pool)
    assert_close(got, want, np.ones(got.shape[:3], bool), jnp.float32)


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
