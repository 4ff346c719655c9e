"""Reward-model training (`hfjax rm CONFIG [key=value ...]`): a `SequenceClassifier` with one label (a causal-LM
checkpoint gets a fresh score head; an RM checkpoint keeps its own) trained on preference pairs
(`hfjax.data.PreferenceDataset`) with the Bradley-Terry loss `-log sigmoid(r_chosen - r_rejected)`, averaged over
the step's pairs. Both sides of a pair run in one forward pass; the score is read at each side's last real token.
Metrics: `train/accuracy` (r_chosen > r_rejected), `train/margin`; held out: `val/loss`, `val/accuracy`,
`val/margin`, `val/chosen_score`, `val/rejected_score`. The loop, checkpoints and export are `supervised.py`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hfjax.config.supervised import DataSection, RMConfig
from hfjax.data import PreferenceDataset
from hfjax.trainer.supervised import (
    ROW_WEIGHT,
    Objective,
    cli_main,
    run_supervised,
)

SIDES = ("chosen", "rejected")


def _load(files: Sequence[str], tokenizer: Any, data: DataSection, processor: None) -> PreferenceDataset:
    # processor: always None (a vision-language checkpoint is refused as a reward model before the data loads)
    return PreferenceDataset(files, tokenizer, max_length=data.max_length, truncation=data.truncation)


def pair_scores(model: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(r_chosen, r_rejected) [b] from one forward pass over both sides stacked on the batch axis."""
    stacked = [jnp.concatenate([batch[f"{side}_{key}"] for side in SIDES]) for key in ("input_ids", "attention_mask")]
    positions = jnp.concatenate([batch[f"{side}_position_ids"] for side in SIDES])
    scores = model(stacked[0], stacked[1], positions)
    if scores.shape[-1] != 1:  # a static shape: raised while tracing
        raise ValueError(f"reward model: expected a score head with num_labels=1, got {scores.shape[-1]} labels")
    scores = scores[:, 0]
    rows = batch["chosen_input_ids"].shape[0]
    return scores[:rows], scores[rows:]


def rm_loss(model: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Sum over this micro-batch's pairs of -log sigmoid(margin) / the step's pairs (`global_pairs`)."""
    chosen, rejected = pair_scores(model, batch)
    margin = chosen - rejected
    loss = -jnp.sum(jax.nn.log_sigmoid(margin)) / batch["global_pairs"][0]
    return loss, {"accuracy": jnp.mean(margin > 0), "margin": jnp.mean(margin)}


def _normalisers(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    rows = len(tensors["chosen_input_ids"])
    return {"global_pairs": np.full(rows, float(rows), np.float32)}


def _eval_sums(model: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    chosen, rejected = pair_scores(model, batch)
    weight, margin = batch[ROW_WEIGHT], chosen - rejected
    return {
        "pairs": jnp.sum(weight),
        "loss": -jnp.sum(jax.nn.log_sigmoid(margin) * weight),
        "correct": jnp.sum((margin > 0) * weight),
        "margin": jnp.sum(margin * weight),
        "chosen": jnp.sum(chosen * weight),
        "rejected": jnp.sum(rejected * weight),
    }


def _summarize(sums: Mapping[str, float]) -> dict[str, float]:
    pairs = max(sums["pairs"], 1.0)
    names = {"loss": "loss", "correct": "accuracy", "margin": "margin", "chosen": "chosen_score"}
    names["rejected"] = "rejected_score"
    return {f"val/{name}": sums[key] / pairs for key, name in names.items()}


RM_OBJECTIVE = Objective(
    name="rm",
    head="seq_cls",
    load_dataset=_load,
    normalisers=_normalisers,
    loss_fn=rm_loss,
    eval_fn=_eval_sums,
    summarize=_summarize,
    tokens=lambda tensors: int(sum(tensors[f"{side}_attention_mask"].sum() for side in SIDES)),
)


def run_rm(cfg: RMConfig) -> dict[str, float]:
    """Trains a reward model from `cfg.model.path` on preference pairs; checkpoints, metrics and the HF export
    (`*ForSequenceClassification`, one label) go to `trainer.run_dir`. Returns the last step's metrics."""
    return run_supervised(cfg, RM_OBJECTIVE)


def rm_main(config_path: str, overrides: list[str]) -> int:
    """`hfjax rm CONFIG [key=value ...]`."""
    return cli_main(RMConfig, run_rm, config_path, overrides)
