"""KL penalties between the policy and the reference policy (k1, abs, k2, k3, and their straight-through "+" forms)
and the KL coefficient controllers.

`kl_penalty` is pure `jax.numpy` (runs in jitted steps and on numpy arrays); the controllers are small host-side
objects whose state is a dict of floats (`state_dict` / `load_state_dict`) for checkpoints.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BASE_KL_KINDS = ("k1", "abs", "k2", "k3")
STRAIGHT_THROUGH = "+"  # suffix: the estimator's value with k2's gradient (verl's "k1+", "k3+", ...)
KL_KINDS = (*BASE_KL_KINDS, *(kind + STRAIGHT_THROUGH for kind in BASE_KL_KINDS))
# verl's names for the same estimators (kl_penalty: kl | abs | mse | low_var_kl, each also with "+").
KL_ALIASES = {
    alias + suffix: kind + suffix
    for alias, kind in {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}.items()
    for suffix in ("", STRAIGHT_THROUGH)
}
K3_LOG_RATIO_CLAMP = 20.0  # |ref_logprob - logprob| is clamped to this before exp, for stability
K3_CLAMP = 10.0  # the k3 estimate is clamped to [-10, 10]


def _estimate(logprob: jax.Array, ref_logprob: jax.Array, kind: str) -> jax.Array:
    if kind == "k1":
        return logprob - ref_logprob
    if kind == "abs":
        return jnp.abs(logprob - ref_logprob)
    if kind == "k2":
        return 0.5 * jnp.square(logprob - ref_logprob)
    log_ratio = jnp.clip(ref_logprob - logprob, -K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return jnp.clip(jnp.exp(log_ratio) - log_ratio - 1, -K3_CLAMP, K3_CLAMP)


def kl_penalty(logprob: jax.Array, ref_logprob: jax.Array, kind: str = "k1") -> jax.Array:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log probs (Schulman's k1/k2/k3).

    k1: logp - ref; abs: |logp - ref|; k2: (logp - ref)^2 / 2; k3: exp(ref - logp) - (ref - logp) - 1 with the log
    ratio clamped to [-20, 20] and the result to [-10, 10]. A "+" form (k1+, k3+, ...) has the value of its
    estimator and the gradient of k2, whose expected gradient is the KL's (a straight-through estimator, as in
    verl). verl's names kl, mse, low_var_kl (and kl+, mse+, low_var_kl+) are accepted.
    """
    name = KL_ALIASES.get(kind, kind)
    if name not in KL_KINDS:
        raise ValueError(f"unknown KL penalty kind {kind!r}; expected one of {list(KL_KINDS) + list(KL_ALIASES)}")
    logprob, ref_logprob = jnp.asarray(logprob), jnp.asarray(ref_logprob)
    value = _estimate(logprob, ref_logprob, name.removesuffix(STRAIGHT_THROUGH))
    if not name.endswith(STRAIGHT_THROUGH):
        return value
    gradient_carrier = _estimate(logprob, ref_logprob, "k2")
    return jax.lax.stop_gradient(value) + gradient_carrier - jax.lax.stop_gradient(gradient_carrier)


class FixedKLController:
    """A constant KL coefficient `value`."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Does nothing: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = _restored_value(state, type(self).__name__)


class AdaptiveKLController:
    """The KL coefficient of Ziegler et al. (arXiv 1909.08593), steering the measured KL toward `target_kl`.

    After a batch of `n_steps` samples with mean KL `current_kl`:
    `value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon`.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = _restored_value(state, type(self).__name__)


def _restored_value(state: dict[str, float], owner: str) -> float:
    if set(state) != {"value"}:
        raise ValueError(f"{owner} state must have exactly the key 'value', got keys {sorted(state)}")
    return float(state["value"])


def make_kl_controller(
    kind: str, *, kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> FixedKLController | AdaptiveKLController:
    """A controller from config: kind "fixed" (kl_coef) or "adaptive" (kl_coef as initial value, target_kl, horizon)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError(f"adaptive KL controller needs target_kl and horizon, got {target_kl=}, {horizon=}")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller kind {kind!r}; expected 'fixed' or 'adaptive'")
