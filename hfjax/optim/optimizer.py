"""Optimizer settings and their optax transformation: AdamW with a linear warm-up and an optional cosine decay.

The learning rate is an injected hyperparameter (`optax.inject_hyperparams`), so the rate used by the last update
can be read back from the optimizer state (`TrainState` logs it). Gradient clipping is not part of the
transformation: `TrainState` clips by global norm itself, so it can log the norm and skip non-finite steps.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
import optax

Schedule = Literal["constant", "cosine"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)


@dataclasses.dataclass
class OptimConfig:
    """AdamW (decoupled weight decay on every parameter) with global-norm clipping at `grad_clip` (0 disables it).

    The learning rate of update `s` (0-based count of applied updates) is `lr * min(1, (s + 1) / warmup_steps)`
    during the warm-up (so the first update already moves), then `lr` (`constant`) or a cosine from `lr` down to
    `min_lr_ratio * lr` over the remaining `total_steps - warmup_steps` updates (`cosine`).
    """

    lr: float = 1e-5
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0
    schedule: Schedule = "constant"
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        checks = (
            ("lr", self.lr > 0, "> 0"),
            ("weight_decay", self.weight_decay >= 0, ">= 0"),
            ("b1", 0 <= self.b1 < 1, "in [0, 1)"),
            ("b2", 0 <= self.b2 < 1, "in [0, 1)"),
            ("eps", self.eps > 0, "> 0"),
            ("grad_clip", self.grad_clip >= 0, ">= 0 (0 disables clipping)"),
            ("warmup_steps", isinstance(self.warmup_steps, int) and self.warmup_steps >= 0, "an int >= 0"),
            ("schedule", self.schedule in SCHEDULES, f"one of {SCHEDULES}"),
            ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
        )
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"optim.{name}: expected {expected}, got {getattr(self, name)!r}")


def learning_rate_schedule(cfg: OptimConfig, total_steps: int | None) -> Callable[[jax.Array], jax.Array]:
    """The learning rate as a function of the count of applied updates (see `OptimConfig`)."""
    if cfg.schedule == "cosine" and (total_steps is None or total_steps < 1):
        raise ValueError(f"optim.schedule='cosine' needs the run's total_steps (a positive int), got {total_steps!r}")
    warmup = cfg.warmup_steps
    decay_steps = max(1, (total_steps or 0) - warmup)

    def schedule(count: jax.Array) -> jax.Array:
        count = jnp.asarray(count, jnp.float32)
        ramp = jnp.minimum(1.0, (count + 1.0) / warmup) if warmup else jnp.float32(1.0)
        if cfg.schedule == "constant":
            return cfg.lr * ramp
        progress = jnp.clip((count - warmup) / decay_steps, 0.0, 1.0)
        cosine = cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + jnp.cos(math.pi * progress))
        return cfg.lr * jnp.where(count < warmup, ramp, cosine)

    return schedule


def make_optimizer(cfg: OptimConfig, total_steps: int | None) -> optax.GradientTransformation:
    """AdamW over `learning_rate_schedule(cfg, total_steps)`, the rate injected into the state (no clipping).

    Equal settings return the same transformation object, so the jitted programs keyed by it are shared."""
    return _optimizer(dataclasses.astuple(cfg), total_steps if cfg.schedule == "cosine" else None)


@functools.lru_cache(maxsize=64)
def _optimizer(fields: tuple[Any, ...], total_steps: int | None) -> optax.GradientTransformation:
    cfg = OptimConfig(*fields)
    return optax.inject_hyperparams(optax.adamw)(
        learning_rate=learning_rate_schedule(cfg, total_steps),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )


def current_learning_rate(opt_state: optax.OptState) -> jax.Array | None:
    """The learning rate of the last update from an injected-hyperparameter state (None for other states)."""
    hyperparams = getattr(opt_state, "hyperparams", None)
    return hyperparams.get("learning_rate") if isinstance(hyperparams, dict) else None
