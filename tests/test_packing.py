"""Padding-free micro-batches (`actor.packed_row_tokens`): positions restart per packed sequence, first-fit
decreasing packing, and the packed arrays hold every real token once (with its recorded experts), with indices that
read each response token back where the padded batch has it. (That updates and log-prob passes equal the padded ones
is in test_trim_padding.py.)"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_trim_padding import PROMPT_LENGTHS, PROMPT_WIDTH, RESPONSE_LENGTH, RESPONSE_LENGTHS, _batch

from hfjax.models.transformer import positions_from_mask
from hfjax.workers.packing import (
    PACKED_LABELS,
    RESPONSE_INDEX,
    first_fit_decreasing,
    packed_micro_batches,
    response_positions,
    to_response_rows,
)
from hfjax.workers.sequences import ROUTED_EXPERTS


def test_positions_restart_on_each_packed_sequence():
    segments = np.asarray([[0, 0, 1, 1, 1, 0], [1, 1, 2, 2, 2, 3], [1, 0, 1, 1, 0, 0]])
    want = [[0, 0, 0, 1, 2, 2], [0, 1, 0, 1, 2, 0], [0, 0, 1, 2, 2, 2]]  # a 0/1 row keeps cumsum(mask) - 1
    np.testing.assert_array_equal(np.asarray(positions_from_mask(jnp.asarray(segments))), want)
    mask = np.asarray([[0, 1, 1, 0]], bool)
    np.testing.assert_array_equal(np.asarray(positions_from_mask(jnp.asarray(mask))), [[0, 0, 1, 1]])


def test_first_fit_decreasing():
    # longest first: 7 -> row A; 5 -> row B; 4 -> B (9); 3 -> A (10); 2 -> C (A, B full enough); fullest row first
    assert first_fit_decreasing(np.asarray([3, 7, 2, 5, 4]), 10) == [[1, 0], [3, 4], [2]]
    assert first_fit_decreasing(np.asarray([], int), 10) == []


@pytest.mark.parametrize("parts", [1, 4])
def test_packed_arrays_hold_every_token_once_and_read_back(parts):
    batch = _batch(50, 0)
    batch["per_row"] = np.arange(len(PROMPT_LENGTHS), dtype=np.float32) + 1
    routes = np.random.default_rng(1).integers(0, 8, (*batch["input_ids"].shape, 2, 3)).astype(np.int8)
    batch[ROUTED_EXPERTS] = np.where(batch["attention_mask"][..., None, None] > 0, routes, -1)  # routing replay
    order, micro_batches = packed_micro_batches(batch, RESPONSE_LENGTH, 64, parts)
    lengths = np.asarray(PROMPT_LENGTHS) + np.asarray(RESPONSE_LENGTHS)
    assert sorted(order[order >= 0].tolist()) == list(range(len(PROMPT_LENGTHS)))  # every row once
    assert sum(int((mb["attention_mask"] > 0).sum()) for mb in micro_batches) == lengths.sum()  # no token twice
    seen = 0
    for mb in micro_batches:
        rows = len(mb[RESPONSE_INDEX])
        assert mb["input_ids"].shape[0] == parts and mb["input_ids"].shape[1] <= 64 and rows % parts == 0
        seq_rows = order[seen : seen + rows]
        seen += rows
        # read each sequence row's response back through the indices, as the traced program does
        arrays = {k: jnp.asarray(v) for k, v in mb.items()}
        per_position = jnp.asarray(mb["input_ids"], jnp.float32)[..., None] * jnp.ones(3)  # [parts, width, 3]
        at_responses, labels = response_positions(per_position, arrays)
        labels_back = np.asarray(to_response_rows(labels, arrays))
        predicting = np.asarray(to_response_rows(at_responses[..., 0], arrays))
        for k, row in enumerate(seq_rows):
            mask = mb["response_mask"][k].astype(bool)
            if row < 0:
                assert not mask.any() and mb["per_row"][k] == batch["per_row"][0]
                continue
            n, p = RESPONSE_LENGTHS[row], PROMPT_LENGTHS[row]
            assert mb["per_row"][k] == batch["per_row"][row]
            np.testing.assert_array_equal(mb["advantages"][k, :n], batch["advantages"][row, :n])
            np.testing.assert_array_equal(labels_back[k, :n], batch["responses"][row, :n])
            # the token before each response token: the prompt's last, then the response's own
            before = batch["input_ids"][row, PROMPT_WIDTH - 1 : PROMPT_WIDTH - 1 + n]
            np.testing.assert_array_equal(predicting[k, :n], before)
            part, segment = divmod(k, rows // parts)  # the part's sequence rows hold segments 1, 2, ... in turn
            packed = mb["attention_mask"][part] == segment + 1
            real = batch["attention_mask"][row].astype(bool)
            assert packed.sum() == p + n
            for key in ("input_ids", "position_ids", ROUTED_EXPERTS):
                np.testing.assert_array_equal(mb[key][part][packed], batch[key][row][real])
        assert (mb[ROUTED_EXPERTS][mb["attention_mask"] == 0] == -1).all()  # padding routes itself
    assert seen == len(order)
    assert all(PACKED_LABELS in mb for mb in micro_batches)


def test_a_sequence_longer_than_a_row_is_refused():
    batch = _batch(50, 0)
    with pytest.raises(ValueError, match="packed_row_tokens=32: a sequence has 57 tokens"):
        packed_micro_batches(batch, RESPONSE_LENGTH, 32, 1)
