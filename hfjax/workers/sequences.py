"""The RL batch layout shared by every role: left-padded prompts [B, P] followed by right-padded responses [B, R].

`input_ids = [prompt | response]`, `attention_mask` 1 on real tokens, `position_ids = cumsum(mask) - 1`, and
`response_mask` 1 on real response tokens. The logits that predict response token j sit at sequence index P - 1 + j,
so every role reads `[:, -R - 1 : -1]` of its per-token outputs, whatever P and R are: a micro-batch may drop the
columns that are padding in all of its rows (`trim_padding`) and still be read the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from hfjax.data.tokenize import position_ids
from hfjax.envs.trajectory import agent_columns
from hfjax.optim.train_state import split_rows
from hfjax.parallel.global_arrays import process_reduce
from hfjax.rollout import prefill_buckets
from hfjax.rollout.generator import SampleOutput

SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids")  # [B, P + R]; `prompts` is [B, P], the rest [B, R]
# The experts each mixture-of-experts layer chose for each token at generation [B, P + R, moe layers, k], -1 where
# none (padding, each response's last token): `actor.router_replay`
ROUTED_EXPERTS = "routed_experts"
# A vision-language policy's pixel values per row [B, images per row, channels, height, width] (a row with fewer
# images pads with any, never read), read in place of the prompt's image placeholders by every pass over the rows
IMAGES = "images"


def prompt_token_lists(input_ids: np.ndarray, attention_mask: np.ndarray) -> list[np.ndarray]:
    """The real tokens of each left-padded prompt row."""
    return [row[mask.astype(bool)] for row, mask in zip(input_ids, attention_mask, strict=True)]


def _routed_experts(masks: np.ndarray, outputs: Sequence[SampleOutput], response_length: int) -> np.ndarray:
    """`ROUTED_EXPERTS` of the rows: each output's recorded experts (its prompt's, then its response's but the last
    token's) aligned with the left-padded prompts and the responses, -1 elsewhere."""
    width = masks.shape[1]
    first = next(out.experts for out in outputs if out.experts is not None)
    routed = np.full((len(outputs), width + response_length, *first.shape[1:]), -1, first.dtype)
    for i, out in enumerate(outputs):
        if out.experts is not None:
            prompt = int(masks[i].sum())
            routed[i, width - prompt : width - prompt + len(out.experts)] = out.experts
    return routed


def assemble(
    prompt_ids: np.ndarray,
    prompt_mask: np.ndarray,
    outputs: Sequence[SampleOutput],
    n: int,
    response_length: int,
    pad_id: int,
) -> dict[str, np.ndarray]:
    """Tensors of the rollout batch: each prompt row repeated `n` times (interleaved, the order `outputs` come in)
    and joined with its responses, padded to `response_length`; `rollout_versions` when the outputs carry the policy
    version of each token. Multi-turn trajectories (`hfjax.envs.trajectory.Trajectory`) keep their environment
    tokens in the response with `response_mask` 0 and add `env_rewards` (each token's reward from the environment); a
    trajectory whose environment gave its own first prompt has that prompt in its row."""
    rows = len(outputs)
    responses = np.full((rows, response_length), pad_id, np.int32)
    response_mask = np.zeros((rows, response_length), np.int32)
    attention = np.zeros((rows, response_length), np.int32)
    logprobs = np.zeros((rows, response_length), np.float32)
    for i, out in enumerate(outputs):
        length = len(out.tokens)
        responses[i, :length] = out.tokens
        attention[i, :length] = 1
        response_mask[i, :length] = getattr(out, "response_mask", 1)
        logprobs[i, :length] = out.logprobs
    prompts = np.repeat(prompt_ids, n, axis=0).astype(np.int32)
    masks = np.repeat(prompt_mask, n, axis=0).astype(np.int32)
    own = [getattr(out, "prompt", None) for out in outputs]
    if any(p is not None and len(p) for p in own):
        prompts, masks = _own_prompts(prompts, masks, own, pad_id)
    attention_mask = np.concatenate([masks, attention], axis=1)
    batch = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": np.concatenate([prompts, responses], axis=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids(attention_mask),
        "rollout_log_probs": logprobs,
    }
    if any(hasattr(out, "rewards") for out in outputs):
        rewards = np.zeros((rows, response_length), np.float32)
        for i, out in enumerate(outputs):
            rewards[i, : len(out.rewards)] = out.rewards
        batch["env_rewards"] = rewards
        batch.update(agent_columns(outputs))
    if any(out.experts is not None for out in outputs):
        batch[ROUTED_EXPERTS] = _routed_experts(masks, outputs, response_length)
    if any(out.versions is not None for out in outputs):  # partial rollouts: each token's policy version (-1: none)
        versions = np.full((rows, response_length), -1, np.int32)
        for i, out in enumerate(outputs):
            versions[i, : len(out.tokens)] = out.versions
        batch["rollout_versions"] = versions
    return batch


def _own_prompts(
    prompts: np.ndarray, masks: np.ndarray, own: list[np.ndarray | None], pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded prompt rows where row i is `own[i]` when given (else its row of `prompts`), as wide as the
    widest."""
    rows = [
        p if p is not None and len(p) else row[mask.astype(bool)]
        for p, row, mask in zip(own, prompts, masks, strict=True)
    ]
    width = max(prompts.shape[1], max(len(r) for r in rows))
    out, out_mask = np.full((len(rows), width), pad_id, np.int32), np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        out[i, width - len(row) :], out_mask[i, width - len(row) :] = row, 1
    return out, out_mask


def response_slice(per_token: jax.Array, response_length: int) -> jax.Array:
    """The outputs at the positions that predict the response tokens: [:, -R - 1 : -1]."""
    return per_token[:, -response_length - 1 : -1]


def content_lengths(batch: dict[str, np.ndarray], response_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Real prompt tokens and real response tokens of each row (from `attention_mask`)."""
    mask = np.asarray(batch["attention_mask"])
    split = mask.shape[1] - response_length
    return mask[:, :split].sum(axis=1), mask[:, split:].sum(axis=1)


def padded_lengths(lengths: np.ndarray, limit: int) -> np.ndarray:
    """The shortest padded lengths (`prefill_buckets`: at most a third of one is padding) that hold `lengths` tokens
    (at least 1)."""
    buckets = np.asarray(prefill_buckets(limit))
    return buckets[np.searchsorted(buckets, np.maximum(lengths, 1))]


def length_order(batch: dict[str, np.ndarray], response_length: int) -> np.ndarray:
    """A row order that puts rows of similar lengths next to each other, so that consecutive micro-batches trim well:
    by padded response length, then by prompt length."""
    prompts, responses = content_lengths(batch, response_length)
    return np.lexsort((prompts, padded_lengths(responses, response_length)))


def trimmed_chunks(
    batch: dict[str, np.ndarray], rows: int, response_length: int
) -> tuple[np.ndarray, list[dict[str, np.ndarray]]]:
    """(`length_order` of the rows, `split_rows` chunks of `rows` rows in that order, each `trim_padding`ed). In a
    group of several processes the k-th chunks of all processes are one global micro-batch: their widths are agreed
    (the widest) so that every process runs the same shapes."""
    order = length_order(batch, response_length)
    chunks = split_rows({k: np.asarray(v)[order] for k, v in batch.items()}, rows)
    widths = process_reduce([trimmed_widths(chunk, response_length) for chunk in chunks], "max")
    return order, [trim_padding(chunk, response_length, tuple(w)) for chunk, w in zip(chunks, widths, strict=True)]


def trimmed_widths(batch: dict[str, np.ndarray], response_length: int) -> tuple[int, int]:
    """(prompt columns, response columns) that `trim_padding` keeps: the longest real prompt and the longest real
    response, each rounded up to a padded length (so a few shapes compile)."""
    prompts, responses = content_lengths(batch, response_length)
    split = batch["attention_mask"].shape[1] - response_length
    return int(padded_lengths(prompts.max(), split)), int(padded_lengths(responses.max(), response_length))


def trim_padding(
    batch: dict[str, np.ndarray], response_length: int, widths: tuple[int, int] | None = None
) -> dict[str, np.ndarray]:
    """`batch` without the columns that are padding in every row: `widths` (default `trimmed_widths`) prompt and
    response columns are kept. Real tokens keep their positions and attend to the same keys, so per-token results
    are those of the full width; the response-aligned arrays get the new response width."""
    split = batch["attention_mask"].shape[1] - response_length
    prompt_width, width = widths or trimmed_widths(batch, response_length)
    out = {}
    for key, value in batch.items():
        if key in SEQUENCE_KEYS or key == ROUTED_EXPERTS:
            out[key] = value[:, split - prompt_width : split + width]
        elif key == "prompts":
            out[key] = value[:, split - prompt_width :]
        elif key == IMAGES:
            out[key] = value
        elif np.ndim(value) >= 2:
            if value.shape[1] != response_length:
                raise ValueError(f"trim_padding: {key} has {value.shape[1]} columns, expected {response_length}")
            out[key] = value[:, :width]
        else:
            out[key] = value
    return out
