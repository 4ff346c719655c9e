"""Tokenization shared by the prompt, SFT and preference datasets: the chat template, the over-length policy
(`error | filter | left | right`), padding to numpy batches with position ids, and the `Batch` they produce.
The tokenizer is any transformers tokenizer passed in."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np

from hfjax.data.records import DataError, RowRef

log = logging.getLogger(__name__)

Truncation = Literal["error", "filter", "left", "right"]
TRUNCATIONS: tuple[str, ...] = get_args(Truncation)
PAD_TO: tuple[str, ...] = ("max_length", "longest")


@dataclass(frozen=True)
class Batch:
    """A collated batch: `tensors` are numpy arrays with a leading batch axis; `non_tensors` are object arrays of the
    same length (strings, messages, dicts), as in verl's `DataProto.batch` / `non_tensor_batch`."""

    tensors: dict[str, np.ndarray]
    non_tensors: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))


def object_array(values: Sequence[Any]) -> np.ndarray:
    """A 1-D object array holding `values` as they are (lists and dicts are not turned into extra axes)."""
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def render_prompt(tokenizer: Any, messages: list[dict[str, str]], ref: RowRef) -> str:
    """The prompt text: `tokenizer.apply_chat_template(messages, add_generation_prompt=True)` as a string."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja and transformers raise various types
        raise DataError(f"{ref}: the tokenizer's chat template failed on this prompt ({exc})") from exc


def encode(tokenizer: Any, texts: Sequence[str]) -> list[np.ndarray]:
    """Token ids of each text, without added special tokens (a rendered chat template already has them)."""
    if not texts:
        return []
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return [np.asarray(x, dtype=np.int32) for x in ids]


def eos_ids(tokenizer: Any) -> np.ndarray:
    """The end-of-sequence token appended to every response."""
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos_token_id; responses need one to end")
    return np.asarray([tokenizer.eos_token_id], dtype=np.int32)


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, else its eos id."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise DataError("the tokenizer has neither pad_token_id nor eos_token_id to pad with")
    return int(pad)


def check_options(max_length: int, truncation: str, pad_to: str) -> None:
    """Validates a dataset's maximum length, truncation mode and padded width mode."""
    if not isinstance(max_length, int) or max_length < 1:
        raise DataError(f"max length: expected a positive int, got {max_length!r}")
    if truncation not in TRUNCATIONS:
        raise DataError(f"truncation: expected one of {TRUNCATIONS}, got {truncation!r}")
    if pad_to not in PAD_TO:
        raise DataError(f"pad_to: expected one of {PAD_TO}, got {pad_to!r}")


def keep_within(
    lengths: Sequence[int], refs: Sequence[RowRef], max_length: int, truncation: str, what: str
) -> list[int]:
    """Indices of the examples to keep under the over-length policy: `error` raises on the first example longer than
    `max_length`, `filter` drops those (and logs how many), `left`/`right` keep all (the caller clips them)."""
    over = [i for i, n in enumerate(lengths) if n > max_length]
    if over and truncation == "error":
        i = over[0]
        raise DataError(
            f"{refs[i]}: {what} has {lengths[i]} tokens, more than {max_length} "
            f"({len(over)} such rows; set truncation to filter, left or right to accept them)"
        )
    if over and truncation == "filter":
        log.warning(
            "filtered %d of %d rows whose %s is longer than %d tokens", len(over), len(lengths), what, max_length
        )
        dropped = set(over)
        return [i for i in range(len(lengths)) if i not in dropped]
    return list(range(len(lengths)))


def clip(ids: np.ndarray, max_length: int, truncation: str) -> np.ndarray:
    """The first (`right`: cut the end) or last (`left`: cut the start) `max_length` entries; others unchanged."""
    if len(ids) <= max_length:
        return ids
    if truncation == "left":
        return ids[len(ids) - max_length :]
    if truncation == "right":
        return ids[:max_length]
    raise DataError(f"cannot clip a sequence of {len(ids)} to {max_length} under truncation={truncation!r}")


def pad(seqs: Sequence[np.ndarray], width: int, value: int, side: str) -> tuple[np.ndarray, np.ndarray]:
    """Stacks sequences into a `[len(seqs), width]` int32 array padded with `value` on the `left` or `right`, and the
    matching attention mask (1 on real tokens)."""
    if side not in ("left", "right"):
        raise DataError(f"padding side: expected 'left' or 'right', got {side!r}")
    out = np.full((len(seqs), width), value, dtype=np.int32)
    mask = np.zeros((len(seqs), width), dtype=np.int32)
    for row, s in enumerate(seqs):
        if len(s) > width:
            raise DataError(f"a sequence of {len(s)} tokens does not fit the padded width {width}")
        cols = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        out[row, cols] = s
        mask[row, cols] = 1
    return out, mask


def position_ids(mask: np.ndarray) -> np.ndarray:
    """Position of each real token among the real tokens of its row (0 at the first one); 0 on padding."""
    return np.where(mask > 0, np.cumsum(mask, axis=-1) - 1, 0).astype(np.int32)


def batch_width(lengths: Sequence[int], max_length: int, pad_to: str) -> int:
    """Padded width: `max_length` (fixed shapes, one compilation) or the batch's longest sequence (`longest`)."""
    return max_length if pad_to == "max_length" else max(lengths, default=0)


def padded_tensors(
    seqs: Sequence[np.ndarray], width: int, pad_id: int, side: str, prefix: str = ""
) -> dict[str, np.ndarray]:
    """`{prefix}input_ids`, `{prefix}attention_mask`, `{prefix}position_ids` for the padded sequences."""
    ids, mask = pad(seqs, width, pad_id, side)
    return {f"{prefix}input_ids": ids, f"{prefix}attention_mask": mask, f"{prefix}position_ids": position_ids(mask)}


def encode_prompts(tokenizer: Any, refs: Sequence[RowRef], prompts: Sequence[list[dict[str, str]]]) -> list[np.ndarray]:
    """Token ids of each prompt rendered with the chat template and its generation prompt."""
    return encode(tokenizer, [render_prompt(tokenizer, m, ref) for m, ref in zip(prompts, refs, strict=True)])


def encode_responses(tokenizer: Any, responses: Sequence[str]) -> list[np.ndarray]:
    """Token ids of each response followed by eos. Prompts and responses are tokenized separately (as verl's SFT
    data is), so no token spans the prompt/response boundary."""
    eos = eos_ids(tokenizer)
    return [np.concatenate([r, eos]) for r in encode(tokenizer, responses)]
