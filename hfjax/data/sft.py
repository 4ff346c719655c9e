"""Supervised fine-tuning datasets: rows with `prompt` (chat messages or a string) and `response` (a string or one
assistant message), from parquet or JSONL. Each example is the templated prompt followed by the response and eos;
the loss mask covers the response tokens only."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hfjax.data.records import DataError, parse_messages, parse_response, read_rows, require
from hfjax.data.tokenize import (
    Batch,
    batch_width,
    check_options,
    clip,
    encode_prompts,
    encode_responses,
    keep_within,
    pad,
    pad_token_id,
    padded_tensors,
)


class SFTDataset:
    """Prompt + response sequences of at most `max_length` tokens.

    `collate` gives `input_ids`, `attention_mask`, `position_ids` and `loss_mask` (int32), padded on `padding_side`.
    `loss_mask[b, t] = 1` where token t belongs to the response (eos included): the trainer scores the logits at
    t - 1 against token t there. `truncation` (`error | filter | left | right`) applies to the whole sequence;
    `left` cuts the prompt's start, `right` the response's end.
    """

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        *,
        max_length: int,
        truncation: str = "error",
        padding_side: str = "right",
        pad_to: str = "max_length",
    ):
        check_options(max_length, truncation, pad_to)
        self.max_length, self.padding_side, self.pad_to = max_length, padding_side, pad_to
        self.pad_id = pad_token_id(tokenizer)
        rows = read_rows(files)
        refs = [ref for ref, _ in rows]
        prompts = [parse_messages(require(row, ref, "prompt"), ref, "prompt") for ref, row in rows]
        responses = [parse_response(require(row, ref, "response"), ref, "response") for ref, row in rows]
        prompt_ids, response_ids = encode_prompts(tokenizer, refs, prompts), encode_responses(tokenizer, responses)
        lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
        kept = keep_within(lengths, refs, max_length, truncation, "prompt + response")
        self.num_filtered = len(rows) - len(kept)
        self.input_ids = [clip(np.concatenate([prompt_ids[i], response_ids[i]]), max_length, truncation) for i in kept]
        self.loss_mask = [
            clip(np.repeat(np.int32([0, 1]), [len(prompt_ids[i]), len(response_ids[i])]), max_length, truncation)
            for i in kept
        ]
        if not self.input_ids:
            raise DataError(f"no examples left in {files} (read {len(rows)} rows, filtered {self.num_filtered})")

    def __len__(self) -> int:
        return len(self.input_ids)

    def collate(self, indices: Sequence[int]) -> Batch:
        """A padded batch of the examples at `indices` (see the class docstring)."""
        seqs = [self.input_ids[int(i)] for i in indices]
        width = batch_width([len(s) for s in seqs], self.max_length, self.pad_to)
        tensors = padded_tensors(seqs, width, self.pad_id, self.padding_side)
        tensors["loss_mask"] = pad([self.loss_mask[int(i)] for i in indices], width, 0, self.padding_side)[0]
        return Batch(tensors=tensors, non_tensors={})
