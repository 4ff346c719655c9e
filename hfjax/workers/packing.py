"""Padding-free micro-batches: the sequences of an RL batch packed several to a row by a token budget
(`packed_row_tokens`, verl's `ppo_max_token_len_per_gpu` with `use_dynamic_bsz`).

A packed micro-batch has one row of at most `packed_row_tokens` tokens per batch part of the layout (the rows split
over the data x fsdp shards; in a group of several processes each process packs its own parts). A sequence (a batch
row's real prompt and response tokens) lies whole in one packed row: `attention_mask` holds its segment id (1, 2, ...
along the row, 0 on padding) and `position_ids` its own positions, and attention never crosses segments
(`hfjax.models.attention.attention_mask`), so each real token sees what it saw in its padded row. A batch's
`routed_experts` (routing replay) are packed with their tokens.

The response-aligned arrays [B, R] (response_mask, advantages, old log probs, ...) keep one row per sequence,
[S, R'] (S = sequence rows per part x parts, R' = the longest response of the micro-batch, rounded up to a padded
length), so the losses are the unpacked ones, term for term. The model's per-position outputs are read where they
predict a response token (`PACKED_POSITIONS` [parts, T]: T response tokens per part, rounded), the LM head runs on
those T tokens only (`PACKED_LABELS`), and `to_response_rows` puts the results back as [S, R'] (`RESPONSE_INDEX`).
Shapes are rounded (widths to `prefill_buckets` lengths, sequence rows to powers of two), so few programs compile.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from hfjax.parallel.global_arrays import process_reduce
from hfjax.rollout import power_of_two_at_least
from hfjax.workers.sequences import ROUTED_EXPERTS, SEQUENCE_KEYS, content_lengths, padded_lengths, response_slice

PACKED_POSITIONS = "packed_positions"  # [parts, T] the packed index whose output predicts each response token
PACKED_LABELS = "packed_labels"  # [parts, T] that response token
RESPONSE_INDEX = "response_index"  # [S, R'] where sequence row s's response token j is among its part's T


def response_positions(per_position: jax.Array, batch: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(outputs [rows, T, ...] at the positions that predict response tokens, those tokens [rows, T]) for per-position
    outputs [rows, length, ...]: of a packed micro-batch the `PACKED_POSITIONS` of each part, else the last R + 1 .. 1
    positions of each row (`response_slice`) and `responses`."""
    if RESPONSE_INDEX not in batch:
        return response_slice(per_position, batch["responses"].shape[1]), batch["responses"]
    index = batch[PACKED_POSITIONS]
    index = index.reshape(index.shape + (1,) * (per_position.ndim - 2))
    return jnp.take_along_axis(per_position, index, axis=1), batch[PACKED_LABELS]


def to_response_rows(per_token: jax.Array, batch: Mapping[str, jax.Array]) -> jax.Array:
    """Per-token results of `response_positions` as [rows, R'] (one row per sequence, as the batch's response-aligned
    arrays): of a packed micro-batch read through `RESPONSE_INDEX` within each part; else unchanged."""
    if RESPONSE_INDEX not in batch:
        return per_token
    index = batch[RESPONSE_INDEX]
    parts = per_token.shape[0]
    return jnp.take_along_axis(per_token, index.reshape(parts, -1), axis=1).reshape(index.shape)


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Rows of at most `capacity` tokens holding the sequences of `lengths` (indices), longest first, each into the
    first row it fits; rows come fullest first."""
    rows: list[list[int]] = []
    loads: list[int] = []
    for i in np.argsort(-lengths, kind="stable"):
        length = int(lengths[i])
        for r, load in enumerate(loads):
            if load + length <= capacity:
                rows[r].append(int(i))
                loads[r] += length
                break
        else:
            rows.append([int(i)])
            loads.append(length)
    by_load = np.argsort(-np.asarray(loads), kind="stable")
    return [rows[r] for r in by_load]


def packed_micro_batches(
    batch: Mapping[str, np.ndarray], response_length: int, row_tokens: int, parts: int
) -> tuple[np.ndarray, list[dict[str, np.ndarray]]]:
    """(order, micro-batches): the sequences of `batch` (RL rows: left-padded prompts, right-padded responses of
    `response_length` columns) packed into rows of at most `row_tokens` tokens, `parts` rows per micro-batch (module
    docstring). `order` gives, for the sequence rows of the micro-batches in turn, the batch row each holds (-1: a
    padding row, response_mask 0). In a group of several processes the micro-batch count and shapes are agreed
    (every process runs the same programs; a process with fewer micro-batches runs empty ones)."""
    prompts, responses = content_lengths(batch, response_length)
    lengths = prompts + responses
    if len(lengths) and lengths.max() > row_tokens:
        raise ValueError(
            f"packed_row_tokens={row_tokens}: a sequence has {lengths.max()} tokens (prompt and response); expected "
            "packed_row_tokens >= the longest prompt + response_length"
        )
    rows = first_fit_decreasing(lengths, row_tokens)
    groups = [rows[i : i + parts] for i in range(0, len(rows), parts)]
    count = int(process_reduce(len(groups), "max"))
    groups += [[] for _ in range(count - len(groups))]
    shapes = [_shape(group, lengths, responses, row_tokens, response_length) for group in groups]
    shapes = process_reduce(shapes, "max").reshape(count, 4) if count else shapes
    order, micro_batches = [], []
    for group, shape in zip(groups, shapes, strict=True):
        rows_of_parts = group + [[] for _ in range(parts - len(group))]
        seq_rows, arrays = _pack(batch, rows_of_parts, response_length, prompts, responses, *map(int, shape))
        order.append(seq_rows)
        micro_batches.append(arrays)
    return (np.concatenate(order) if order else np.zeros(0, np.int64)), micro_batches


def _shape(
    group: list[list[int]], lengths: np.ndarray, responses: np.ndarray, row_tokens: int, response_length: int
) -> tuple[int, int, int, int]:
    """(packed width, response tokens per part, sequence rows per part, response columns) of a micro-batch, rounded."""
    width = max((int(lengths[row].sum()) for row in group), default=1)
    tokens = max((int(responses[row].sum()) for row in group), default=1)
    seqs = max((len(row) for row in group), default=1)
    longest = max((int(responses[row].max()) for row in group), default=1)
    return (
        int(padded_lengths(width, row_tokens)),
        int(padded_lengths(tokens, row_tokens)),
        power_of_two_at_least(seqs),
        int(padded_lengths(longest, response_length)),
    )


def _pack(
    batch: Mapping[str, np.ndarray],
    rows_of_parts: list[list[int]],
    response_length: int,
    prompts: np.ndarray,
    responses: np.ndarray,
    width: int,
    tokens: int,
    seqs: int,
    columns: int,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The arrays of one packed micro-batch (one packed row per part) and the batch row of each sequence row."""
    parts = len(rows_of_parts)
    split = batch["attention_mask"].shape[1] - response_length
    packed = {key: np.zeros((parts, width), np.asarray(batch[key]).dtype) for key in SEQUENCE_KEYS}
    if ROUTED_EXPERTS in batch:  # routing replay: each token's recorded experts go where the token goes (-1: none)
        routes = np.asarray(batch[ROUTED_EXPERTS])
        packed[ROUTED_EXPERTS] = np.full((parts, width, *routes.shape[2:]), -1, routes.dtype)
    positions, labels = np.zeros((parts, tokens), np.int32), np.zeros((parts, tokens), np.int32)
    response_index = np.zeros((parts * seqs, columns), np.int32)
    seq_rows = np.full(parts * seqs, -1)
    for part, members in enumerate(rows_of_parts):
        offset = token = 0
        for k, row in enumerate(members):
            prompt, response = int(prompts[row]), int(responses[row])
            start, stop = split - prompt, split + response
            for key in packed:
                packed[key][part, offset : offset + prompt + response] = batch[key][row, start:stop]
            packed["attention_mask"][part, offset : offset + prompt + response] = k + 1
            predicting = offset + prompt - 1 + np.arange(response)
            positions[part, token : token + response] = np.maximum(predicting, offset)
            labels[part, token : token + response] = batch["input_ids"][row, split : split + response]
            response_index[part * seqs + k, :response] = token + np.arange(response)
            seq_rows[part * seqs + k] = row
            offset, token = offset + prompt + response, token + response
    arrays: dict[str, np.ndarray] = {
        **packed,
        PACKED_POSITIONS: positions,
        PACKED_LABELS: labels,
        RESPONSE_INDEX: response_index,
    }
    source = np.where(seq_rows >= 0, seq_rows, 0)  # a padding sequence row copies row 0, with no response tokens
    for key, value in batch.items():
        if key in packed or key == "prompts":
            continue
        value = np.asarray(value)
        if value.ndim >= 2 and value.shape[1] != response_length:
            raise ValueError(f"packed micro-batches: {key} has {value.shape[1]} columns, expected {response_length}")
        arrays[key] = value[source, :columns] if value.ndim >= 2 else value[source]
    if "response_mask" in arrays:
        arrays["response_mask"] = np.where((seq_rows >= 0)[:, None], arrays["response_mask"], 0)
    return seq_rows, arrays
