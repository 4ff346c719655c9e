"""Rule rewards on the controller: decode each response and score it against its row's ground truth.

The scorer is `hfjax.rewards.compute_score` (dispatch by `data_source`) or a user function `path.py:name`.
The score goes on the last real response token (`token_level_scores`), as verl places it. A sample whose scorer
raises or returns no finite number stops the run with a `RewardError` naming the row (`on_error="raise"`), or is
scored 0 and counted in the metric `reward/errors` (`on_error="skip"`); a batch whose every sample failed stops the
run with `skip` too, naming how many failed and the first.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hfjax.protocol import DataProto
from hfjax.rewards import RewardError, make_reward_function
from hfjax.rewards.token_level import scores_to_token_level

ERRORS_METRIC = "reward/errors"
RESPONSE_CHARS = 120  # of a failing sample's response shown in its error


class RuleReward:
    """Scores a rollout batch with a rule; needs `responses`, `response_mask` and the non-tensor `data_source`,
    `ground_truth` (and optionally `extra_info`) columns. `on_error`: `raise` or `skip` (see the module)."""

    def __init__(self, tokenizer: Any, spec: str | None = None, on_error: str = "raise"):
        if on_error not in ("raise", "skip"):
            raise ValueError(f"reward.on_error: expected 'raise' or 'skip', got {on_error!r}")
        self.tokenizer = tokenizer
        self.score_fn = make_reward_function(spec)
        self.on_error = on_error

    def texts(self, data: DataProto) -> list[str]:
        responses, mask = data.batch["responses"], data.batch["response_mask"]
        return [
            self.tokenizer.decode(row[m.astype(bool)].tolist(), skip_special_tokens=True)
            for row, m in zip(responses, mask, strict=True)
        ]

    def __call__(self, data: DataProto) -> DataProto:
        """`scores` [B] and `token_level_scores` [B, R]; `meta_info["metrics"]["reward/errors"]`: the samples
        scored 0 because their scorer failed (`on_error="skip"`). A batch whose every sample failed leaves nothing
        to train on: a RewardError under either setting."""
        columns = data.non_tensor_batch
        extra = columns.get("extra_info", [None] * len(data))
        index = columns.get("index", range(len(data)))
        rows = zip(columns["data_source"], self.texts(data), columns["ground_truth"], extra, strict=True)
        scores, errors, first = np.zeros(len(data), np.float32), 0, ""
        for i, (source, text, truth, info) in enumerate(rows):
            try:
                scores[i] = self.score_fn(source, text, truth, info)
            except RewardError as exc:
                shown = text if len(text) <= RESPONSE_CHARS else text[: RESPONSE_CHARS - 3] + "..."
                sample = f"sample {i} of the batch, row index {index[i]!r}, data_source {source!r}, response {shown!r}"
                failure = f"{exc} ({sample})"
                if self.on_error == "raise":
                    raise RewardError(
                        f"{failure}; set reward.on_error=skip to score such samples 0 and count them in reward/errors"
                    ) from exc
                errors, first = errors + 1, first or failure
        if errors and errors == len(data):
            raise RewardError(
                f"reward.on_error=skip: the reward failed on all {errors} samples of the batch, which leaves nothing "
                f"to train on; the first: {first}"
            )
        token_level = scores_to_token_level(scores, data.batch["response_mask"])
        out = DataProto.from_dict({"scores": scores, "token_level_scores": token_level})
        out.meta_info["metrics"] = {ERRORS_METRIC: float(errors)}
        return out
