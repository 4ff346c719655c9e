"""`RewardModelWorker`: a sequence-score model (reward or cost) read at each sequence's last real token.

The score model shares the policy's tokenizer (the batch's `input_ids` are scored as they are).
"""

from __future__ import annotations

from typing import Any

import jax

from hfjax.config.roles import RewardModelConfig
from hfjax.controller import Dispatch, Worker, register
from hfjax.parallel import layout_or_default
from hfjax.protocol import DataProto
from hfjax.workers.model_role import LoadedModel, reports_usage


def sequence_scores(model: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """`{"scores": [rows]}`: a sequence classifier's score of each whole sequence."""
    return {"scores": model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])[:, 0]}


class RewardModelWorker(Worker):
    """Scores whole sequences; `output_key` names the result (`rm_scores` for a reward, `cost_scores` for a cost)."""

    def __init__(self, config: RewardModelConfig, *, output_key: str = "rm_scores"):
        self.cfg = config
        self.output_key = output_key

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        layout = layout_or_default(self.cfg.layout, where="reward.layout")
        self.model = LoadedModel(self.cfg.model_path, layout, dtype=self.cfg.dtype, head="seq_cls")
        self._score = self.model.rows_fn(sequence_scores)
        return {"layout": layout.describe(), "params": self.model.config.num_params}

    @register(Dispatch.DP_COMPUTE_PROTO)
    @reports_usage
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """One score per sequence [B] under `output_key`."""
        arrays = {k: data.batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
        out = self.model.map_rows(self._score, self.model.params, arrays, self.cfg.micro_batch_size)
        return DataProto.from_dict({self.output_key: out["scores"]})
