"""Shared inputs and float64 numpy references (plain loops, written from verl's definitions) for the hfjax.algos
tests: ragged masks, mixed group ids, masked statistics, GRPO, verl's loss aggregation, dual-clip PPO."""

import contextlib
import math
import zlib
from collections import defaultdict

import jax
import numpy as np

BS, T = 9, 7
DTYPES = [np.float32, np.float64]
# float32: a few ulps of values of order 1-10 after a handful of reductions; float64: the same in float64 ulps.
TOL = {np.float32: dict(rtol=3e-5, atol=3e-5), np.float64: dict(rtol=1e-11, atol=1e-11)}


def precision(dtype):
    """float64 needs x64 only for the duration of the test; float32 runs as configured."""
    return jax.enable_x64(True) if dtype == np.float64 else contextlib.nullcontext()


def ragged_mask(rng, bs=BS, length=T):
    """Row 0 all masked, row 1 full, row 2 right-padded, the rest random 0/1 with interior holes."""
    mask = (rng.random((bs, length)) < 0.7).astype(np.float64)
    mask[0] = 0
    mask[1] = 1
    mask[2] = np.arange(length) < length // 2
    return mask


def group_index():
    """Mixed hashable ids: a group of three, a group of one (a tuple id), a group of two ints, a group of three."""
    keys = ["a", "a", ("solo", 1), 7, "a", 7, "b", "b", "b"]
    index = np.empty(len(keys), dtype=object)
    index[:] = keys
    return index


def close(actual, expected, dtype):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, **TOL[dtype])


# ---------------------------------------------------------------- numpy references


def ref_masked_mean(x, m):
    total, count = 0.0, 0.0
    for value, valid in zip(x.ravel(), m.ravel(), strict=True):
        if valid:
            total += value * valid
            count += valid
    return total / (count + 1e-8)


def ref_whiten(x, m):
    mean = ref_masked_mean(x, m)
    count = m.sum()
    var = ref_masked_mean((x - mean) ** 2, m) * count / (count - 1)
    return (x - mean) / math.sqrt(var + 1e-8)


def groups_of(index):
    rows = defaultdict(list)
    for i, key in enumerate(index):
        rows[key].append(i)
    return list(rows.values())


def ref_grpo(r, m, index, norm_by_std):
    scores = r.sum(-1)
    adv = np.zeros(len(scores))
    for rows in groups_of(index):
        group = scores[rows]
        n = len(group)
        mean = sum(group) / n if n > 1 else 0.0
        std = math.sqrt(sum((g - sum(group) / n) ** 2 for g in group) / (n - 1)) if n > 1 else 1.0
        for i in rows:
            adv[i] = (scores[i] - mean) / (std + 1e-6) if norm_by_std else scores[i] - mean
    return adv[:, None] * m


def ref_agg(loss, m, mode, tokens=None, seqs=None, norm_length=None):
    """verl's agg_loss with its mini-batch normalisers: `tokens` valid tokens, `seqs` rows (default: all rows)."""
    tokens = m.sum() if tokens is None else tokens
    seqs = len(m) if seqs is None else seqs
    valid_sum = sum(loss[i, t] for i in range(len(m)) for t in range(m.shape[1]) if m[i, t])
    if mode == "token-mean":
        return valid_sum / tokens
    if mode == "token-sum":
        return valid_sum
    per_seq = []
    for i in range(len(m)):
        token_sum = sum(loss[i, t] for t in range(m.shape[1]) if m[i, t])
        per_seq.append(token_sum / (m[i].sum() + 1e-8) if mode == "seq-mean-token-mean" else token_sum)
    result = sum(per_seq) / seqs
    return result / (norm_length or m.shape[1]) if mode == "seq-mean-token-sum-norm" else result


def ref_agg_weights(m, mode):
    """d ref_agg / d loss[i, t]: how much each token's loss counts in the aggregate (default normalisers)."""
    rows, length = m.shape
    per_token = {
        "token-mean": m / m.sum(),
        "token-sum": m,
        "seq-mean-token-sum": m / rows,
        "seq-mean-token-mean": m / (m.sum(-1, keepdims=True) + 1e-8) / rows,
        "seq-mean-token-sum-norm": m / rows / length,
    }
    return per_token[mode]


def ref_ppo_tokens(old, new, adv, low, high, c):
    """Per-token dual-clip loss, and per-token flags (clipped term wins, dual clip bounds)."""
    loss, clipped, lower = np.zeros_like(adv), np.zeros_like(adv), np.zeros_like(adv)
    for idx in np.ndindex(adv.shape):
        ratio = math.exp(min(max(new[idx] - old[idx], -20.0), 20.0))
        a = adv[idx]
        l1, l2 = -a * ratio, -a * min(max(ratio, 1 - low), 1 + high)
        loss[idx], clipped[idx] = max(l1, l2), l2 > l1
        if a < 0 and max(l1, l2) > -a * c:
            loss[idx], lower[idx] = -a * c, 1.0
    return loss, clipped, lower


def seeded_rng(request) -> np.random.Generator:
    """A generator seeded by the test's name (for an `rng` fixture): a different, reproducible draw per test."""
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))
