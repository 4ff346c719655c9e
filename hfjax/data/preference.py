"""Preference datasets for reward-model training: rows with `prompt` (chat messages or a string), `chosen` and
`rejected` (each a response string or one assistant message), from parquet or JSONL. Each side is the templated
prompt followed by the response and eos."""

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
    pad_token_id,
    padded_tensors,
)

SIDES = ("chosen", "rejected")


class PreferenceDataset:
    """(prompt, chosen, rejected) pairs of at most `max_length` tokens per side.

    `collate` gives `chosen_input_ids`, `chosen_attention_mask`, `chosen_position_ids` and the same three for
    `rejected`, all padded on `padding_side` to one width, so both sides can be stacked into one forward pass.
    `truncation` (`error | filter | left | right`) applies to each side; `filter` drops the pair if either side is
    too long.
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
        chosen = [parse_response(require(row, ref, "chosen"), ref, "chosen") for ref, row in rows]
        rejected = [parse_response(require(row, ref, "rejected"), ref, "rejected") for ref, row in rows]
        prompt_ids = encode_prompts(tokenizer, refs, prompts)
        full = {
            side: [np.concatenate(pr) for pr in zip(prompt_ids, encode_responses(tokenizer, texts), strict=True)]
            for side, texts in zip(SIDES, (chosen, rejected), strict=True)
        }
        longest = [max(len(c), len(r)) for c, r in zip(full["chosen"], full["rejected"], strict=True)]
        kept = keep_within(longest, refs, max_length, truncation, "longer side (prompt + response)")
        self.num_filtered = len(rows) - len(kept)
        self.sequences = {side: [clip(full[side][i], max_length, truncation) for i in kept] for side in SIDES}
        if not kept:
            raise DataError(f"no pairs left in {files} (read {len(rows)} rows, filtered {self.num_filtered})")

    def __len__(self) -> int:
        return len(self.sequences["chosen"])

    def collate(self, indices: Sequence[int]) -> Batch:
        """A padded batch of the pairs at `indices` (see the class docstring)."""
        seqs = {side: [self.sequences[side][int(i)] for i in indices] for side in SIDES}
        width = batch_width([len(s) for side in SIDES for s in seqs[side]], self.max_length, self.pad_to)
        tensors: dict[str, np.ndarray] = {}
        for side in SIDES:
            tensors |= padded_tensors(seqs[side], width, self.pad_id, self.padding_side, prefix=f"{side}_")
        return Batch(tensors=tensors, non_tensors={})
