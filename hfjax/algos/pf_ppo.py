"""PF-PPO reweighting (arXiv 2409.06957, policy filtration for PPO; verl's `algorithm.use_pf_ppo`): the batch is
resampled, with replacement and to its own size, with probabilities that favour responses of reliable scores.

Host-side numpy on the controller: `pf_ppo_indices` gives the rows to gather (every per-row array of the batch, as
verl gathers the whole `DataProto`).
"""

from __future__ import annotations

import numpy as np

PF_PPO_METHODS = ("pow", "max_min", "max_random")
PF_PPO_WEIGHT_EPS = 1e-8  # added to every weight, so that no row has probability 0


def pf_ppo_weights(scores: np.ndarray, method: str = "pow", weight_pow: float = 2.0) -> np.ndarray:
    """Unnormalised sampling weights (bs,) of rows with summed scores `scores` (bs,), plus 1e-8 each.

    pow: |score| ** weight_pow; max_min: 1 for the rows with the batch's highest or lowest score, else 0;
    max_random: 0.4 for the rows with the highest score, else 0.1.
    """
    scores = np.asarray(scores, np.float64)
    if scores.ndim != 1 or scores.size == 0:
        raise ValueError(f"scores must be one summed score per row, shape (rows,), got shape {scores.shape}")
    if method == "pow":
        weights = np.abs(scores) ** weight_pow
    elif method == "max_min":
        weights = ((scores == scores.max()) | (scores == scores.min())).astype(np.float64)
    elif method == "max_random":
        weights = np.where(scores == scores.max(), 0.4, 0.1)
    else:
        raise ValueError(f"PF-PPO reweight_method must be one of {list(PF_PPO_METHODS)}, got {method!r}")
    return np.maximum(weights + PF_PPO_WEIGHT_EPS, PF_PPO_WEIGHT_EPS)


def pf_ppo_indices(
    scores: np.ndarray, rng: np.random.Generator, method: str = "pow", weight_pow: float = 2.0
) -> np.ndarray:
    """Row indices (bs,) drawn with replacement with probabilities proportional to `pf_ppo_weights`: gather every
    per-row array of the batch with them."""
    weights = pf_ppo_weights(scores, method, weight_pow)
    return rng.choice(weights.size, size=weights.size, replace=True, p=weights / weights.sum())
