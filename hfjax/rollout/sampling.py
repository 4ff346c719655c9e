"""Sampling settings and the jittable token sampler (temperature, top-k, top-p; greedy at temperature 0).

Logprob convention (the quantity the trainer recomputes): `log_softmax(logits / temperature)` at the chosen token,
over the whole vocabulary, before any top-k / top-p filtering; at temperature 0 (greedy) the temperature counts as 1.
The model's vocabulary padding columns arrive as `MASKED_SCORE` (finite, -1e30): probability 0 after any positive
temperature, so they change no log prob, are never the greedy maximum, and are never drawn, even when top-k is
wider than the vocabulary.
The behaviour log prob is therefore that of the unfiltered policy, as in verl: with top-k / top-p on, the token
was drawn from the filtered distribution, so importance ratios built on it (TIS / MIS) are biased by the filter
(each kept token's drawn probability is its unfiltered one divided by the kept mass; the ratio treats it as the
unfiltered one).
Filters: `token_filters` (the tie rule; bisection on CPU, `lax.top_k` candidates on accelerators, same tokens).
Randomness: each sample has its own key, folded with the index of the token in the response, so a sample's tokens
do not depend on which slot or batch it ran in.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from hfjax.rollout.token_filters import FilterMethod, filter_logits


class SamplingError(ValueError):
    """A sampling setting outside its valid range."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample responses. `top_k=0` and `top_p=1.0` switch those filters off; `stop_token_ids=None` means the
    model's end-of-sequence ids; a stop token ends its sample and is kept as its last token."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] | None = None
    n: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        checks = (
            ("max_new_tokens", isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, "an integer >= 1"),
            ("temperature", self.temperature >= 0, "a number >= 0 (0 = greedy)"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0 (0 = off)"),
            ("top_p", 0.0 < self.top_p <= 1.0, "a number in (0, 1]"),
            ("n", isinstance(self.n, int) and self.n >= 1, "an integer >= 1"),
            ("seed", isinstance(self.seed, int), "an integer"),
        )
        for name, ok, expected in checks:
            if not ok:
                raise SamplingError(f"sampling.{name}: expected {expected}, got {getattr(self, name)!r}")
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def stops(self, default: Sequence[int]) -> frozenset[int]:
        """The stop ids in effect: the explicit ones, else `default` (the model's eos ids)."""
        return frozenset(default if self.stop_token_ids is None else self.stop_token_ids)


@dataclasses.dataclass(frozen=True)
class SamplerKind:
    """The static part of sampling (which filters exist in the compiled step, and whether any row samples at all:
    an all-greedy step draws no random noise); values stay per slot."""

    top_k: bool
    top_p: bool
    sampled: bool = True

    @classmethod
    def of(cls, params: SamplingParams) -> SamplerKind:
        sampled = not params.greedy
        return cls(top_k=params.top_k > 0 and sampled, top_p=params.top_p < 1.0 and sampled, sampled=sampled)


def sample_key(seed: jax.Array, request: jax.Array, sample: jax.Array) -> jax.Array:
    """Raw key data [..., 2] uint32 of one sample: the seed's key folded with the request and sample index."""

    def one(s: jax.Array, r: jax.Array, i: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(s), r), i)
        return jax.random.key_data(key)

    return jax.vmap(one)(seed, request, sample)


def inverse_cdf_sample(logits: jax.Array, uniform: jax.Array) -> jax.Array:
    """Per row, the token whose cumulative probability interval under softmax(logits) holds `uniform` [rows] in
    [0, 1): one random number per row instead of noise over the whole vocabulary (drawing that noise cost about 4x
    the rest of the sampler on CPU). The cumulative sums run in two levels (block totals, then within the chosen
    block), so each is short. Tokens of probability 0 (-inf logits) are never chosen."""
    rows, vocab = logits.shape
    per_block = _block_size(vocab)
    blocks = math.ceil(vocab / per_block)
    probs = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    probs = jnp.pad(probs, ((0, 0), (0, blocks * per_block - vocab))).reshape(rows, blocks, per_block)
    block_mass = probs.sum(axis=-1)
    cumulative = jnp.cumsum(block_mass, axis=-1)
    target = uniform * cumulative[:, -1]
    block = jnp.minimum(jnp.sum(cumulative <= target[:, None], axis=-1), blocks - 1)
    block = _last_positive_at_most(block_mass, block)  # rounding may point past the last block with mass
    inside = jnp.take_along_axis(probs, block[:, None, None], axis=1)[:, 0]
    previous = jnp.take_along_axis(cumulative, jnp.maximum(block - 1, 0)[:, None], axis=1)[:, 0]
    before = jnp.where(block > 0, previous, 0.0)  # <= target: the same values the block count compared
    offset = jnp.sum(jnp.cumsum(inside, axis=-1) <= (target - before)[:, None], axis=-1)
    offset = _last_positive_at_most(inside, jnp.minimum(offset, per_block - 1))
    return (block * per_block + offset).astype(jnp.int32)


def _block_size(vocab: int) -> int:
    """Tokens per block of the two-level cumulative sum: about sqrt(vocab), a divisor of it when one lies within a
    factor of two (then no padding copy of the probabilities is needed)."""
    root = math.ceil(math.sqrt(vocab))
    divisors = [d for d in range(max(1, root // 2), 2 * root + 1) if vocab % d == 0]
    return min(divisors, key=lambda d: abs(d - root)) if divisors else root


def _first_max_index(x: jax.Array) -> jax.Array:
    """`argmax` over the last axis (first index of the maximum) as two plain reductions, which XLA:CPU runs about
    twice as fast as argmax's paired value-index reduction."""
    positions = jnp.arange(x.shape[-1])
    at_max = x == jnp.max(x, axis=-1, keepdims=True)
    return jnp.minimum(jnp.min(jnp.where(at_max, positions, x.shape[-1]), axis=-1), x.shape[-1] - 1)


def _last_positive_at_most(values: jax.Array, index: jax.Array) -> jax.Array:
    """Per row, the largest i <= index with values[i] > 0 (index itself when it is positive)."""
    positions = jnp.arange(values.shape[-1])
    candidates = jnp.where((values > 0) & (positions <= index[:, None]), positions, -1)
    return jnp.maximum(jnp.max(candidates, axis=-1), 0)


def sample_tokens(
    logits: jax.Array,
    keys: jax.Array,
    steps: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    kind: SamplerKind,
    filter_method: FilterMethod | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row. logits [rows, vocab] float32; keys [rows, 2] raw key data; steps [rows] (index of
    the token in its response); temperature/top_k/top_p [rows]; `filter_method` None: by platform. Returns (tokens
    int32, logprobs float32): the log probs are taken before top-k / top-p (module docstring), so they are not the
    probabilities the tokens were drawn with when a filter is on."""
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    logprobs_all = jax.nn.log_softmax(scaled, axis=-1)
    tokens = _first_max_index(logits)
    if kind.sampled:
        filtered = filter_logits(scaled, top_k, top_p, kind, filter_method)

        def uniform(key: jax.Array, step: jax.Array) -> jax.Array:
            return jax.random.uniform(jax.random.fold_in(jax.random.wrap_key_data(key), step))

        drawn = inverse_cdf_sample(filtered, jax.vmap(uniform)(keys, steps))
        tokens = jnp.where(greedy, tokens, drawn)
    tokens = tokens.astype(jnp.int32)
    return tokens, jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]
