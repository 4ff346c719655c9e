"""Rule rewards on the controller: decode each response and score it against its row's ground truth.

The scorer is `hfjax.rewards.compute_score` (dispatch by `data_source`) or a user function `path.py:name`.
The score goes on the last real response token (`token_level_scores`), as verl places it.
Imports `hfjax.rewards`, `hfjax.protocol` and this package's sequences.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hfjax.protocol import DataProto
from hfjax.rewards import make_reward_function
from hfjax.workers.sequences import scores_to_token_level


class RuleReward:
    """Scores a rollout batch with a rule; needs `responses`, `response_mask` and the non-tensor `data_source`,
    `ground_truth` (and optionally `extra_info`) columns."""

    def __init__(self, tokenizer: Any, spec: str | None = None):
        self.tokenizer = tokenizer
        self.score_fn = make_reward_function(spec)

    def texts(self, data: DataProto) -> list[str]:
        responses, mask = data.batch["responses"], data.batch["response_mask"]
        return [
            self.tokenizer.decode(row[m.astype(bool)].tolist(), skip_special_tokens=True)
            for row, m in zip(responses, mask, strict=True)
        ]

    def __call__(self, data: DataProto) -> DataProto:
        """`scores` [B] and `token_level_scores` [B, R]."""
        columns = data.non_tensor_batch
        extra = columns.get("extra_info", [None] * len(data))
        rows = zip(columns["data_source"], self.texts(data), columns["ground_truth"], extra, strict=True)
        scores = np.array([self.score_fn(*row) for row in rows], np.float32)
        token_level = scores_to_token_level(scores, data.batch["response_mask"])
        return DataProto.from_dict({"scores": scores, "token_level_scores": token_level})
