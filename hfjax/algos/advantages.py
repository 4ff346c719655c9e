"""Advantage estimators (GAE, GRPO / Dr.GRPO, RLOO, REINFORCE++, REINFORCE++ with baseline, ReMax, OPO) and their
registry, following verl's formulas so that results compare one to one; `group_estimators` and `token_baselines`
add verl's other estimators to the same registry.

`compute_advantage(name, ...)` dispatches by name, or loads `path/to/file.py:function` (a user estimator, checked by
`check_estimator` like a registered one). Estimators that only look at tokens (`gae`, `reinforce_plus_plus`,
`remax`) are pure `jax.numpy` and run under `jax.jit`. Estimators that group responses by prompt (`grpo`, `rloo`,
`reinforce_plus_plus_baseline`, `opo`) take `index`, one hashable id per row (a numpy int or object array, a list),
and turn it into dense group ids with Python on the host; the arithmetic after that is `jax.numpy`. Call those on
the controller, outside `jit`. All return `(advantages, returns)` of shape (bs, T) as jax arrays.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hfjax.algos.masked import masked_whiten
from hfjax.algos.registry import Registry

GROUP_STD_EPS = 1e-6  # added to a group's std before dividing (GRPO)

AdvantageEstimator = Callable[..., tuple[jax.Array, jax.Array]]
# What compute_advantage can hand to an estimator; an estimator names the ones it uses as parameters.
ESTIMATOR_INPUTS = (
    "token_level_rewards",
    "response_mask",
    "values",
    "index",
    "reward_baselines",
    "gamma",
    "lam",
    "norm_adv_by_std",
    "old_log_probs",
    "sum_pi_squared",
    "rollout_is_weights",
    "reward_components",
    "reward_component_weights",
)


def check_estimator(label: str, fn: AdvantageEstimator) -> None:
    """Raises ValueError unless `fn`'s parameters are a subset of `ESTIMATOR_INPUTS`, all passable by keyword."""
    try:
        params = inspect.signature(fn).parameters.values()
    except ValueError:  # no signature to inspect: nothing to check
        return
    unknown = [
        p.name for p in params if p.name not in ESTIMATOR_INPUTS or p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL)
    ]
    if unknown:
        raise ValueError(
            f"advantage estimator {label!r} ({getattr(fn, '__name__', fn)}) has parameters {unknown} that "
            f"compute_advantage does not supply; expected keyword parameters from {list(ESTIMATOR_INPUTS)}"
        )


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator", check_estimator)


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator registering `fn(**inputs) -> (advantages, returns)` under `name` for `compute_advantage`.

    `fn`'s parameters must be a subset of `ESTIMATOR_INPUTS` (`check_estimator`); compute_advantage passes exactly
    those, and refuses to call it when a parameter without a default was given as None. A user estimator given as
    `path/to/file.py:function` (e.g. `algorithm.adv_estimator`) follows the same rules without registering.
    """
    return ADVANTAGE_ESTIMATORS.register(name)


def advantage_estimators() -> list[str]:
    """Names of the registered advantage estimators."""
    return ADVANTAGE_ESTIMATORS.names()


def required_inputs(estimator: str) -> list[str]:
    """The `ESTIMATOR_INPUTS` that the estimator `estimator` (a name or `path.py:function`) needs: its parameters
    without a default."""
    params = inspect.signature(ADVANTAGE_ESTIMATORS.get(estimator)).parameters.values()
    return [p.name for p in params if p.default is inspect.Parameter.empty]


def compute_advantage(
    estimator: str,
    *,
    token_level_rewards: jax.Array,
    response_mask: jax.Array,
    values: jax.Array | None = None,
    index: Sequence[Hashable] | np.ndarray | None = None,
    reward_baselines: jax.Array | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std: bool = True,
    old_log_probs: jax.Array | None = None,
    sum_pi_squared: jax.Array | None = None,
    rollout_is_weights: jax.Array | None = None,
    reward_components: jax.Array | None = None,
    reward_component_weights: Sequence[float] | np.ndarray | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Advantages and returns, both (bs, T), by the estimator `estimator` (a registered name or `path.py:function`).

    token_level_rewards, response_mask, values: (bs, T); index: (bs,) group ids (any hashable, host-side);
    reward_baselines: (bs,) (ReMax's greedy-response reward); `norm_adv_by_std=False` turns GRPO into Dr.GRPO.
    For the optimal token baselines: old_log_probs (bs, T), sum_pi_squared (bs, T) (sum over the vocabulary of the
    squared token probabilities, `sum_pi_squared_from_logits`), rollout_is_weights (bs, T) (optional). For GDPO:
    reward_components (bs, K), one score per row and reward component, and reward_component_weights (K,).
    """
    fn = ADVANTAGE_ESTIMATORS.get(estimator)
    rewards = jnp.asarray(token_level_rewards)
    if not jnp.issubdtype(rewards.dtype, jnp.floating):
        rewards = rewards.astype(jnp.float32)
    if rewards.ndim != 2:
        raise ValueError(f"token_level_rewards must be (batch, length), got shape {rewards.shape}")
    _check_shape("response_mask", response_mask, rewards.shape)
    _check_shape("values", values, rewards.shape)
    _check_shape("reward_baselines", reward_baselines, rewards.shape[:1])
    for name, array in (
        ("old_log_probs", old_log_probs),
        ("sum_pi_squared", sum_pi_squared),
        ("rollout_is_weights", rollout_is_weights),
    ):
        _check_shape(name, array, rewards.shape)
    if reward_components is not None:
        _check_shape("reward_components", reward_components, (rewards.shape[0], np.shape(reward_components)[-1]))
    if reward_component_weights is not None:
        components = None if reward_components is None else np.shape(reward_components)[-1]
        _check_shape("reward_component_weights", reward_component_weights, (components,))
    if index is not None and len(index) != rewards.shape[0]:
        raise ValueError(f"index has {len(index)} entries, expected one per row ({rewards.shape[0]})")
    supplied = dict(
        token_level_rewards=rewards,
        response_mask=response_mask,
        values=values,
        index=index,
        reward_baselines=reward_baselines,
        gamma=gamma,
        lam=lam,
        norm_adv_by_std=norm_adv_by_std,
        old_log_probs=old_log_probs,
        sum_pi_squared=sum_pi_squared,
        rollout_is_weights=rollout_is_weights,
        reward_components=reward_components,
        reward_component_weights=reward_component_weights,
    )
    params = inspect.signature(fn).parameters
    for name, param in params.items():
        if supplied[name] is None and param.default is inspect.Parameter.empty:
            raise ValueError(f"advantage estimator {estimator!r} needs `{name}`, which was not given")
    return fn(**{name: supplied[name] for name in params})


def _check_shape(name: str, array: jax.Array | None, expected: tuple[int, ...]) -> None:
    if array is not None and tuple(np.shape(array)) != tuple(expected):
        raise ValueError(f"{name} has shape {tuple(np.shape(array))}, expected {tuple(expected)}")


def float_mask(rewards: jax.Array, response_mask: jax.Array) -> jax.Array:
    """`response_mask` in the dtype of `rewards`."""
    return jnp.asarray(response_mask).astype(rewards.dtype)


def _reverse_time_scan(step: Callable, init: jax.Array | tuple[jax.Array, ...], *rows: jax.Array) -> jax.Array:
    """Runs `step(carry, per-step slices) -> (carry, out)` from the last time step to the first; returns (bs, T)."""
    _, out = jax.lax.scan(step, init, tuple(jnp.moveaxis(r, -1, 0) for r in rows), reverse=True)
    return jnp.moveaxis(out, 0, -1)


@jax.jit
def _gae(rewards: jax.Array, values: jax.Array, mask: jax.Array, gamma: jax.Array, lam: jax.Array) -> jax.Array:
    def step(carry, xs):
        next_value, last_gae = carry
        reward, value, valid = xs
        gae = reward + gamma * next_value - value + gamma * lam * last_gae
        # A masked position keeps the value and advantage of the next valid one (verl skips observation tokens).
        next_value = value * valid + (1 - valid) * next_value
        last_gae = gae * valid + (1 - valid) * last_gae
        return (next_value, last_gae), last_gae

    zeros = jnp.zeros(rewards.shape[:1], rewards.dtype)
    return _reverse_time_scan(step, (zeros, zeros), rewards, values, mask)


@register_advantage_estimator("gae")
def gae_advantage(token_level_rewards, values, response_mask, gamma, lam):
    """Generalised advantage estimation; returns = raw advantages + values, advantages whitened over the mask."""
    rewards = token_level_rewards
    mask = float_mask(rewards, response_mask)
    values = jnp.asarray(values, rewards.dtype)
    advantages = _gae(rewards, values, mask, jnp.asarray(gamma, rewards.dtype), jnp.asarray(lam, rewards.dtype))
    return masked_whiten(advantages, mask), advantages + values


@jax.jit
def _discounted_returns(rewards: jax.Array, mask: jax.Array, gamma: jax.Array) -> jax.Array:
    def step(running, xs):
        reward, valid = xs
        candidate = reward + gamma * running
        # A masked position (an observation between turns) returns 0 and passes the running return through
        # unchanged: a later turn's reward reaches earlier turns, discounted once per valid token (verl 0.9.1).
        return candidate * valid + running * (1 - valid), candidate * valid

    return _reverse_time_scan(step, jnp.zeros(rewards.shape[:1], rewards.dtype), rewards, mask)


@register_advantage_estimator("reinforce_plus_plus")
def reinforce_plus_plus_advantage(token_level_rewards, response_mask, gamma):
    """REINFORCE++: discounted returns to go over the valid tokens (masked positions return 0, add no reward and
    no discount step), whitened over the mask (advantages masked)."""
    rewards = token_level_rewards
    mask = float_mask(rewards, response_mask)
    returns = _discounted_returns(rewards, mask, jnp.asarray(gamma, rewards.dtype))
    return masked_whiten(returns, mask) * mask, returns


@register_advantage_estimator("remax")
def remax_advantage(token_level_rewards, response_mask, reward_baselines):
    """ReMax: masked returns to go minus the greedy response's reward (`reward_baselines`, (bs,)) on valid tokens."""
    rewards = token_level_rewards
    mask = float_mask(rewards, response_mask)
    returns = jnp.flip(jnp.cumsum(jnp.flip(rewards * mask, -1), -1), -1)
    return returns - jnp.asarray(reward_baselines, rewards.dtype)[:, None] * mask, returns


def group_ids(index: Sequence[Hashable] | np.ndarray) -> tuple[np.ndarray, int]:
    """Dense ids 0..G-1 (in order of first appearance) for per-row group keys of any hashable type, and G."""
    keys = np.asarray(index).tolist() if isinstance(index, np.ndarray | jax.Array) else list(index)
    dense: dict[Hashable, int] = {}
    try:
        ids = np.array([dense.setdefault(key, len(dense)) for key in keys], dtype=np.int32)
    except TypeError as err:
        raise ValueError(f"index entries must be hashable group ids, one per row: {err}") from None
    return ids, len(dense)


class GroupStats(NamedTuple):
    """Per-row statistics of a row's group (all (bs,)), with verl's conventions for a group of one."""

    scores: jax.Array  # the row's summed token rewards
    size: jax.Array  # responses in the group
    mean: jax.Array  # group mean score; 0 for a group of one
    std: jax.Array  # unbiased group std; 1 for a group of one
    length_weighted_mean: jax.Array  # sum(len * score) / sum(len); 0 for a group of one or with no valid token


@partial(jax.jit, static_argnames="num_groups")
def _group_stats_jit(rewards: jax.Array, mask: jax.Array, ids: jax.Array, num_groups: int) -> GroupStats:
    def group_total(per_row):
        return jax.ops.segment_sum(per_row, ids, num_segments=num_groups)[ids]

    scores = jnp.sum(rewards, axis=-1)  # verl sums every position: rewards outside the mask are expected to be 0
    lengths = jnp.sum(mask, axis=-1)
    size = group_total(jnp.ones_like(scores))
    several = size > 1
    full_mean = group_total(scores) / size
    dof = jnp.where(several, size - 1, 1)
    std = jnp.sqrt(group_total(jnp.square(scores - full_mean)) / dof)
    total_length = group_total(lengths)
    weighted = group_total(lengths * scores) / jnp.where(total_length > 0, total_length, 1)
    return GroupStats(
        scores=scores,
        size=size,
        mean=jnp.where(several, full_mean, 0),
        std=jnp.where(several, std, 1),
        length_weighted_mean=jnp.where(several & (total_length > 0), weighted, 0),
    )


def group_stats(rewards: jax.Array, response_mask: jax.Array, index: Sequence[Hashable] | np.ndarray) -> GroupStats:
    """Groups rows by `index` on the host, then computes every row's group statistics in one jitted call."""
    ids, num_groups = group_ids(index)
    return _group_stats_jit(rewards, float_mask(rewards, response_mask), jnp.asarray(ids), num_groups)


def outcome_advantages(scores: jax.Array, response_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(advantages, returns): each row's scalar `scores` (bs,) on its valid tokens, for both."""
    advantages = scores[:, None] * float_mask(scores, response_mask)
    return advantages, advantages


def grpo_scores(g: GroupStats, norm_adv_by_std: bool) -> jax.Array:
    """Each row's GRPO advantage (bs,): (score - group mean) / (group std + 1e-6), or without the std (Dr.GRPO)."""
    centered = g.scores - g.mean
    return centered / (g.std + GROUP_STD_EPS) if norm_adv_by_std else centered


@register_advantage_estimator("grpo")
@register_advantage_estimator("grpo_vectorized")  # verl's vectorised twin of the same formula
def grpo_advantage(token_level_rewards, response_mask, index, norm_adv_by_std):
    """GRPO: (score - group mean) / (unbiased group std + 1e-6); Dr.GRPO (`norm_adv_by_std=False`) skips the std.

    The score of a row is its summed token rewards; a group of one has mean 0 and std 1.
    """
    g = group_stats(token_level_rewards, response_mask, index)
    return outcome_advantages(grpo_scores(g, norm_adv_by_std), response_mask)


@register_advantage_estimator("rloo")
def rloo_advantage(token_level_rewards, response_mask, index):
    """RLOO: score minus the mean of the other responses of its group, i.e. (score - group mean) * n / (n - 1).

    A group of one keeps its score.
    """
    g = group_stats(token_level_rewards, response_mask, index)
    loo = (g.scores - g.mean) * g.size / jnp.where(g.size > 1, g.size - 1, 1)
    return outcome_advantages(jnp.where(g.size > 1, loo, g.scores), response_mask)


@register_advantage_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantage(token_level_rewards, response_mask, index):
    """REINFORCE++ with baseline: score minus group mean on every valid token, then whitened over the whole batch."""
    g = group_stats(token_level_rewards, response_mask, index)
    mask = float_mask(g.scores, response_mask)
    advantages = masked_whiten((g.scores - g.mean)[:, None] * mask, mask) * mask
    return advantages, advantages


@register_advantage_estimator("opo")
def opo_advantage(token_level_rewards, response_mask, index):
    """OPO: score minus the length-weighted group mean score sum(len * score) / sum(len) (0 for a group of one).

    A group whose responses are all empty has baseline 0 (verl divides 0 by 0 there).
    """
    g = group_stats(token_level_rewards, response_mask, index)
    return outcome_advantages(g.scores - g.length_weighted_mean, response_mask)
