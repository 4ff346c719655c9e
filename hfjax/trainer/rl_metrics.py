"""verl's per-step data metrics of a rollout batch: scores, rewards, advantages, returns, values, explained
variance, response and prompt lengths."""

from __future__ import annotations

import numpy as np

from hfjax.protocol import DataProto


def _stats(prefix: str, values: np.ndarray) -> dict[str, float]:
    return {
        f"{prefix}/mean": float(values.mean()),
        f"{prefix}/max": float(values.max()),
        f"{prefix}/min": float(values.min()),
    }


def data_metrics(batch: DataProto, uses_critic: bool) -> dict[str, float]:
    """Metrics of the rollout batch after the step (verl's names and definitions). Lengths count attended tokens:
    `prompt_length` those of the prompt columns, `response_length` those of the response columns (in a multi-turn
    trajectory, model and environment tokens alike), and `response_length/clip_ratio` is the share of rows whose
    response fills every response column."""
    data = batch.batch
    mask = data["response_mask"].astype(bool)
    width = mask.shape[1]
    attended = data["attention_mask"].astype(bool)
    lengths = attended[:, -width:].sum(-1).astype(np.float32)
    prompt_lengths = attended[:, :-width].sum(-1).astype(np.float32)
    out = {
        **_stats("critic/score", data["token_level_scores"].sum(-1)),
        **_stats("critic/rewards", data["token_level_rewards"].sum(-1)),
        **_stats("response_length", lengths),
        **_stats("prompt_length", prompt_lengths),
        "response_length/clip_ratio": float((lengths == width).mean()),
    }
    if mask.any():
        out.update(_stats("critic/advantages", data["advantages"][mask]))
        out.update(_stats("critic/returns", data["returns"][mask]))
    if uses_critic and mask.any():
        values, returns = data["values"][mask], data["returns"][mask]
        out.update(_stats("critic/values", values))
        out["critic/vf_explained_var"] = float(1.0 - np.var(returns - values) / (np.var(returns) + 1e-5))
    return out
