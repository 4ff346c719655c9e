"""Top-k and top-p filters of the token sampler, in two implementations that keep exactly the same tokens.

The rule (per row, over `scaled` [rows, vocab]):
- top-k keeps every token whose value is at least the k-th largest value (counted with multiplicity), so all ties
  with the k-th value are kept;
- top-p then keeps a token iff the probability mass of the tokens with a strictly larger value, after top-k, is
  below top_p: ties are kept or dropped together, and the smallest such set reaching top_p is kept.
The probability mass is summed in integers, so the sum does not depend on its order and both implementations see
the same number: each token weighs `exp(value - max)` truncated to a multiple of 2^-30 (three 10-bit limbs packed
in one int32), and "mass below top_p" is `float(mass) < top_p * float(total)`. Weights under 2^-30 of the most
likely token count as 0 (at most vocab * 2^-30 of the largest weight in all, 1.4e-4 at 152k tokens).

- `bisection` finds both thresholds by 32 bisection steps on the values' bit patterns, each a reduction over the
  row: no sort. The CPU default: at 640 x 151,936 on a 2-core VM the candidates' fast branch ran 2.9x faster, but
  their full-sort fallback 6x slower (`scripts/bench/bench_sampler.py`), and which one runs depends on the settings.
- `candidates` reads the top `CANDIDATES` values with `lax.top_k` and finds both thresholds among them; when a row
  needs more (top_k > CANDIDATES, or top-p without top-k whose candidates hold less than top_p of the mass) the
  batch takes the same computation over a full sort instead. For accelerators, where a bisection step costs a full
  read of the row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

import jax
import jax.numpy as jnp

from hfjax.models.program import program_platform


class FilterSwitches(Protocol):
    """Which filters the compiled step has (`sampling.SamplerKind` is one)."""

    top_k: bool
    top_p: bool


FilterMethod = Literal["bisection", "candidates"]
FILTER_METHODS: tuple[str, ...] = ("bisection", "candidates")
CANDIDATES = 128  # values read by `lax.top_k`: top_k up to this, and top-p nuclei inside it, avoid the full sort
NEG_INF = -jnp.inf
_LIMB = 10  # bits per limb of the fixed-point weights
_LIMB_MASK = (1 << _LIMB) - 1
_MAX_VOCAB = 1 << 21  # limb sums stay below 2^31


def default_filter_method() -> FilterMethod:
    """The filter implementation for the traced program's platform: bisection on CPU (no sort to fall back on),
    candidates elsewhere."""
    return "bisection" if program_platform() == "cpu" else "candidates"


def filter_logits(
    scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, kind: FilterSwitches, method: FilterMethod | None = None
) -> jax.Array:
    """`scaled` [rows, vocab] with the tokens outside top-k, then outside top-p (the module's rule), set to -inf.
    top_k [rows] (<= 0: off), top_p [rows] (>= 1: off); `method` None picks by platform."""
    method = default_filter_method() if method is None else method
    if method not in FILTER_METHODS:
        raise ValueError(f"filter method {method!r}: expected one of {FILTER_METHODS}")
    if scaled.shape[-1] > _MAX_VOCAB:
        raise ValueError(f"logits vocabulary {scaled.shape[-1]}: expected at most {_MAX_VOCAB} tokens")
    if not (kind.top_k or kind.top_p):
        return scaled
    if method == "bisection":
        return _filter_by_bisection(scaled, top_k, top_p, kind)
    vocab = scaled.shape[-1]
    filtered, fits = _filter_over_candidates(scaled, top_k, top_p, kind, min(CANDIDATES, vocab))
    if vocab <= CANDIDATES:
        return filtered
    return jax.lax.cond(
        jnp.all(fits), lambda: filtered, lambda: _filter_over_candidates(scaled, top_k, top_p, kind, vocab)[0]
    )


def _fixed_point_weights(scaled: jax.Array) -> jax.Array:
    """int32 [rows, vocab]: `exp(scaled - row max)` in [0, 1] truncated to 30 fractional bits, as three 10-bit limbs
    (the top one up to 1024) packed high to low."""
    weight = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))
    packed = jnp.zeros(scaled.shape, jnp.int32)
    for _ in range(3):
        weight = weight * (1 << _LIMB)
        limb = jnp.floor(weight)
        weight = weight - limb
        packed = (packed << _LIMB) | limb.astype(jnp.int32)
    return packed


def _limbs(packed: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    return packed >> (2 * _LIMB), (packed >> _LIMB) & _LIMB_MASK, packed & _LIMB_MASK


def _as_float(high: jax.Array, middle: jax.Array, low: jax.Array) -> jax.Array:
    """The exact integer `high * 2^20 + middle * 2^10 + low` (limb sums) / 2^20, rounded once to float32: carries
    are propagated in integers first, so the result rises with the integer."""
    middle = middle + (low >> _LIMB)
    high = high + (middle >> _LIMB)
    fraction = ((middle & _LIMB_MASK).astype(jnp.float32) + (low & _LIMB_MASK) / (1 << _LIMB)) / (1 << _LIMB)
    return high.astype(jnp.float32) + fraction


def _row_mass(packed: jax.Array, where: jax.Array | None = None) -> jax.Array:
    """float32 [rows]: the mass of the row's weights (where `where` holds), summed exactly."""
    kept = packed if where is None else jnp.where(where, packed, 0)
    zero = jnp.int32(0)
    sums = jax.lax.reduce(_limbs(kept), (zero,) * 3, lambda x, y: tuple(a + b for a, b in zip(x, y, strict=True)), (1,))
    return _as_float(*sums)  # one variadic reduction: the row is read once, not once per limb


def _order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys that sort like the float32 values `x` (-0 counts as +0: a `where`, since XLA folds `x + 0.0`)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _search_keys(keys: jax.Array, holds: Callable[[jax.Array], jax.Array], largest: bool) -> jax.Array:
    """Per row, the largest (or smallest) uint32 threshold t for which `holds(t)` [rows] is true, where `holds` is
    monotone in t and true at the end of the range searched toward: 32 bisection steps over all keys, each one
    reduction over the row (no sort: XLA's CPU sort of a 64 x 8192 batch costs about 40 decode steps)."""
    rows = keys.shape[0]
    low, high = jnp.zeros(rows, jnp.uint32), jnp.full(rows, 0xFFFFFFFF, jnp.uint32)

    def step(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        low, high = bounds
        half = (high - low) >> 1
        if largest:  # invariant: holds(low)
            mid = low + half + ((high - low) & 1)
            ok = holds(mid)
            return jnp.where(ok, mid, low), jnp.where(ok, high, mid - 1)
        mid = low + half  # invariant: holds(high)
        ok = holds(mid)
        return jnp.where(ok, low, mid + 1), jnp.where(ok, mid, high)

    low, high = jax.lax.fori_loop(0, 32, step, (low, high))
    return low if largest else high


def _filter_by_bisection(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, kind: FilterSwitches) -> jax.Array:
    """Both thresholds as exact bit-pattern keys: the k-th largest value, and the smallest value with less than
    top_p of the mass strictly above it."""
    keys = _order_keys(scaled)
    if kind.top_k:
        k = jnp.clip(top_k, 1, scaled.shape[-1])
        kth = _search_keys(keys, lambda t: jnp.sum(keys >= t[:, None], axis=-1) >= k, largest=True)
        keep = (top_k[:, None] <= 0) | (keys >= kth[:, None])
        scaled = jnp.where(keep, scaled, NEG_INF)
        keys = jnp.where(keep, keys, 0)
    if kind.top_p:
        packed = _fixed_point_weights(scaled)
        budget = top_p * _row_mass(packed)
        last_kept = _search_keys(keys, lambda t: _row_mass(packed, keys > t[:, None]) < budget, largest=False)
        keep = (top_p[:, None] >= 1.0) | (keys >= last_kept[:, None])
        scaled = jnp.where(keep, scaled, NEG_INF)
    return scaled


def _filter_over_candidates(
    scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, kind: FilterSwitches, count: int
) -> tuple[jax.Array, jax.Array]:
    """The filters with thresholds read from the `count` largest values of each row; returns the filtered logits
    and, per row, whether those values sufficed (always true at count = vocab)."""
    values, indices = jax.lax.top_k(scaled, count)
    fits = jnp.ones(scaled.shape[0], bool)
    if kind.top_k:
        kth = jnp.take_along_axis(values, jnp.clip(top_k, 1, count)[:, None] - 1, axis=-1)
        off = top_k[:, None] <= 0
        scaled = jnp.where(off | (scaled >= kth), scaled, NEG_INF)
        values = jnp.where(off | (values >= kth), values, NEG_INF)
        fits &= top_k <= count
    if kind.top_p:
        packed = _fixed_point_weights(scaled)
        budget = top_p * _row_mass(packed)
        cumulative = [jnp.cumsum(limb, axis=-1) for limb in _limbs(jnp.take_along_axis(packed, indices, axis=-1))]
        # mass strictly above a candidate: the cumulative sum just before the first candidate of its tie group
        positions = jnp.arange(count)
        starts_group = jnp.concatenate([jnp.ones_like(values[:, :1], bool), values[:, 1:] != values[:, :-1]], -1)
        group_start = jax.lax.cummax(jnp.where(starts_group, positions, 0), axis=1)
        before = group_start - 1
        above = [jnp.where(before >= 0, jnp.take_along_axis(c, jnp.maximum(before, 0), axis=-1), 0) for c in cumulative]
        kept = _as_float(*above) < budget[:, None]
        last_kept = jnp.take_along_axis(values, jnp.sum(kept, axis=-1, keepdims=True) - 1, axis=-1)
        keep = (top_p[:, None] >= 1.0) | (scaled >= last_kept)
        scaled = jnp.where(keep, scaled, NEG_INF)
        holds_nucleus = ~(_as_float(*(c[:, -1] for c in cumulative)) < budget)
        in_top_k = (top_k > 0) if kind.top_k else False
        fits &= (top_p >= 1.0) | in_top_k | holds_nucleus
    return scaled, fits
