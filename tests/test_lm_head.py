"""`token_logprobs`: the chunked LM-head log probs and entropies equal the full [rows, length, vocab] computation in
value and gradient (float32 and bfloat16 compute), and the compiled loss-and-gradient at real shapes keeps its
temporaries to a few chunks of logits plus the kernel gradient."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hfjax.algos import entropy_from_logits, logprobs_from_logits
from hfjax.models.lm_head import token_logprobs
from hfjax.models.transformer import mask_vocab_padding

ROWS, LENGTH, EMBED, VOCAB, PADDED = 3, 37, 24, 50, 64
TEMPERATURE = 0.7
MiB = 2**20


def _relative_error(a: jax.Array, b: jax.Array) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _inputs(dtype: jnp.dtype, kernel_dtype: jnp.dtype) -> tuple[jax.Array, ...]:
    """Random hidden states, a kernel with zero padding rows, labels and loss weights (numpy: no eager compiles)."""
    rng = np.random.default_rng(7)
    # logits / temperature of std ~2 (entropies ~2.4 nats): peakier ones leave the float32 reference itself only ~1e-6
    # accurate in the entropy (lse - sum softmax(z) z cancels)
    hidden = jnp.asarray(0.3 * rng.standard_normal((ROWS, LENGTH, EMBED), np.float32), dtype)
    kernel = rng.standard_normal((PADDED, EMBED), np.float32)
    kernel[VOCAB:] = 0
    labels = jnp.asarray(rng.integers(0, VOCAB, (ROWS, LENGTH), np.int32))
    weights = jnp.asarray(rng.standard_normal((2, ROWS, LENGTH), np.float32))
    return hidden, jnp.asarray(kernel, kernel_dtype), labels, weights


def _full(softcap: float | None) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """The reference: full float32 logits from the compute-dtype operands, soft-capped (cap * tanh(z / cap)) when
    `softcap` is set, divided by the temperature, masked, then the `hfjax.algos` losses."""

    def fn(hidden: jax.Array, kernel: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = jnp.einsum("rte,ve->rtv", hidden, kernel.astype(hidden.dtype), preferred_element_type=jnp.float32)
        if softcap is not None:
            logits = softcap * jnp.tanh(logits / softcap)
        scaled = mask_vocab_padding(logits / TEMPERATURE, VOCAB)
        return logprobs_from_logits(scaled, labels), entropy_from_logits(scaled)

    return fn


def _loss(fn: Callable[..., tuple[jax.Array, jax.Array | None]], entropy: bool) -> Callable[..., Any]:
    def loss(hidden: jax.Array, kernel: jax.Array, labels: jax.Array, weights: jax.Array) -> tuple[jax.Array, tuple]:
        logp, ent = fn(hidden, kernel, labels)
        total = jnp.sum(weights[0] * logp) + (jnp.sum(weights[1] * ent) if entropy else 0.0)
        return total, (logp, ent)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _chunked(
    chunk: int, entropy: bool, softcap: float | None, budget: int | None = None
) -> Callable[..., tuple[jax.Array, jax.Array | None]]:
    def fn(hidden: jax.Array, kernel: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        return token_logprobs(
            hidden,
            kernel,
            labels,
            vocab_size=VOCAB,
            temperature=TEMPERATURE,
            softcap=softcap,
            chunk=chunk,
            with_entropy=entropy,
            logits_budget_bytes=budget,
        )

    return fn


def _compare(
    dtype: jnp.dtype,
    kernel_dtype: jnp.dtype,
    chunk: int,
    entropy: bool,
    softcap: float | None = None,
    budget: int | None = None,
) -> dict[str, float]:
    hidden, kernel, labels, weights = _inputs(dtype, kernel_dtype)
    chunked = _chunked(chunk, entropy, softcap, budget)
    (_, (logp, ent)), grads = _loss(chunked, entropy)(hidden, kernel, labels, weights)
    (_, (ref_logp, ref_ent)), ref_grads = _loss(_full(softcap), entropy)(hidden, kernel, labels, weights)
    assert logp.shape == (ROWS, LENGTH) and logp.dtype == jnp.float32
    assert grads[0].dtype == hidden.dtype and grads[1].dtype == kernel.dtype
    assert (ent is None) != entropy
    assert np.all(np.asarray(ref_grads[1][VOCAB:]) == 0) and np.all(np.asarray(grads[1][VOCAB:]) == 0)
    errors = {
        "logp": _relative_error(logp, ref_logp),
        "d_hidden": _relative_error(grads[0], ref_grads[0]),
        "d_kernel": _relative_error(grads[1][:VOCAB], ref_grads[1][:VOCAB]),
    }
    if entropy:
        errors["entropy"] = _relative_error(ent, ref_ent)
    return errors


@pytest.mark.parametrize("chunk", [8, 64])  # 37 positions: 5 chunks (the last padded), or one chunk of them all
@pytest.mark.parametrize("entropy", [True, False])
def test_float32_equals_full_computation(chunk: int, entropy: bool) -> None:
    errors = _compare(jnp.float32, jnp.float32, chunk, entropy)
    assert max(errors.values()) <= 1e-6, errors


def test_soft_capped_logits_equal_full_computation() -> None:
    """Gemma 2's final-logit soft cap inside the chunks, forward and hand-written backward; the cap (3 against
    logits of std ~1.4 before the temperature) changes the result, so a dropped cap would show."""
    errors = _compare(jnp.float32, jnp.float32, 8, True, softcap=3.0)
    assert max(errors.values()) <= 1e-6, errors
    hidden, kernel, labels, _ = _inputs(jnp.float32, jnp.float32)
    capped, uncapped = _full(3.0)(hidden, kernel, labels)[0], _full(None)(hidden, kernel, labels)[0]
    assert _relative_error(capped, uncapped) > 1e-2


def test_bfloat16_compute_equals_full_computation() -> None:
    # Same bf16 operands and float32 accumulation: the values differ only in summation order (float32 rounding).
    # The backward rounds d(logits) to bf16 before its matmuls where the reference keeps float32 until the result
    # (rounded to bf16 in both): one extra bf16 rounding (relative 2^-9 per element, averaging out in the sums),
    # so the gradients agree to within two bf16 roundings, 2^-8 in norm.
    errors = _compare(jnp.bfloat16, jnp.float32, 8, True)  # float32 master kernel, bf16 compute
    assert max(errors["logp"], errors["entropy"]) <= 1e-5, errors
    assert max(errors["d_hidden"], errors["d_kernel"]) <= 2**-8, errors


WHOLE_LOGITS = 4 * ROWS * LENGTH * PADDED  # one device's float32 logits of the test's inputs, in bytes


def _lm_head_matmuls(budget: int | None, entropy: bool) -> int:
    """The matmuls of the loss-and-gradient's jaxpr that make logits (a [.., vocab] output), scan bodies included."""
    hidden, kernel, labels, weights = _inputs(jnp.float32, jnp.float32)
    jaxpr = jax.make_jaxpr(_loss(_chunked(8, entropy, None, budget), entropy))(hidden, kernel, labels, weights)

    def count(jaxpr: jax.extend.core.Jaxpr) -> int:
        found = sum(
            1 for e in jaxpr.eqns if e.primitive.name == "dot_general" and e.outvars[0].aval.shape[-1] == PADDED
        )
        return found + sum(count(getattr(sub, "jaxpr", sub)) for sub in jax.extend.core.subjaxprs(jaxpr))

    return count(jaxpr.jaxpr)


@pytest.mark.parametrize("entropy", [True, False])
def test_logits_that_fit_the_budget_are_kept_not_recomputed(entropy: bool) -> None:
    """Whole logits within the budget: one chunk, made once in the forward and kept, so the backward has no LM-head
    matmul of its own; the values and gradients equal the full computation like the chunked path's. One byte under
    the logits' size, the chunked path (and its recomputation) comes back."""
    errors = _compare(jnp.float32, jnp.float32, 8, entropy, budget=WHOLE_LOGITS)
    assert max(errors.values()) <= 1e-6, errors
    assert _lm_head_matmuls(WHOLE_LOGITS, entropy) == 1
    assert _lm_head_matmuls(WHOLE_LOGITS - 1, entropy) == 2 == _lm_head_matmuls(None, entropy)


def _primitive_counts(jaxpr: jax.extend.core.Jaxpr) -> dict[str, int]:
    """How often each primitive occurs in `jaxpr`, sub-jaxprs (scan bodies) included."""
    counts: dict[str, int] = {}
    for e in jaxpr.eqns:
        counts[e.primitive.name] = counts.get(e.primitive.name, 0) + 1
    for sub in jax.extend.core.subjaxprs(jaxpr):
        for name, n in _primitive_counts(getattr(sub, "jaxpr", sub)).items():
            counts[name] = counts.get(name, 0) + n
    return counts


@pytest.mark.parametrize("chunk", [8, 64])
def test_metric_only_entropy_adds_no_backward_work(chunk: int) -> None:
    """An entropy under `stop_gradient` (the update's metric when `entropy_coeff` is 0) has a zero cotangent: the
    backward is the log-prob-only one (no entropy term over every chunk's [rows, chunk, vocab]), so the gradient
    is bitwise that of `with_entropy=False` and the gradient program differs from it only by the forward's
    entropy reduction."""
    hidden, kernel, labels, weights = _inputs(jnp.float32, jnp.float32)

    def loss(entropy: bool) -> Callable[..., jax.Array]:
        def fn(hidden: jax.Array, kernel: jax.Array) -> jax.Array:
            logp, ent = _chunked(chunk, entropy, None)(hidden, kernel, labels)
            metric = jnp.sum(jax.lax.stop_gradient(ent)) if entropy else 0.0
            return jnp.sum(weights[0] * logp) + 0.0 * metric

        return jax.grad(fn, argnums=(0, 1))

    with_metric, without = jax.jit(loss(True))(hidden, kernel), jax.jit(loss(False))(hidden, kernel)
    for a, b in zip(with_metric, without, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    counts = [_primitive_counts(jax.make_jaxpr(loss(e))(hidden, kernel).jaxpr) for e in (True, False)]
    # the forward's entropy: one product exps * shifted, one division and one subtraction more; nothing else
    extra = {k: counts[0].get(k, 0) - counts[1].get(k, 0) for k in counts[0].keys() | counts[1].keys()}
    extra = {k: n for k, n in extra.items() if n}
    assert extra.get("mul", 0) <= 2 and "exp" not in extra and "dot_general" not in extra, extra


def test_chunk_must_be_positive() -> None:
    hidden, kernel, labels, _ = _inputs(jnp.float32, jnp.float32)
    with pytest.raises(ValueError, match="chunk"):
        token_logprobs(hidden, kernel, labels, vocab_size=VOCAB, chunk=0)


def test_loss_and_gradient_temporaries_at_real_shapes() -> None:
    """8 x 1024 tokens, embed 896, Qwen2's 151,936 vocabulary, bf16: compiled (never run) on one CPU device."""
    rows, length, embed, vocab, chunk = 8, 1024, 896, 151_936, 128

    def loss(hidden: jax.Array, kernel: jax.Array, labels: jax.Array, weights: jax.Array) -> jax.Array:
        logp, ent = token_logprobs(
            hidden, kernel, labels, vocab_size=151_665, temperature=TEMPERATURE, chunk=chunk, with_entropy=True
        )
        return jnp.sum(weights[0] * logp) + jnp.sum(weights[1] * ent)

    args = (
        jax.ShapeDtypeStruct((rows, length, embed), jnp.bfloat16),
        jax.ShapeDtypeStruct((vocab, embed), jnp.bfloat16),
        jax.ShapeDtypeStruct((rows, length), jnp.int32),
        jax.ShapeDtypeStruct((2, rows, length), jnp.float32),
    )
    start = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
    seconds = time.perf_counter() - start
    temp = compiled.memory_analysis().temp_size_in_bytes
    tokens = rows * chunk
    # The module docstring's forward 4 T V and backward (4 + 2) T V + 4 V E, as XLA:CPU compiles them: it stores a
    # chunk's float32 logits twice (the matmul's output, then scaled and masked) and the bf16 d(logits) twice
    # (transposed for the kernel-gradient matmul), and the bf16 kernel once more (transposed): at most
    # 8 T V + 4 V E + 2 V E, plus the [rows, length] statistics and [rows, length, embed] gradients (under 64 MiB).
    bound = 8 * tokens * vocab + 6 * vocab * embed + 64 * MiB
    full_logits = 4 * rows * length * vocab  # one float32 [rows, length, vocab] tensor: 4.6 GiB
    print(f"chunk {chunk}: temporaries {temp / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB), compiled in {seconds:.1f} s")
    assert temp <= bound, (temp / MiB, bound / MiB)
    assert temp <= full_logits / 2, (temp / MiB, full_logits / MiB)
