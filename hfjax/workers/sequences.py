"""The RL batch layout shared by every role: left-padded prompts [B, P] followed by right-padded responses [B, R].

`input_ids = [prompt | response]`, `attention_mask` 1 on real tokens, `position_ids = cumsum(mask) - 1`, and
`response_mask` 1 on real response tokens. The logits that predict response token j sit at sequence index P - 1 + j,
so every role reads `[:, -R - 1 : -1]` of its per-token outputs.
Imports numpy, `hfjax.data` and `hfjax.rollout` only.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from hfjax.data.tokenize import position_ids
from hfjax.rollout.generator import SampleOutput


def prompt_token_lists(input_ids: np.ndarray, attention_mask: np.ndarray) -> list[np.ndarray]:
    """The real tokens of each left-padded prompt row."""
    return [row[mask.astype(bool)] for row, mask in zip(input_ids, attention_mask, strict=True)]


def assemble(
    prompt_ids: np.ndarray,
    prompt_mask: np.ndarray,
    outputs: Sequence[SampleOutput],
    n: int,
    response_length: int,
    pad_id: int,
) -> dict[str, np.ndarray]:
    """Tensors of the rollout batch: each prompt row repeated `n` times (interleaved, the order `outputs` come in)
    and joined with its responses, padded to `response_length`."""
    rows = len(outputs)
    responses = np.full((rows, response_length), pad_id, np.int32)
    response_mask = np.zeros((rows, response_length), np.int32)
    logprobs = np.zeros((rows, response_length), np.float32)
    for i, out in enumerate(outputs):
        length = len(out.tokens)
        responses[i, :length] = out.tokens
        response_mask[i, :length] = 1
        logprobs[i, :length] = out.logprobs
    prompts = np.repeat(prompt_ids, n, axis=0).astype(np.int32)
    masks = np.repeat(prompt_mask, n, axis=0).astype(np.int32)
    attention_mask = np.concatenate([masks, response_mask], axis=1)
    return {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": np.concatenate([prompts, responses], axis=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids(attention_mask),
        "rollout_log_probs": logprobs,
    }


def response_slice(per_token: jax.Array, response_length: int) -> jax.Array:
    """The outputs at the positions that predict the response tokens: [:, -R - 1 : -1]."""
    return per_token[:, -response_length - 1 : -1]


def last_response_index(response_mask: np.ndarray) -> np.ndarray:
    """Index of each row's last real response token (0 for an empty response)."""
    lengths = response_mask.sum(axis=-1)
    return np.maximum(lengths - 1, 0)


def scores_to_token_level(scores: np.ndarray, response_mask: np.ndarray) -> np.ndarray:
    """A sequence score placed on the last real response token: [B] -> [B, R] (zeros elsewhere)."""
    out = np.zeros(response_mask.shape, np.float32)
    rows = np.arange(len(scores))
    has_tokens = response_mask.sum(axis=-1) > 0
    out[rows[has_tokens], last_response_index(response_mask)[has_tokens]] = scores[has_tokens]
    return out
