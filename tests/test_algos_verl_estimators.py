"""verl 0.9.1's advantage estimators that hfjax adds (gpg, grpo_passk, gdpo, optimal_token_baseline,
tir_optimal_token_baseline, grpo_vectorized), PF-PPO resampling and the KL "+" forms, against float64 numpy
references written as plain loops from verl's definitions (`verl/trainer/ppo/core_algos.py`), in float32 and
float64."""

import math

import jax
import numpy as np
import pytest
from support.algos_reference import (
    BS,
    DTYPES,
    T,
    close,
    group_index,
    groups_of,
    precision,
    ragged_mask,
    ref_grpo,
    ref_whiten,
    seeded_rng,
)

from hfjax import algos
from hfjax.algos import compute_advantage, kl_penalty, pf_ppo_indices, pf_ppo_weights, sum_pi_squared_from_logits


@pytest.fixture
def rng(request):
    return seeded_rng(request)


def std(values):
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


# ---------------------------------------------------------------- references


def ref_gpg(r, m, index):
    scores = r.sum(-1)
    alpha = len(scores) / max(sum(1 for s in scores if s != 0), 1)
    adv = np.zeros(len(scores))
    for rows in groups_of(index):
        mean = np.mean(scores[rows]) if len(rows) > 1 else 0.0
        for i in rows:
            adv[i] = alpha * (scores[i] - mean)
    return adv[:, None] * m


def ref_passk(r, m, index, norm_by_std):
    scores = r.sum(-1)
    adv = np.zeros(len(scores))
    for rows in groups_of(index):
        ranked = sorted(rows, key=lambda i: (-scores[i], i))  # best first; the first of tied best rows wins
        gap = scores[ranked[0]] - scores[ranked[1]]
        adv[ranked[0]] = gap / (std(scores[rows]) + 1e-6) if norm_by_std else gap
    return adv[:, None] * m


def ref_gdpo(components, weights, m, index):
    combined = np.zeros_like(m)
    for k in range(components.shape[1]):
        as_rewards = np.zeros_like(m)
        as_rewards[:, 0] = components[:, k]  # a row's score is its summed rewards
        combined += weights[k] * ref_grpo(as_rewards, m, index, norm_by_std=True)
    return ref_whiten(combined, m) * m


def ref_optimal_token_baseline(r, m, index, old_logp, sum_pi_sq, is_weights, token_aligned):
    """verl's loops: returns to go, cumulative path variance, per-group weighted baselines, the zero tail; with
    `token_aligned` (TIR), positions are valid-token ranks and empty rows are in no group."""
    bs, length = r.shape
    returns = np.array([[sum(r[i, s] * m[i, s] for s in range(t, length)) for t in range(length)] for i in range(bs)])
    w = (1 - 2 * np.exp(old_logp) + sum_pi_sq) * (1 if is_weights is None else is_weights**2)
    cumulative = np.array([[sum(w[i, s] * m[i, s] for s in range(t + 1)) for t in range(length)] for i in range(bs)])
    keep = [np.flatnonzero(m[i]) if token_aligned else np.arange(length) for i in range(bs)]
    aligned_r = [returns[i, keep[i]] for i in range(bs)]
    aligned_w = [cumulative[i, keep[i]] * m[i, keep[i]] for i in range(bs)]
    lengths = [int(m[i].sum()) for i in range(bs)]
    baselines = [np.zeros(len(keep[i])) for i in range(bs)]
    for rows in groups_of(index):
        if token_aligned:
            rows = [i for i in rows if lengths[i] > 0]
        if len(rows) < 2:
            continue
        for t in range(length):
            num = sum(aligned_r[i][t] * aligned_w[i][t] for i in rows if t < len(keep[i]))
            den = sum(aligned_w[i][t] for i in rows if t < len(keep[i])) + 1e-8
            for i in rows:
                if t < len(keep[i]):
                    baselines[i][t] = num / den
        by_length = sorted(lengths[i] for i in rows)
        longest = [i for i in rows if lengths[i] == by_length[-1]]
        if len(longest) == 1 and by_length[-1] > by_length[-2]:
            baselines[longest[0]][by_length[-2] :] = 0
    advantages = np.zeros_like(r)
    for i in range(bs):
        advantages[i, keep[i]] = (aligned_r[i] - baselines[i]) * m[i, keep[i]]
    return advantages, returns


# ---------------------------------------------------------------- estimators


def rewards_and_mask(rng, bs=BS):
    """Outcome rewards on a row's last valid token, some rows scoring exactly 0 (GPG counts the non-zero ones)."""
    m = ragged_mask(rng, bs=bs)
    r = np.zeros((bs, T))
    for i in range(bs):
        valid = np.flatnonzero(m[i])
        if valid.size:
            r[i, valid[-1]] = rng.choice([0.0, rng.normal() * 2])
    return r, m


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpg_and_grpo_vectorized_match_reference(rng, dtype):
    r, m = rewards_and_mask(rng)
    index = group_index()
    assert 0 < np.count_nonzero(r.sum(-1)) < BS
    with precision(dtype):
        gpg = compute_advantage("gpg", token_level_rewards=r.astype(dtype), response_mask=m, index=index)
        vectorized = compute_advantage(
            "grpo_vectorized", token_level_rewards=r.astype(dtype), response_mask=m, index=index
        )
    for actual in gpg:
        close(actual, ref_gpg(r, m, index), dtype)
    close(vectorized[0], ref_grpo(r, m, index, norm_by_std=True), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_passk_matches_reference(rng, dtype, norm_by_std):
    r, m = rng.normal(size=(8, T)), ragged_mask(rng, bs=8)
    index = [3, 3, 3, "x", "x", 5, 5, 5]
    r[5:, 0] = 0.0  # group 5: two rows tie for the best score (its advantage is 0, whichever row carries it)
    r[5, 1:] = r[6, 1:] = 0.0
    r[7, 1:] = -1.0
    with precision(dtype):
        adv, ret = compute_advantage(
            "grpo_passk", token_level_rewards=r.astype(dtype), response_mask=m, index=index, norm_adv_by_std=norm_by_std
        )
    expected = ref_passk(r, m, index, norm_by_std)
    close(adv, expected, dtype)
    close(ret, expected, dtype)
    assert np.count_nonzero(np.asarray(adv).any(-1)) <= 2  # at most one row per group with a non-zero advantage
    with pytest.raises(ValueError, match=r"grpo_passk needs at least 2 responses .* group 'solo'"):
        compute_advantage("grpo_passk", token_level_rewards=r, response_mask=m, index=[3, 3, 3, "x", "x", 5, 5, "solo"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdpo_normalises_each_reward_component_in_its_group(rng, dtype):
    m, index = ragged_mask(rng), group_index()
    components = np.stack([rng.integers(0, 2, size=BS) * 1.0, rng.normal(size=BS) * 10], axis=1)
    weights = [1.0, 0.5]
    r = np.zeros((BS, T))
    r[:, 0] = components.sum(1)
    with precision(dtype):
        adv, ret = compute_advantage(
            "gdpo",
            token_level_rewards=r.astype(dtype),
            response_mask=m,
            index=index,
            reward_components=components.astype(dtype),
            reward_component_weights=weights,
        )
        single, _ = compute_advantage("gdpo", token_level_rewards=r.astype(dtype), response_mask=m, index=index)
    close(adv, ref_gdpo(components, weights, m, index), dtype)
    close(ret, ref_gdpo(components, weights, m, index), dtype)
    close(single, ref_gdpo(components.sum(1, keepdims=True), [1.0], m, index), dtype)  # verl's fallback
    with pytest.raises(ValueError, match=r"reward_component_weights has shape \(3,\), expected \(2,\)"):
        compute_advantage(
            "gdpo",
            token_level_rewards=r,
            response_mask=m,
            index=index,
            reward_components=components,
            reward_component_weights=[1, 1, 1],
        )


def token_baseline_inputs(rng):
    m = ragged_mask(rng)
    m[4] = np.arange(T) < 2  # group "a" (rows 0, 1, 4): row 1 is strictly the longest, so it gets a zero tail
    r = rng.normal(size=(BS, T)) * (rng.random((BS, T)) < 0.4)
    r[2, 0] = 1.5  # row 2, a group of one, keeps its (non-zero) returns to go
    old_logp = np.log(rng.uniform(0.05, 0.95, size=(BS, T)))
    sum_pi_sq = rng.uniform(0.05, 0.9, size=(BS, T))
    return r, m, old_logp, sum_pi_sq, rng.uniform(0.5, 2.0, size=(BS, T))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
@pytest.mark.parametrize("with_weights", [False, True])
def test_optimal_token_baselines_match_reference(rng, dtype, name, with_weights):
    r, m, old_logp, sum_pi_sq, is_weights = token_baseline_inputs(rng)
    is_weights = is_weights if with_weights else None
    index = group_index()
    with precision(dtype):
        adv, ret = compute_advantage(
            name,
            token_level_rewards=r.astype(dtype),
            response_mask=m,
            index=index,
            old_log_probs=old_logp.astype(dtype),
            sum_pi_squared=sum_pi_sq.astype(dtype),
            rollout_is_weights=None if is_weights is None else is_weights.astype(dtype),
        )
    tir = name.startswith("tir")
    ref_adv, ref_ret = ref_optimal_token_baseline(r, m, index, old_logp, sum_pi_sq, is_weights, token_aligned=tir)
    close(adv, ref_adv, dtype)
    close(ret, ref_ret, dtype)
    assert not np.asarray(adv)[0].any() and np.asarray(adv)[2].any()  # an empty row; a group of one keeps G_t


def test_optimal_token_baselines_agree_without_holes_and_need_their_inputs(rng):
    """Right-padded rows, every one non-empty: aligning by column or by valid-token rank is the same thing."""
    r, _, old_logp, sum_pi_sq, _ = token_baseline_inputs(rng)
    m = (np.arange(T)[None, :] < rng.integers(1, T + 1, size=(BS, 1))).astype(np.float64)
    inputs = dict(
        token_level_rewards=r, response_mask=m, index=group_index(), old_log_probs=old_logp, sum_pi_squared=sum_pi_sq
    )
    column, _ = compute_advantage("optimal_token_baseline", **inputs)
    ranked, _ = compute_advantage("tir_optimal_token_baseline", **inputs)
    np.testing.assert_allclose(column, ranked, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="needs `sum_pi_squared`"):
        compute_advantage("optimal_token_baseline", **{**inputs, "sum_pi_squared": None})


def test_sum_pi_squared_from_logits(rng):
    logits = rng.normal(size=(2, 3, 13)) * 30
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(sum_pi_squared_from_logits(logits.astype(np.float32)), (probs**2).sum(-1), rtol=1e-5)
    with jax.enable_x64(True):
        np.testing.assert_allclose(sum_pi_squared_from_logits(logits), (probs**2).sum(-1), rtol=1e-12)


def test_verl_estimator_names_are_registered():
    verl_names = {
        "gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo", "opo", "grpo_passk",
        "gpg", "grpo_vectorized", "optimal_token_baseline", "tir_optimal_token_baseline", "gdpo",
    }  # fmt: skip
    assert verl_names <= set(algos.advantage_estimators())


# ---------------------------------------------------------------- PF-PPO


def test_pf_ppo_weights_and_resampling_follow_verl(rng):
    scores = np.array([2.0, -1.0, 0.0, 2.0, -3.0, 0.5])
    eps = 1e-8
    np.testing.assert_allclose(pf_ppo_weights(scores, "pow", 2.0), scores**2 + eps, rtol=1e-15)
    np.testing.assert_allclose(pf_ppo_weights(scores, "max_min"), np.array([1, 0, 0, 1, 1, 0]) + eps, rtol=1e-15)
    np.testing.assert_allclose(pf_ppo_weights(scores, "max_random"), np.array([0.4, 0.1, 0.1, 0.4, 0.1, 0.1]) + eps)
    with pytest.raises(ValueError, match=r"reweight_method must be one of \['pow', 'max_min', 'max_random'\]"):
        pf_ppo_weights(scores, "max")
    draws = np.concatenate([pf_ppo_indices(scores, rng, "pow", 1.0) for _ in range(4000)])
    frequencies = np.bincount(draws, minlength=6) / draws.size
    expected = np.abs(scores) / np.abs(scores).sum()
    # 24000 draws: a frequency's standard error is at most 0.0033; 5 of them is a safe bound.
    np.testing.assert_allclose(frequencies, expected, atol=0.017)
    assert frequencies[2] < 1e-4  # a zero score is (almost) never drawn


# ---------------------------------------------------------------- KL "+" forms


@pytest.mark.parametrize("dtype", DTYPES)
def test_straight_through_kl_forms_keep_the_value_and_take_k2_gradient(rng, dtype):
    logp, ref = rng.normal(size=(BS, T)) * 3, rng.normal(size=(BS, T)) * 3
    forward = {
        "k1": logp - ref,
        "abs": np.abs(logp - ref),
        "k2": 0.5 * (logp - ref) ** 2,
        "k3": np.clip(np.exp(np.clip(ref - logp, -20, 20)) - np.clip(ref - logp, -20, 20) - 1, -10, 10),
    }
    names = {**{kind + "+": kind for kind in forward}, "kl+": "k1", "mse+": "k2", "low_var_kl+": "k3"}

    @jax.jit
    def values_and_gradients(logp, ref):
        def per_name(name):
            return kl_penalty(logp, ref, name), jax.grad(lambda lp: kl_penalty(lp, ref, name).sum())(logp)

        return {name: per_name(name) for name in names}

    with precision(dtype):
        results = values_and_gradients(logp.astype(dtype), ref.astype(dtype))
    for name, base in names.items():
        value, grad = results[name]
        close(value, forward[base], dtype)
        close(grad, logp - ref, dtype)  # d/dlogp of (logp - ref)^2 / 2
