"""Supervised fine-tuning (`hfjax sft CONFIG [key=value ...]`): masked next-token loss on the response tokens of
prompt/response pairs (`hfjax.data.SFTDataset`), token-mean over the whole step's response tokens (so micro-batch
accumulation equals the whole batch), padded to `data.max_length`. Held-out metrics: `val/loss` (token-mean NLL)
and `val/token_accuracy` (greedy next-token matches). The loop, checkpoints and export are `supervised.py`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hfjax.algos import agg_loss, logprobs_from_logits
from hfjax.config.supervised import DataSection, SFTConfig
from hfjax.data import SFTDataset
from hfjax.trainer.supervised import (
    ROW_WEIGHT,
    Objective,
    cli_main,
    run_supervised,
)


def _load(files: Sequence[str], tokenizer: Any, data: DataSection) -> SFTDataset:
    return SFTDataset(files, tokenizer, max_length=data.max_length, truncation=data.truncation)


def _token_logprobs(model: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(log p of each next token, the argmax prediction, the mask of scored positions), all [b, t - 1], from the
    whole logits (validation only: it needs the argmax)."""
    # the padded vocabulary's logits (its padding columns masked: never the argmax, nothing in the log-sum-exp), so
    # that a tensor-sharded vocabulary is not re-cut to the HF size
    hidden = model.model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])[:, :-1]
    logits = model.logits(hidden)
    targets = batch["input_ids"][:, 1:]
    return logprobs_from_logits(logits, targets), jnp.argmax(logits, -1) == targets, batch["loss_mask"][:, 1:]


def sft_loss(model: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """This micro-batch's response-token NLL sum / the step's response tokens (`global_tokens`), the log probs a
    chunk of tokens at a time (no [b, t, vocab] logits)."""
    hidden = model.model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])[:, :-1]
    logp, _ = model.token_logprobs(hidden, batch["input_ids"][:, 1:])
    mask = batch["loss_mask"][:, 1:]
    return agg_loss(-logp, mask, "token-mean", global_tokens=batch["global_tokens"][0]), {}


def _normalisers(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    tokens = float(tensors["loss_mask"][:, 1:].sum())
    return {"global_tokens": np.full(len(tensors["loss_mask"]), tokens, np.float32)}


def _eval_sums(model: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    logp, correct, mask = _token_logprobs(model, batch)
    weight = mask * batch[ROW_WEIGHT][:, None]
    return {"nll": -jnp.sum(logp * weight), "correct": jnp.sum(correct * weight), "tokens": jnp.sum(weight)}


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
