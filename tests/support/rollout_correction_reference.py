"""float64 numpy references of verl 0.9.1's rollout correction (`verl/trainer/ppo/rollout_corr_helper.py`), written
from its definitions as plain loops over rows and tokens, and the random test inputs they are compared on."""

import math

import numpy as np

BS, T = 8, 10
CLAMP = 20.0  # verl's SAFETY_BOUND


def make_inputs(seed=11, bs=BS, length=T):
    """float32 (old, rollout, mask): log-probs < 0, old = rollout + noise; row 0 all masked, row 1 full, the rest
    random with holes; masked positions hold junk (NaN, -inf, large values) that must never reach a result."""
    rng = np.random.default_rng(seed)
    rollout = -rng.exponential(1.0, (bs, length)) - 0.01
    old = np.minimum(rollout + rng.normal(0.0, 0.45, (bs, length)), -1e-3)
    mask = (rng.random((bs, length)) < 0.75).astype(np.float32)
    mask[0], mask[1] = 0, 1
    holes = np.argwhere(mask == 0)
    old[tuple(holes[0])], rollout[tuple(holes[1])], old[tuple(holes[2])] = np.nan, -np.inf, 1e4
    return old.astype(np.float32), rollout.astype(np.float32), mask


# ---------------------------------------------------------------- references, from verl's definitions


def clamp(x):
    return min(max(x, -CLAMP), CLAMP)


def mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def log_ratios(old, rollout, mask):
    """Per row, the float64 log ratios log pi_old - log mu of its valid tokens, with their columns."""
    return [
        [(t, float(old[b, t]) - float(rollout[b, t])) for t in range(mask.shape[1]) if mask[b, t]]
        for b in range(mask.shape[0])
    ]


def ref_mismatch(old, rollout, mask):
    rows = log_ratios(old, rollout, mask)
    ds = [d for row in rows for _, d in row]
    ratios = [math.exp(clamp(d)) for d in ds]
    return {
        "log_prob_abs_diff": mean([abs(d) for d in ds]),
        "log_prob_abs_diff_max": max([abs(d) for d in ds], default=0.0),
        "kl": mean([-d for d in ds]),
        "k3_kl": mean([math.exp(d) - 1 - d for d in ds]),
        "ratio_mean": mean(ratios),
        "ratio_max": max(ratios, default=0.0),
        "ratio_min": min(ratios, default=0.0),
    }


def ref_importance(old, rollout, mask, level, threshold, batch_normalize):
    """verl's compute_rollout_correction_weights: (weights, metrics)."""
    spec = str(threshold)
    lower, upper = (float(x) for x in spec.split("_")) if "_" in spec else (None, float(spec))
    low_bound = lower if lower is not None else 1 / upper
    rows = log_ratios(old, rollout, mask)
    raw = np.zeros(mask.shape)
    for b, row in enumerate(rows):
        for t, d in row:
            raw[b, t] = math.exp(clamp(d if level == "token" else sum(x for _, x in row)))
    weights = np.zeros(mask.shape)
    for b, row in enumerate(rows):
        for t, _ in row:
            inside = lower is None or lower <= raw[b, t] <= upper
            weights[b, t] = min(raw[b, t], upper) if lower is None else raw[b, t] * inside
    tokens = [(b, t) for b, row in enumerate(rows) for t, _ in row]
    if level == "token":
        high = mean([float(raw[b, t] > upper) for b, t in tokens])
        low = mean([float(raw[b, t] < low_bound) for b, t in tokens])
    else:  # shares of sequences, compared in log space
        sums = [sum(d for _, d in row) for row in rows if row]
        high = mean([float(s > math.log(upper)) for s in sums])
        low = mean([float(s < math.log(low_bound)) for s in sums])
    metrics = {
        "rollout_is_mean": mean([weights[b, t] for b, t in tokens]),
        "rollout_is_ratio_fraction_high": high,
        "rollout_is_ratio_fraction_low": low,
    }
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = mean([float(not lower <= raw[b, t] <= upper) for b, t in tokens])
    if batch_normalize:
        if level == "token":
            norm = metrics["rollout_is_mean"]
        else:
            norm = mean([mean([weights[b, t] for t, _ in row]) for b, row in enumerate(rows) if row])
        metrics["rollout_is_batch_norm_factor"] = norm if norm > 1e-8 else 1.0
        weights = weights / metrics["rollout_is_batch_norm_factor"]
    return weights, metrics


def ref_statistic(option, row):
    """verl's per-option statistic of a row: {column: value} over its valid tokens."""
    level, k = option.rsplit("_", 1)
    divergence = {
        "k1": lambda r: -r,
        "k2": lambda r: 0.5 * r * r,
        "k3": lambda r: math.exp(r) - 1 - r,
    }[k]
    per_token = {t: divergence(clamp(d)) for t, d in row}  # every token clamped first
    if level == "token":
        return per_token
    values = list(per_token.values())
    reduce = {"seq_sum": sum, "seq_mean": mean, "seq_max": lambda v: max(v, default=0.0)}[level]
    return dict.fromkeys(per_token, reduce(values))


def ref_bounds(option, spec):
    """(log lower, log upper) for k1 (ratio bounds on mu / pi_old), (None, upper) for k2 / k3."""
    if option.endswith("k1"):
        lower, upper = (float(x) for x in spec.split("_")) if "_" in spec else (1 / float(spec), float(spec))
        return math.log(lower), math.log(upper)
    return None, float(spec)


def ref_rejection(old, rollout, mask, options, thresholds):
    """verl's compute_rollout_rejection_mask: (kept mask, metrics, distance of the closest statistic to a bound)."""
    names = list(dict.fromkeys(o.strip() for o in options.split(",")))
    specs = [s.strip() for s in str(thresholds).split(",")]
    specs = specs * len(names) if len(specs) == 1 else specs
    rows = log_ratios(old, rollout, mask)
    kept = mask.astype(np.float64).copy()
    metrics, closest = {}, math.inf

    def shares(rejected):  # {(b, t)} of rejected valid tokens
        tokens = [(b, t) for b, row in enumerate(rows) for t, _ in row]
        hit = [any((b, t) in rejected for t, _ in row) for b, row in enumerate(rows) if row]
        return mean([float(bt in rejected) for bt in tokens]), mean([float(h) for h in hit])

    every = set()
    for name, spec in zip(names, specs, strict=True):
        lower, upper = ref_bounds(name, spec)
        rejected = set()
        for b, row in enumerate(rows):
            for t, value in ref_statistic(name, row).items():
                closest = min(closest, abs(value - upper), abs(value - lower) if lower is not None else math.inf)
                if value > upper or (lower is not None and value < lower):
                    rejected.add((b, t))
        token_share, seq_share = shares(rejected)
        metrics[f"rollout_rs_{name}_masked_fraction"] = token_share
        metrics[f"rollout_rs_{name}_seq_masked_fraction"] = seq_share
        every |= rejected
    for b, t in every:
        kept[b, t] = 0
    metrics["rollout_rs_masked_fraction"], metrics["rollout_rs_seq_masked_fraction"] = shares(every)
    return kept, metrics, closest
