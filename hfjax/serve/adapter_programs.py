"""The jitted programs of the service's adapters over one frozen base: target-token log probs, the Tinker losses
and their gradient in the adapter's parameters, and the Adam step; and the padding of a call's sequences into the
shapes those programs compile for (rows and length rounded up to powers of two, so a service compiles a handful of
shapes, not one per call).

The losses are sums over tokens, as Tinker defines them (a client scales by its own weights / advantages):
- `cross_entropy`: -sum(weights * logp(target))
- `importance_sampling`: -sum(exp(logp - sampler_logp) * advantages)
- `ppo`: -sum(min(r * A, clip(r, clip_low_threshold, clip_high_threshold) * A)), r = exp(logp - sampler_logp),
  thresholds 0.8 and 1.2 unless the call's `loss_fn_config` says otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hfjax.models.program import program_layout
from hfjax.parallel.layout import Layout
from hfjax.serve.backend import AdamStep, ServeError, TrainDatum

PPO_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
LOSS_INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
}
MIN_LENGTH = 16


def _bucket(n: int, least: int) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


@dataclasses.dataclass
class PaddedBatch:
    """A call's sequences right-padded to [rows, length] (`mask` 1 on real tokens); `lengths` the real ones."""

    arrays: dict[str, np.ndarray]
    lengths: list[int]


def pad_data(data: Sequence[TrainDatum], loss_fn: str, vocab_size: int, max_tokens: int, row_multiple: int
             ) -> PaddedBatch:  # fmt: skip
    """Checks every datum (lengths agree, token ids in the vocabulary, the loss's inputs present) and pads them;
    raises `ServeError` naming the first bad datum and field."""
    if not data:
        raise ServeError("data: expected at least one datum, got none")
    needed = LOSS_INPUTS[loss_fn]
    lengths = []
    for i, datum in enumerate(data):
        n = len(datum.tokens)
        if n == 0:
            raise ServeError(f"data[{i}].model_input: expected at least one token, got none")
        if n > max_tokens:
            raise ServeError(f"data[{i}].model_input: {n} tokens exceed the server's max_train_tokens {max_tokens}")
        for name in needed:
            if name == "weights" and name not in datum.inputs:
                continue  # cross_entropy without weights: every token counts once
            if name not in datum.inputs:
                raise ServeError(
                    f"data[{i}].loss_fn_inputs: loss {loss_fn!r} needs {name!r}; got {sorted(datum.inputs)}"
                )
            if len(datum.inputs[name]) != n:
                raise ServeError(
                    f"data[{i}].loss_fn_inputs[{name!r}]: {len(datum.inputs[name])} values for {n} input tokens"
                )
        for name, ids in (
            ("model_input", datum.tokens),
            ("loss_fn_inputs['target_tokens']", datum.inputs["target_tokens"]),
        ):
            ids = np.asarray(ids)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ServeError(
                    f"data[{i}].{name}: token ids must lie in [0, {vocab_size}); got {ids.min()}..{ids.max()}"
                )
        lengths.append(n)
    rows = _bucket(len(data), row_multiple)
    rows += -rows % row_multiple
    length = _bucket(max(lengths), MIN_LENGTH)
    arrays = {
        "tokens": np.zeros((rows, length), np.int32),
        "mask": np.zeros((rows, length), np.float32),
        "target_tokens": np.zeros((rows, length), np.int32),
        "weights": np.zeros((rows, length), np.float32),
        "logprobs": np.zeros((rows, length), np.float32),
        "advantages": np.zeros((rows, length), np.float32),
    }
    for i, (datum, n) in enumerate(zip(data, lengths, strict=True)):
        arrays["tokens"][i, :n] = datum.tokens
        arrays["mask"][i, :n] = 1.0
        arrays["weights"][i, :n] = datum.inputs.get("weights", np.ones(n))
        for name in ("target_tokens", "logprobs", "advantages"):
            if name in datum.inputs:
                arrays[name][i, :n] = datum.inputs[name]
    return PaddedBatch(arrays, lengths)


def loss_config(loss_fn: str, config: dict | None) -> tuple[float, float]:
    """The PPO clip thresholds of a call (unused by the other losses); raises `ServeError` on unknown keys."""
    config = dict(config or {})
    unknown = sorted(set(config) - set(PPO_CLIP)) if loss_fn == "ppo" else sorted(config)
    if unknown:
        expected = sorted(PPO_CLIP) if loss_fn == "ppo" else "none"
        raise ServeError(f"loss_fn_config: unknown keys {unknown} for loss {loss_fn!r}; expected {expected}")
    merged = {**PPO_CLIP, **{k: float(v) for k, v in config.items()}}
    if not 0 < merged["clip_low_threshold"] <= 1 <= merged["clip_high_threshold"]:
        raise ServeError(f"loss_fn_config: expected 0 < clip_low_threshold <= 1 <= clip_high_threshold, got {merged}")
    return merged["clip_low_threshold"], merged["clip_high_threshold"]


def _target_logprobs(model: nnx.Module, batch: dict[str, jax.Array]) -> jax.Array:
    mask = batch["mask"]
    hidden = model.model(batch["tokens"], mask)
    logp, _ = model.token_logprobs(hidden, batch["target_tokens"])
    return logp * mask


def _loss(logp: jax.Array, batch: dict[str, jax.Array], loss_fn: str, clip: jax.Array) -> jax.Array:
    if loss_fn == "cross_entropy":
        per_token = -batch["weights"] * logp
    else:
        ratio = jnp.exp(logp - batch["logprobs"])
        advantages = batch["advantages"]
        per_token = -ratio * advantages
        if loss_fn == "ppo":
            per_token = -jnp.minimum(ratio * advantages, jnp.clip(ratio, clip[0], clip[1]) * advantages)
    return jnp.sum(per_token * batch["mask"])


class AdapterPrograms:
    """The jitted programs over `layout` (its mesh holds the base and every adapter)."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self._logprobs = jax.jit(self._logprobs_fn, static_argnums=0)
        self._loss_and_grad = jax.jit(self._loss_and_grad_fn, static_argnums=(0, 4))
        self._forward_loss = jax.jit(self._forward_loss_fn, static_argnums=(0, 4))
        self.add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))
        self.adam = jax.jit(_adam)

    def _logprobs_fn(self, graphdef: Any, lora: Any, rest: Any, batch: dict[str, jax.Array]) -> jax.Array:
        with program_layout(self.layout):
            return _target_logprobs(nnx.merge(graphdef, lora, rest), batch)

    def _loss_and_grad_fn(self, graphdef: Any, lora: Any, rest: Any, batch: dict, loss_fn: str, clip: jax.Array
                          ) -> tuple[tuple[jax.Array, jax.Array], Any]:  # fmt: skip
        def loss(trained: Any) -> tuple[jax.Array, jax.Array]:
            logp = _target_logprobs(nnx.merge(graphdef, trained, rest), batch)
            return _loss(logp, batch, loss_fn, clip), logp

        with program_layout(self.layout):
            return jax.value_and_grad(loss, has_aux=True)(lora)

    def _forward_loss_fn(self, graphdef: Any, lora: Any, rest: Any, batch: dict, loss_fn: str, clip: jax.Array
                         ) -> tuple[jax.Array, jax.Array]:  # fmt: skip
        with program_layout(self.layout):
            logp = _target_logprobs(nnx.merge(graphdef, lora, rest), batch)
            return _loss(logp, batch, loss_fn, clip), logp

    def target_logprobs(self, graphdef: Any, lora: Any, rest: Any, batch: dict[str, jax.Array]) -> jax.Array:
        """[rows, length] log probs of `batch["target_tokens"]` (0 on padding)."""
        return self._logprobs(graphdef, lora, rest, batch)

    def loss(self, graphdef: Any, lora: Any, rest: Any, batch: dict, loss_fn: str, clip: jax.Array, backward: bool
             ) -> tuple[jax.Array, jax.Array, Any]:  # fmt: skip
        """(loss, logp [rows, length], gradient in `lora` or None)."""
        if backward:
            (loss, logp), grads = self._loss_and_grad(graphdef, lora, rest, batch, loss_fn, clip)
            return loss, logp, grads
        loss, logp = self._forward_loss(graphdef, lora, rest, batch, loss_fn, clip)
        return loss, logp, None


def _adam(params: Any, grads: Any, m: Any, v: Any, count: jax.Array, hyper: jax.Array) -> tuple[Any, ...]:
    """One AdamW step (decoupled weight decay, bias-corrected moments) after clipping the global gradient norm to
    `hyper[5]` when it is > 0; `hyper` = [lr, beta1, beta2, eps, weight_decay, grad_clip_norm]. Returns (params, m, v,
    count, norm before clipping)."""
    lr, b1, b2, eps, wd, clip = (hyper[i] for i in range(6))
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    scale = jnp.where((clip > 0) & (norm > clip), clip / jnp.maximum(norm, 1e-30), 1.0)
    count = count + 1
    m = jax.tree.map(lambda m_, g: b1 * m_ + (1 - b1) * g * scale, m, grads)
    v = jax.tree.map(lambda v_, g: b2 * v_ + (1 - b2) * jnp.square(g * scale), v, grads)
    m_correction, v_correction = 1 - b1**count, 1 - b2**count

    def step(p: jax.Array, m_: jax.Array, v_: jax.Array) -> jax.Array:
        return p - lr * ((m_ / m_correction) / (jnp.sqrt(v_ / v_correction) + eps) + wd * p)

    return jax.tree.map(step, params, m, v), m, v, count, norm


def adam_hyper(step: AdamStep) -> np.ndarray:
    """`_adam`'s hyperparameter vector; raises `ServeError` on values outside their range."""
    checks = (
        ("learning_rate", step.learning_rate >= 0),
        ("beta1", 0 <= step.beta1 < 1),
        ("beta2", 0 <= step.beta2 < 1),
        ("eps", step.eps >= 0),
        ("weight_decay", step.weight_decay >= 0),
        ("grad_clip_norm", step.grad_clip_norm >= 0),
    )
    for name, ok in checks:
        if not ok:
            raise ServeError(f"adam_params.{name}: {getattr(step, name)!r} is out of range", status=422)
    values = (step.learning_rate, step.beta1, step.beta2, step.eps, step.weight_decay, step.grad_clip_norm)
    return np.asarray(values, np.float32)
