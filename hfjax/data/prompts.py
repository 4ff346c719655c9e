"""RL prompt datasets in verl's schema: rows with `data_source`, `prompt` (chat messages), optional `ability`,
`reward_model` {style, ground_truth} and `extra_info`, read from parquet or JSONL. The chat template is applied with
the tokenizer, over-long prompts are filtered, truncated or rejected, and `collate` left-pads rows into numpy batches
with the non-tensor fields the reward functions need."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hfjax.data.records import (
    DataError,
    RowRef,
    parse_mapping,
    parse_messages,
    parse_str,
    read_rows,
    require,
)
from hfjax.data.tokenize import (
    Batch,
    batch_width,
    check_options,
    clip,
    encode,
    keep_within,
    object_array,
    pad_token_id,
    padded_tensors,
    render_prompt,
)

MAX_IMAGES = 4  # the datasets' default max_images: images a prompt row may carry (more: a one-line DataError)


@dataclass(frozen=True)
class PromptExample:
    """One prompt row, checked and tokenized. `uid` is the row's position in the files (stable across runs)."""

    ref: RowRef
    uid: str
    messages: list[dict[str, str]]
    data_source: str
    ability: str | None
    ground_truth: Any
    extra_info: dict[str, Any]
    text: str
    input_ids: np.ndarray
    images: np.ndarray | None = None  # pixel values [images, channels, height, width] (a processor's prompts)

    @property
    def index(self) -> Any:
        """`extra_info.index` when the row has one, else the uid."""
        index = self.extra_info.get("index")
        return self.uid if index is None else index


def parse_prompt_row(ref: RowRef, row: dict[str, Any]) -> dict[str, Any]:
    """The checked fields of one prompt row (see the module docstring for the schema)."""
    reward_model = parse_mapping(row.get("reward_model"), ref, "reward_model")
    ability = row.get("ability")
    prompt = require(row, ref, "prompt")
    messages = parse_messages(prompt, ref, "prompt")
    if not any(message["content"].strip() for message in messages):  # the model would answer nothing in particular
        raise ref.error("prompt", "a prompt with some text (every message's content is empty)", prompt)
    return {
        "messages": messages,
        "data_source": parse_str(require(row, ref, "data_source"), ref, "data_source"),
        "ability": None if ability is None else parse_str(ability, ref, "ability"),
        "ground_truth": reward_model.get("ground_truth"),
        "extra_info": parse_mapping(row.get("extra_info"), ref, "extra_info"),
    }


def tokenize_prompt_rows(
    tokenizer: Any, rows: Sequence[tuple[RowRef, dict[str, Any]]]
) -> tuple[list[dict[str, Any]], list[str], list[np.ndarray]]:
    """Each row's checked fields (`parse_prompt_row`), its text with the chat template and generation prompt, and
    that text's token ids: what `PromptDataset` holds of a row before the over-length policy."""
    fields = [parse_prompt_row(ref, row) for ref, row in rows]
    texts = [render_prompt(tokenizer, f["messages"], ref) for f, (ref, _) in zip(fields, rows, strict=True)]
    return fields, texts, encode(tokenizer, texts)


def process_image_rows(
    processor: Any, rows: Sequence[tuple[RowRef, dict[str, Any]]], max_images: int
) -> tuple[list[dict[str, Any]], list[str], list[np.ndarray], list[np.ndarray | None]]:
    """`tokenize_prompt_rows` of multimodal rows: each row's `images` decoded and its prompt run through the
    checkpoint's `processor` (`hfjax.data.images`); also each row's pixel values (None: a row without images)."""
    from hfjax.data.images import decode_images, process_prompt

    fields = [parse_prompt_row(ref, row) for ref, row in rows]
    texts, ids, images = [], [], []
    for f, (ref, row) in zip(fields, rows, strict=True):
        text, row_ids, pixels = process_prompt(
            processor, f["messages"], decode_images(row.get("images"), ref, max_images), ref
        )
        texts.append(text)
        ids.append(row_ids)
        images.append(pixels if len(pixels) else None)
    return fields, texts, ids, images


class PromptDataset:
    """Prompts from parquet/JSONL files, tokenized with the tokenizer's chat template (`add_generation_prompt=True`).

    `truncation`: `error` fails on a prompt longer than `max_prompt_length` (naming its file and row), `filter`
    drops such prompts (logs the count, kept in `num_filtered`), `left` keeps their last tokens, `right` their first.
    `pad_to`: `max_length` pads every batch to `max_prompt_length` (fixed shapes), `longest` to the batch's longest.
    With a vision-language checkpoint's `processor`, rows may carry `images` (verl's multimodal schema,
    `hfjax.data.images`, at most `max_images` each): the processor renders and tokenizes them, and batches carry the
    pixel values. A prompt with images is never truncated (its image tokens would be cut): an over-long one is an
    error, or filtered.
    """

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        *,
        max_prompt_length: int,
        truncation: str = "error",
        pad_to: str = "max_length",
        processor: Any = None,
        max_images: int = MAX_IMAGES,
    ):
        check_options(max_prompt_length, truncation, pad_to)
        self.max_prompt_length, self.truncation, self.pad_to = max_prompt_length, truncation, pad_to
        self.pad_id = pad_token_id(tokenizer)
        rows = read_rows(files)
        refs = [ref for ref, _ in rows]
        if processor is None:
            fields, texts, ids = tokenize_prompt_rows(tokenizer, rows)
            images: list[np.ndarray | None] = [None] * len(rows)
        else:
            fields, texts, ids, images = process_image_rows(processor, rows, max_images)
        self.with_images = processor is not None
        kept = keep_within([len(x) for x in ids], refs, max_prompt_length, truncation, "prompt")
        for i in kept:
            if images[i] is not None and len(ids[i]) > max_prompt_length:
                raise DataError(
                    f"{refs[i]}: prompt has {len(ids[i])} tokens with its images, more than {max_prompt_length}; "
                    "a prompt with images is not truncated (set truncation to filter, or raise max_prompt_length)"
                )
        self.num_filtered = len(rows) - len(kept)
        self.examples = [
            PromptExample(
                ref=refs[i],
                uid=str(i),
                text=texts[i],
                input_ids=clip(ids[i], max_prompt_length, truncation),
                images=images[i],
                **fields[i],
            )
            for i in kept
        ]
        if not self.examples:
            raise DataError(f"no prompts left in {files} (read {len(rows)} rows, filtered {self.num_filtered})")

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> PromptExample:
        return self.examples[i]

    def collate(self, indices: Sequence[int]) -> Batch:
        """Left-padded `input_ids`, `attention_mask`, `position_ids` (int32) and object arrays `raw_prompt`
        (messages), `prompt_text`, `data_source`, `ability`, `ground_truth`, `extra_info`, `index`, `uid`; with a
        processor also `images` and `image_counts` (`batch_images`)."""
        rows = [self.examples[int(i)] for i in indices]
        seqs = [r.input_ids for r in rows]
        width = batch_width([len(s) for s in seqs], self.max_prompt_length, self.pad_to)
        non_tensors = {
            "raw_prompt": [r.messages for r in rows],
            "prompt_text": [r.text for r in rows],
            "data_source": [r.data_source for r in rows],
            "ability": [r.ability for r in rows],
            "ground_truth": [r.ground_truth for r in rows],
            "extra_info": [r.extra_info for r in rows],
            "index": [r.index for r in rows],
            "uid": [r.uid for r in rows],
        }
        tensors = padded_tensors(seqs, width, self.pad_id, "left")
        if self.with_images:
            tensors.update(batch_images([r.images for r in rows]))
        return Batch(tensors=tensors, non_tensors={k: object_array(v) for k, v in non_tensors.items()})


def batch_images(images: Sequence[np.ndarray | None]) -> dict[str, np.ndarray]:
    """The rows' pixel values as `images` [rows, images per row, channels, height, width] float32 (images per row:
    the most any row has, rounded up to a power of two, so that batch shapes stay few; zeros past a row's own) and
    `image_counts` [rows] int32; no images anywhere: images per row 0."""
    counts = np.asarray([0 if x is None else len(x) for x in images], np.int32)
    shape = next((x.shape[1:] for x in images if x is not None), (0, 0, 0))
    per_row = 0 if not counts.max(initial=0) else 1 << int(counts.max() - 1).bit_length()
    out = np.zeros((len(images), per_row, *shape), np.float32)
    for i, x in enumerate(images):
        if x is not None:
            out[i, : len(x)] = x
    return {"images": out, "image_counts": counts}
