"""Sequence scores as token-level rewards on the controller: a score goes on the last real response token of its row
(in a multi-turn trajectory, the model's last token; environment tokens are 0 in `response_mask`)."""

from __future__ import annotations

import numpy as np


def last_response_index(response_mask: np.ndarray) -> np.ndarray:
    """Index of each row's last real response token (0 for an empty response); in a multi-turn trajectory, the
    model's last token (environment tokens are 0 in the mask)."""
    width = response_mask.shape[-1]
    last = width - 1 - np.argmax(response_mask[..., ::-1] > 0, axis=-1)
    return np.where(response_mask.any(axis=-1), last, 0)


def scores_to_token_level(scores: np.ndarray, response_mask: np.ndarray) -> np.ndarray:
    """A sequence score placed on the last real response token: [B] -> [B, R] (zeros elsewhere)."""
    out = np.zeros(response_mask.shape, np.float32)
    rows = np.arange(len(scores))
    has_tokens = response_mask.sum(axis=-1) > 0
    out[rows[has_tokens], last_response_index(response_mask)[has_tokens]] = scores[has_tokens]
    return out
