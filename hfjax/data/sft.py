"""Supervised fine-tuning datasets: rows with `prompt` (chat messages or a string) and `response` (a string or one
assistant message), from parquet or JSONL. Each example is the templated prompt followed by the response and eos;
the loss mask covers the response tokens only. With a vision-language checkpoint's processor, prompts may carry
images as RL prompts do (verl's multimodal schema, `hfjax.data.images`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hfjax.data.prompts import MAX_IMAGES, batch_images
from hfjax.data.records import DataError, RowRef, parse_messages, parse_response, read_rows, require
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
    With a vision-language checkpoint's `processor`, a row's `images` (at most `max_images`) are decoded and its
    prompt rendered and tokenized by the processor, and batches carry the pixel values (`images`, `image_counts`:
    `batch_images`); a sequence with images is never truncated (its image tokens would be cut).
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
        processor: Any = None,
        max_images: int = MAX_IMAGES,
    ):
        check_options(max_length, truncation, pad_to)
        self.max_length, self.padding_side, self.pad_to = max_length, padding_side, pad_to
        self.pad_id = pad_token_id(tokenizer)
        rows = read_rows(files)
        refs = [ref for ref, _ in rows]
        prompts = [parse_messages(require(row, ref, "prompt"), ref, "prompt") for ref, row in rows]
        responses = [parse_response(require(row, ref, "response"), ref, "response") for ref, row in rows]
        response_ids = encode_responses(tokenizer, responses)
        self.images: list[np.ndarray | None] = [None] * len(rows)
        if processor is None:
            prompt_ids = encode_prompts(tokenizer, refs, prompts)
        else:
            prompt_ids, self.images = _processed_prompts(processor, rows, prompts, max_images)
            placeholder = processor.tokenizer.image_token_id  # read as an image wherever it stands
            for ref, ids in zip(refs, response_ids, strict=True):
                if placeholder in ids:
                    raise DataError(f"{ref}: field 'response': holds the image placeholder token; expected text only")
        lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
        kept = keep_within(lengths, refs, max_length, truncation, "prompt + response")
        for i in kept:
            if self.images[i] is not None and lengths[i] > max_length:
                raise DataError(
                    f"{refs[i]}: prompt + response has {lengths[i]} tokens with its images, more than {max_length}; "
                    "a sequence with images is not truncated (set truncation to filter, or raise max_length)"
                )
        self.images = [self.images[i] for i in kept]
        self.with_images = processor is not None
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
        if self.with_images:
            tensors.update(batch_images([self.images[int(i)] for i in indices]))
        return Batch(tensors=tensors, non_tensors={})


def _processed_prompts(
    processor: Any, rows: Sequence[tuple[RowRef, dict[str, Any]]], prompts: Sequence[list[dict]], max_images: int
) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
    """Each row's prompt token ids, image placeholders included, and pixel values (None: no images) by `processor`."""
    from hfjax.data.images import decode_images, process_prompt

    ids, images = [], []
    for (ref, row), messages in zip(rows, prompts, strict=True):
        _, row_ids, pixels = process_prompt(processor, messages, decode_images(row.get("images"), ref, max_images), ref)
        ids.append(row_ids)
        images.append(pixels if len(pixels) else None)
    return ids, images
