"""Sampling settings and the jittable token sampler (temperature, top-k, top-p; greedy at temperature 0).

Logprob convention (the quantity the trainer recomputes): `log_softmax(logits / temperature)` at the chosen token,
over the whole vocabulary, before any top-k / top-p filtering; at temperature 0 (greedy) the temperature counts as 1.
Randomness: each sample has its own key, folded with the index of the token in the response, so a sample's tokens
do not depend on which slot or batch it ran in.
Imports only jax and numpy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


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


def filter_logits(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, kind: SamplerKind) -> jax.Array:
    """Masks (to -inf) tokens outside the top-k, then outside the smallest set of most likely tokens whose
    probability (renormalised after top-k) reaches top_p. scaled [rows, vocab]; top_k, top_p [rows]. Ties with the
    last kept value are kept."""
    if not (kind.top_k or kind.top_p):
        return scaled
    ordered = -jnp.sort(-scaled, axis=-1)
    rows = jnp.arange(scaled.shape[0])
    if kind.top_k:
        k = jnp.clip(top_k, 1, scaled.shape[-1])
        kth = ordered[rows, k - 1]
        keep_k = (top_k[:, None] <= 0) | (scaled >= kth[:, None])
        scaled = jnp.where(keep_k, scaled, NEG_INF)
        ordered = jnp.where((top_k[:, None] <= 0) | (ordered >= kth[:, None]), ordered, NEG_INF)
    if kind.top_p:
        probs = jax.nn.softmax(ordered, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        count = jnp.maximum(jnp.sum(mass_before < top_p[:, None], axis=-1), 1)
        last_kept = ordered[rows, count - 1]
        scaled = jnp.where(scaled >= last_kept[:, None], scaled, NEG_INF)
    return scaled


def sample_tokens(
    logits: jax.Array,
    keys: jax.Array,
    steps: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    kind: SamplerKind,
) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row. logits [rows, vocab] float32; keys [rows, 2] raw key data; steps [rows] (index of
    the token in its response); temperature/top_k/top_p [rows]. Returns (tokens int32, logprobs float32)."""
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    logprobs_all = jax.nn.log_softmax(scaled, axis=-1)
    tokens = jnp.argmax(logits, axis=-1)
    if kind.sampled:
        filtered = filter_logits(scaled, top_k, top_p, kind)

        def gumbel(key: jax.Array, step: jax.Array) -> jax.Array:
            return jax.random.gumbel(jax.random.fold_in(jax.random.wrap_key_data(key), step), (logits.shape[-1],))

        noise = jax.vmap(gumbel)(keys, steps)
        tokens = jnp.where(greedy, tokens, jnp.argmax(filtered + noise, axis=-1))
    tokens = tokens.astype(jnp.int32)
    return tokens, jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]
