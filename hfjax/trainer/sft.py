"""Supervised fine-tuning (`hfjax sft CONFIG [key=value ...]`): masked next-token loss on the response tokens of
prompt/response pairs (`hfjax.data.SFTDataset`), token-mean over the whole step's response tokens (so micro-batch
accumulation equals the whole batch), padded to `data.max_length`. Held-out metrics: `val/loss` (token-mean NLL)
and `val/token_accuracy` (greedy next-token matches), the logits made a chunk of tokens at a time as in the training
loss (never the [b, t, vocab] logits: validation needs no more memory than a training step). The loop, checkpoints
and export are `supervised.py`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hfjax.algos import agg_loss, logprobs_from_logits
from hfjax.config.supervised import DataSection, SFTConfig
from hfjax.data import SFTDataset
from hfjax.models.lm_head import LOGITS_CHUNK_TOKENS, chunk_length
from hfjax.trainer.supervised import (
    ROW_WEIGHT,
    Objective,
    cli_main,
    run_supervised,
)


def _load(files: Sequence[str], tokenizer: Any, data: DataSection, processor: Any) -> SFTDataset:
    options = {"max_length": data.max_length, "truncation": data.truncation}
    return SFTDataset(files, tokenizer, processor=processor, **options)


def _hidden(model: Any, batch: dict[str, jax.Array]) -> jax.Array:
    """Hidden states of every position but the last: a vision-language model's with the rows' `images` read at their
    prompts' placeholders (every placeholder is a prompt's: the dataset refuses none in responses)."""
    if "images" not in batch:
        return model.model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])[:, :-1]
    ids, mask, positions = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    return model.hidden(ids, mask, positions, images=batch["images"])[:, :-1]


def sft_loss(model: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """This micro-batch's response-token NLL sum / the step's response tokens (`global_tokens`), the log probs a
    chunk of tokens at a time (no [b, t, vocab] logits)."""
    hidden = _hidden(model, batch)
    logp, _ = model.token_logprobs(hidden, batch["input_ids"][:, 1:])
    mask = batch["loss_mask"][:, 1:]
    return agg_loss(-logp, mask, "token-mean", global_tokens=batch["global_tokens"][0]), {}


def _normalisers(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    tokens = float(tensors["loss_mask"][:, 1:].sum())
    return {"global_tokens": np.full(len(tensors["loss_mask"]), tokens, np.float32)}


def chunked_eval_sums(
    logits_fn: Callable[[jax.Array], jax.Array],
    hidden: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    chunk: int,
) -> tuple[jax.Array, jax.Array]:
    """(sum of weights * -log p(target), sum of weights * [argmax == target]) over [rows, length] positions, from the
    logits `logits_fn(hidden[:, chunk positions])` [rows, chunk, vocab] float32 of `chunk` positions at a time in a
    scan (as `hfjax.models.lm_head.token_logprobs`): never the [rows, length, vocab] logits."""
    rows, length = targets.shape
    chunk = max(1, min(chunk, length))
    pad = -length % chunk

    def split(x: jax.Array) -> jax.Array:  # [rows, length, ...] -> [chunks, rows, chunk, ...], zero-padded
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.swapaxes(x.reshape(rows, -1, chunk, *x.shape[2:]), 0, 1)

    def body(sums: tuple[jax.Array, jax.Array], xs: tuple[jax.Array, ...]) -> tuple[tuple[jax.Array, jax.Array], None]:
        h, y, w = xs
        logits = logits_fn(h)  # the padding positions' hidden states are zero: finite logits, weight 0
        nll = -jnp.sum(w * logprobs_from_logits(logits, y))
        return (sums[0] + nll, sums[1] + jnp.sum(w * (jnp.argmax(logits, -1) == y))), None

    zero = jnp.zeros((), jnp.float32)
    sums, _ = jax.lax.scan(body, (zero, zero), (split(hidden), split(targets), split(weights.astype(jnp.float32))))
    return sums


def _eval_sums(model: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The held-out sums of the NLL, the greedy next-token matches and the tokens scored (weighted by the rows'
    `ROW_WEIGHT`), the logits a chunk of tokens at a time like the training loss's (`chunked_eval_sums`)."""
    hidden = _hidden(model, batch)
    weights = batch["loss_mask"][:, 1:] * batch[ROW_WEIGHT][:, None]
    # the padded vocabulary's logits (its padding columns masked: never the argmax, nothing in the log-sum-exp), so
    # that a tensor-sharded vocabulary is not re-cut to the HF size
    chunk = chunk_length(LOGITS_CHUNK_TOKENS, hidden.shape[0])
    nll, correct = chunked_eval_sums(model.logits, hidden, batch["input_ids"][:, 1:], weights, chunk)
    return {"nll": nll, "correct": correct, "tokens": jnp.sum(weights)}


def _summarize(sums: Mapping[str, float]) -> dict[str, float]:
    tokens = max(sums["tokens"], 1.0)
    return {"val/loss": sums["nll"] / tokens, "val/token_accuracy": sums["correct"] / tokens}


SFT_OBJECTIVE = Objective(
    name="sft",
    head="causal_lm",
    load_dataset=_load,
    normalisers=_normalisers,
    loss_fn=sft_loss,
    eval_fn=_eval_sums,
    summarize=_summarize,
    tokens=lambda tensors: int(tensors["attention_mask"].sum()),
)


def run_sft(cfg: SFTConfig) -> dict[str, float]:
    """Fine-tunes `cfg.model.path` on `cfg.data`; checkpoints, metrics and the HF export go to `trainer.run_dir`.
    Returns the last step's metrics (`train/*`, and `val/*` when `data.val_files` is set)."""
    return run_supervised(cfg, SFT_OBJECTIVE)


def sft_main(config_path: str, overrides: list[str]) -> int:
    """`hfjax sft CONFIG [key=value ...]`."""
    return cli_main(SFTConfig, run_sft, config_path, overrides)
