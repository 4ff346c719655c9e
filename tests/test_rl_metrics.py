"""The rollout batch's length metrics (`data_metrics`) on hand-built multi-turn rows: prompt lengths count only the
prompt columns, response lengths every attended response token (model and environment, as verl counts them), and
the clip ratio is the share of rows that fill the response columns."""

import numpy as np
import pytest

from hfjax.protocol import DataProto
from hfjax.trainer.rl_metrics import data_metrics


def _batch() -> DataProto:
    """Prompt width 4, response width 6. Row 0: 2 prompt tokens, then model 2, environment 2, model 2 (fills the
    response); row 1: 4 prompt tokens, then model 1, environment 2, model 1, padding 2; row 2: 3 prompt tokens and a
    single-turn response of 6 model tokens."""
    prompt_mask = np.array([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])
    response_mask = np.array([[1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    response_attended = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    zeros = np.zeros((3, 6), np.float32)
    return DataProto.from_dict(
        {
            "attention_mask": np.concatenate([prompt_mask, response_attended], axis=1).astype(np.int32),
            "response_mask": response_mask.astype(np.int32),
            "token_level_scores": zeros,
            "token_level_rewards": zeros,
            "advantages": zeros,
            "returns": zeros,
        }
    )


def test_multi_turn_lengths_and_clip_ratio():
    metrics = data_metrics(_batch(), uses_critic=False)
    # prompt tokens per row [2, 4, 3]; attended response tokens [6, 4, 6]; rows 0 and 2 fill the 6 columns
    assert metrics["prompt_length/mean"] == pytest.approx(3.0)
    assert (metrics["prompt_length/max"], metrics["prompt_length/min"]) == (4.0, 2.0)
    assert metrics["response_length/mean"] == pytest.approx(16 / 3)
    assert (metrics["response_length/max"], metrics["response_length/min"]) == (6.0, 4.0)
    assert metrics["response_length/clip_ratio"] == pytest.approx(2 / 3)
