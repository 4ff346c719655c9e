"""SFT validation (`val/loss`, `val/token_accuracy`) makes the logits a chunk of positions at a time, as the training
loss does: its compiled temporaries are at most the training step's where the [rows, length, vocab] logits would
dominate (a tiny model with a large vocabulary and long sequences, compiled, never run), and its metrics equal a
hand-written numpy reference on the whole logits."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from support.tiny_models import TINY, compiled_forward, random_model

from hfjax.models.hf import abstract_model
from hfjax.optim.train_state import frozen, grad_program
from hfjax.trainer.sft import SFT_OBJECTIVE, sft_loss
from hfjax.trainer.supervised import ROW_WEIGHT
from hfjax.xla_settings import FORWARD_COMPILER_OPTIONS

MiB = 2**20


def _batch_spec(rows: int, length: int) -> dict[str, jax.ShapeDtypeStruct]:
    ints = jax.ShapeDtypeStruct((rows, length), jnp.int32)
    rows_f32 = jax.ShapeDtypeStruct((rows,), jnp.float32)
    return {
        "input_ids": ints,
        "attention_mask": ints,
        "position_ids": ints,
        "loss_mask": ints,
        "global_tokens": rows_f32,
        ROW_WEIGHT: rows_f32,
    }


def test_validation_temporaries_are_at_most_the_training_steps():
    """8 x 1024 tokens of a one-layer model, embed 32, vocabulary 32,768: one float32 [rows, length, vocab] tensor
    is 1 GiB, the training step's chunked loss and gradient a small part of it."""
    cfg = dataclasses.replace(TINY, vocab_size=32_768, max_position_embeddings=1024)
    graphdef, params, rest = nnx.split(abstract_model(cfg, "causal_lm"), nnx.Param, ...)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    batch = _batch_spec(8, 1024)

    train = grad_program().lower(
        params,
        rest,
        batch,
        graphdef=graphdef,
        loss_fn=sft_loss,
        static=(),
        shardings=frozen(jax.tree.map(lambda _: one, params)),
        layout=None,
    )

    def validation(p, r, b):
        return SFT_OBJECTIVE.eval_fn(nnx.merge(graphdef, p, r), b)

    val = jax.jit(validation, compiler_options=FORWARD_COMPILER_OPTIONS).lower(params, rest, batch)
    train_temp, val_temp = (p.compile().memory_analysis().temp_size_in_bytes for p in (train, val))
    full_logits = 4 * 8 * 1023 * cfg.padded_vocab_size
    print(f"temporaries: validation {val_temp / MiB:.0f} MiB, training step {train_temp / MiB:.0f} MiB")
    assert train_temp < full_logits / 2, (train_temp / MiB, full_logits / MiB)  # the shape is the one meant
    assert val_temp <= train_temp, (val_temp / MiB, train_temp / MiB)


def _reference(logits: np.ndarray, batch: dict[str, np.ndarray]) -> dict[str, float]:
    """The validation sums from the whole logits [rows, length, vocab] (float64): weighted NLL of each next token,
    weighted greedy matches, weighted tokens."""
    z = logits[:, :-1].astype(np.float64)
    targets = batch["input_ids"][:, 1:]
    top = z.max(-1, keepdims=True)
    logsumexp = top[..., 0] + np.log(np.exp(z - top).sum(-1))
    picked = np.take_along_axis(z, targets[..., None], -1)[..., 0]
    weights = batch["loss_mask"][:, 1:] * batch[ROW_WEIGHT][:, None]
    correct = z.argmax(-1) == targets
    return {
        "nll": float(np.sum(weights * (logsumexp - picked))),
        "correct": float(np.sum(weights * correct)),
        "tokens": float(np.sum(weights)),
    }


def test_chunked_validation_sums_equal_the_whole_logits_reference():
    """Three rows of 601 tokens: the default chunk (170 positions at three rows) leaves a partial last chunk; the
    vocabulary (100) is padded to 128 columns; one row is a padding row (weight 0), and the loss mask skips prompts
    and right padding."""
    cfg = dataclasses.replace(TINY, vocab_size=100, max_position_embeddings=1024)
    model = random_model(cfg, seed=1)
    rows, length = 3, 601
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (rows, length)).astype(np.int32)
    ends = np.array([length, 450, 520])
    positions = np.arange(length)
    attention = (positions < ends[:, None]).astype(np.int32)
    loss_mask = attention * (positions >= np.array([10, 200, 3])[:, None])
    batch = {
        "input_ids": ids,
        "attention_mask": attention,
        "position_ids": np.broadcast_to(positions, (rows, length)).astype(np.int32),
        "loss_mask": loss_mask.astype(np.int32),
        ROW_WEIGHT: np.array([1.0, 1.0, 0.0], np.float32),
    }
    inputs = (jnp.asarray(batch[k]) for k in ("input_ids", "attention_mask", "position_ids"))
    logits = np.asarray(compiled_forward(model, *inputs))
    assert logits.shape == (rows, length, cfg.vocab_size)
    want = _reference(logits, batch)
    graphdef, state = nnx.split(model)
    got = jax.jit(lambda s, b: SFT_OBJECTIVE.eval_fn(nnx.merge(graphdef, s), b))(state, batch)
    got = {k: float(v) for k, v in jax.device_get(got).items()}
    assert want["correct"] > 0  # the accuracy compared is not trivially zero
    assert got["tokens"] == want["tokens"] and got["correct"] == want["correct"], (got, want)
    np.testing.assert_allclose(got["nll"], want["nll"], rtol=1e-6)
