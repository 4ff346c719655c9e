"""Which rows an update counts: the rows DP dispatch adds as padding and the rows a program keeps out
(`Step.update_actor(rows=...)`) are in no loss and no row count, so the sequence-mean modes divide by the
mini-batch's own rows (verl's `global_batch_size`), whatever padding the dispatch added."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from hfjax.protocol import PADDING_ROWS, ROW_IN_LOSS, DataProto
from hfjax.workers.model_role import TrainedRole, padding_masked


class _RecordingState:
    """Stands in for `TrainState`: records the micro-batches of each optimizer step."""

    skipped_steps = 0

    def __init__(self) -> None:
        self.steps: list[list[dict[str, np.ndarray]]] = []

    def update(self, loss_fn, chunks):
        self.steps.append(chunks)
        return {"loss": 0.0}


def _update_counts(mask: np.ndarray, meta: dict, in_loss: np.ndarray | None = None) -> tuple[float, float]:
    batch = {"response_mask": mask, "responses": np.zeros_like(mask)}
    if in_loss is not None:
        batch[ROW_IN_LOSS] = in_loss
    data = DataProto.from_dict(batch, meta_info=meta)
    arrays = padding_masked({k: np.asarray(v) for k, v in data.batch.items() if k != ROW_IN_LOSS}, data)
    role = SimpleNamespace(state=_RecordingState())
    TrainedRole.ppo_epochs(role, arrays, loss_fn=None, epochs=1, mini=len(mask), micro=2, role="actor")
    chunk = role.state.steps[0][0]
    assert ROW_IN_LOSS not in chunk  # the loss functions see the counts, not the flag
    return float(chunk["global_tokens"][0]), float(chunk["global_seqs"][0])


def test_padding_rows_and_rows_kept_out_are_not_counted():
    mask = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], np.float32)
    # rows 4 and 5 are DP padding (copies of rows 0 and 1); row 2 is a real row without a valid token: it counts
    tokens, seqs = _update_counts(mask, {PADDING_ROWS: 2})
    assert (tokens, seqs) == (mask[:4].sum(), 4.0)
    # a program keeps row 3 out of the update: its tokens leave with it (the step zeroes its mask) and its row too
    kept = np.array([1, 1, 1, 0, 1, 1], bool)
    tokens, seqs = _update_counts(mask * kept[:, None], {PADDING_ROWS: 2}, kept)
    assert (tokens, seqs) == ((mask * kept[:, None])[:4].sum(), 3.0)
    # no padding, nothing kept out: every row counts
    assert _update_counts(mask, {}) == (mask.sum(), 6.0)
