"""verl 0.9.1's policy losses that hfjax adds (sapo, cispo, dppo_tv, dppo_kl, geo_mean, dro, clip_cov, kl_cov,
bypass_mode, and the names vanilla / gpg) against float64 numpy references written from verl's definitions
(`verl/trainer/ppo/core_algos.py`): the loss value, its gradient with respect to the log probs (derived by hand per
token), and the metrics, in float32 and float64, with and without per-token weights."""

import math

import jax
import numpy as np
import pytest
from support.algos_reference import (
    BS,
    DTYPES,
    T,
    close,
    precision,
    ragged_mask,
    ref_agg,
    ref_agg_weights,
    ref_masked_mean,
    ref_ppo_tokens,
    seeded_rng,
)

from hfjax import algos
from hfjax.algos import policy_loss
from hfjax.algos.losses import check_actor_policy_loss


@pytest.fixture
def rng(request):
    return seeded_rng(request)


def loss_inputs(rng, spread=0.6):
    """Log probs of real probabilities (DPPO looks at 1 - p), moved by `spread` (in log space) far enough to leave
    every trust region."""
    m = ragged_mask(rng)
    old = np.log(rng.uniform(0.05, 0.95, size=(BS, T)))
    new = np.log(np.clip(np.exp(old + rng.normal(size=(BS, T)) * spread), 1e-3, 0.999))
    return old, new, rng.normal(size=(BS, T)) * 2, m


def outputs_and_gradient(name, old, new, adv, m, dtype, token_weights=None, **kwargs):
    """policy_loss(name)'s four outputs and d pg_loss / d log_prob, in `dtype`, from one jitted program."""
    with precision(dtype):
        old, adv = old.astype(dtype), adv.astype(dtype)
        weights = None if token_weights is None else token_weights.astype(dtype)

        def loss(logp):
            out = policy_loss(name, old, logp, adv, m, token_weights=weights, **kwargs)
            return out[0], out

        (_, out), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(new.astype(dtype))
    return out, grad


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


# ---------------------------------------------------------------- per-token references: value, d/dlogp, metrics
# Each returns (token losses, their derivatives by logp, pg_clipfrac flags, ppo_kl terms, pg_clipfrac_lower flags).


def ref_sapo(old, new, adv, tau_pos=1.0, tau_neg=1.05):
    ratio = np.exp(np.clip(new - old, -20, 20))
    tau = np.where(adv > 0, tau_pos, tau_neg)
    gate = sigmoid(tau * (ratio - 1))
    zero = np.zeros_like(adv)
    return -adv * gate * 4 / tau, -adv * 4 * gate * (1 - gate) * ratio, zero, old - new, zero


def ref_cispo(old, new, adv, low=0.2, high=0.2):
    ratio = np.exp(np.clip(new - old, -20, 20))
    clipped = np.clip(ratio, 1 - low, 1 + high)
    return -clipped * adv * new, -clipped * adv, ratio != clipped, old - new, np.zeros_like(adv)


def ref_dppo(old, new, adv, divergence, c):
    """`divergence` decides, per token and advantage sign, whether the token is inside DPPO's trust region."""
    ratio = np.exp(np.clip(new - old, -20, 20))
    inside = np.zeros_like(adv)
    for idx in np.ndindex(adv.shape):
        inside[idx] = divergence(math.exp(old[idx]), math.exp(new[idx]), old[idx], new[idx], adv[idx] > 0)
    truncated = np.minimum(ratio, c)
    return -adv * truncated * new * inside, -adv * truncated * inside, 1 - inside, old - new, (ratio > c) * inside


def tv_inside(p_old, p, _old, _new, positive, low=0.2, high=0.2):
    return p - p_old <= high if positive else p - p_old >= -low


def binary_kl_inside(p_old, p, old, new, positive, low=0.2, high=0.2):
    kl = p_old * (old - new) + (1 - p_old) * math.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
    return (kl <= high or p <= p_old) if positive else (kl <= low or p >= p_old)


def ref_dro(old, new, adv, beta=0.3):
    zero = np.zeros_like(adv)
    return -(adv * new - 0.5 * beta * (new - old) ** 2), -(adv - beta * (new - old)), zero, old - new, zero


TOKEN_LOSSES = {  # name: (keyword arguments, reference, the aggregation it uses: None = loss_agg_mode)
    "sapo": ({}, ref_sapo, "seq-mean-token-mean"),
    "cispo": ({}, ref_cispo, None),
    "dppo_tv": ({"clip_ratio_c": 1.5}, lambda o, n, a: ref_dppo(o, n, a, tv_inside, 1.5), None),
    "dppo_kl": ({"clip_ratio_c": 1.5}, lambda o, n, a: ref_dppo(o, n, a, binary_kl_inside, 1.5), None),
    "dro": ({"dro_beta": 0.3}, ref_dro, None),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("name", sorted(TOKEN_LOSSES))
def test_token_losses_match_reference_in_value_gradient_and_metrics(rng, name, weighted, dtype):
    old, new, adv, m = loss_inputs(rng)
    weights = rng.uniform(0.5, 1.5, size=(BS, T)) if weighted else np.ones((BS, T))
    kwargs, reference, fixed_mode = TOKEN_LOSSES[name]
    mode = "seq-mean-token-sum" if weighted else "token-mean"
    tokens, dtokens, clipfrac, ppo_kl, lower = reference(old, new, adv)
    agg = fixed_mode or mode
    if name.startswith("dppo"):  # every branch of the trust region and of the truncation is exercised
        assert (clipfrac * m).any() and ((1 - clipfrac) * m).any() and (lower * m).any()
    with precision(dtype):
        cast = [a.astype(dtype) for a in (old, new, adv)]
        token_weights = weights.astype(dtype) if weighted else None

        def loss(logp):
            return policy_loss(
                name, cast[0], logp, cast[2], m, loss_agg_mode=mode, token_weights=token_weights, **kwargs
            )

        out = loss(cast[1])
        grad = jax.jit(jax.grad(lambda logp: loss(logp)[0]))(cast[1])
    close(out[0], ref_agg(tokens * weights, m, agg), dtype)
    close(grad, dtokens * weights * ref_agg_weights(m, agg), dtype)
    for actual, flags in zip(out[1:], (clipfrac, ppo_kl, lower), strict=True):
        close(actual, ref_masked_mean(np.asarray(flags, np.float64), m), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
def test_geo_mean_matches_reference_in_value_and_gradient(rng, dtype, weighted):
    old, new, adv, m = loss_inputs(rng)
    weights = rng.uniform(0.5, 1.5, size=(BS, T)) if weighted else np.ones((BS, T))
    loss_ref, grad_ref = 0.0, np.zeros((BS, T))
    clipped = np.zeros((BS, T))
    for i in range(BS):
        length = m[i].sum() + 1e-8
        pessimistic, slope = np.zeros(T), np.zeros(T)
        for t in range(T):
            log_ratio, sign = new[i, t] - old[i, t], np.sign(adv[i, t])
            bounded = min(max(log_ratio, -0.2), 0.2)
            clipped[i, t] = bounded != log_ratio
            if sign * log_ratio <= sign * bounded:  # the unclipped log ratio is the pessimistic one
                pessimistic[t], slope[t] = log_ratio, float(sign != 0)
            else:
                pessimistic[t] = bounded
        ratio = math.exp(sum(pessimistic * m[i]) / length)
        mean_adv = sum(adv[i] * m[i]) / length
        seq_weight = math.exp(sum(np.log(weights[i] + 1e-10) * m[i]) / length) if weighted else 1.0
        loss_ref += -mean_adv * ratio * seq_weight / BS  # a mean over all rows, the empty row 0 included
        grad_ref[i] = -mean_adv * ratio * seq_weight * slope * m[i] / length / BS
    assert (clipped * m * (adv > 0)).any() and (clipped * m * (adv < 0)).any()
    out, grad = outputs_and_gradient("geo_mean", old, new, adv, m, dtype, weights if weighted else None)
    close(out[0], loss_ref, dtype)
    close(grad, grad_ref, dtype)
    close(out[1], ref_masked_mean(clipped * (adv > 0), m), dtype)
    close(out[2], ref_masked_mean(old - new, m), dtype)
    close(out[3], ref_masked_mean(clipped * (adv < 0), m), dtype)
    thirds = [  # micro-batches normalised by the mini-batch's rows add up to the mini-batch's loss
        outputs_and_gradient("geo_mean", old[r], new[r], adv[r], m[r], np.float32, weights[r], global_seqs=BS)[0][0]
        for r in (slice(0, 3), slice(3, 6), slice(6, 9))
    ]
    np.testing.assert_allclose(sum(thirds), loss_ref, rtol=1e-5)


def clip_cov_reference(old, new, adv, m, detached):
    ratio = np.exp(new - old)
    l1, l2 = -adv * ratio, -adv * np.clip(ratio, 0.8, 1.2)
    keep = 1 - detached
    return np.maximum(l1, l2) * keep, np.where(l2 > l1, 0.0, -adv * ratio) * keep


def clip_cov_candidates(old, new, adv, m):
    ratio = np.exp(new - old)
    l1, l2 = -adv * ratio, -adv * np.clip(ratio, 0.8, 1.2)
    covariance = (adv - ref_masked_mean(adv, m)) * (new - ref_masked_mean(new, m))
    return (m > 0) & ~(l2 > l1) & (covariance > 1.0) & (covariance < 5.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_clip_cov_detaches_covariance_outliers(rng, dtype):
    old, new, adv, m = loss_inputs(rng, spread=0.25)  # most tokens stay inside PPO's clip: candidates
    candidates = clip_cov_candidates(old, new, adv, m)
    ratio = np.exp(new - old)
    assert 1 < candidates.sum() < m.sum() // 2 and ((-adv * np.clip(ratio, 0.8, 1.2) > -adv * ratio) * m).any()
    every, grad = outputs_and_gradient("clip_cov", old, new, adv, m, dtype, clip_cov_ratio=1.0)  # all candidates
    one, _ = outputs_and_gradient("clip_cov", old, new, adv, m, dtype)  # verl's 0.0002: max(floor(...), 1) = 1
    tokens, dtokens = clip_cov_reference(old, new, adv, m, candidates.astype(float))
    close(every[0], ref_agg(tokens, m, "token-mean"), dtype)
    close(grad, dtokens * ref_agg_weights(m, "token-mean"), dtype)
    close(every[1], ref_masked_mean(candidates.astype(float), m), dtype)
    close(every[2], ref_masked_mean(old - new, m), dtype)
    close(one[1], 1 / (m.sum() + 1e-8), dtype)
    singles = []
    for idx in zip(*np.nonzero(candidates), strict=True):
        detached = np.zeros((BS, T))
        detached[idx] = 1
        singles.append(ref_agg(clip_cov_reference(old, new, adv, m, detached)[0], m, "token-mean"))
    assert min(abs(float(one[0]) - s) for s in singles) < 1e-4  # one of the candidates, drawn at random


@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_cov_penalises_the_largest_covariances(rng, dtype):
    old, new, adv, m = loss_inputs(rng)
    valid = m > 0
    count = m.sum()
    covariance = (adv - adv[valid].mean()) * (new - new[valid].mean())
    k = max(1, math.floor(count * 0.1))
    largest = np.argsort(-np.where(valid, covariance, -np.inf), axis=None)[:k]
    chosen = np.zeros(BS * T)
    chosen[largest] = 1
    chosen = chosen.reshape(BS, T)
    log_ratio = new - old
    tokens = -adv * np.exp(log_ratio) + chosen * 0.1 * np.abs(log_ratio)
    dtokens = -adv * np.exp(log_ratio) + chosen * 0.1 * np.sign(log_ratio)
    with precision(dtype):
        cast = [a.astype(dtype) for a in (old, new, adv)]

        def loss(logp):
            return policy_loss(
                "kl_cov", cast[0], logp, cast[2], m, kl_cov_ratio=0.1, loss_agg_mode="seq-mean-token-mean"
            )

        out = loss(cast[1])
        grad = jax.jit(jax.grad(lambda logp: loss(logp)[0]))(cast[1])
    close(out[0], ref_agg(tokens, m, "seq-mean-token-mean"), dtype)
    close(grad, dtokens * ref_agg_weights(m, "seq-mean-token-mean"), dtype)
    close(out[2], ref_masked_mean(np.abs(log_ratio), m), dtype)  # verl's ppo_kl here is the mean |log ratio|
    assert float(out[1]) == 0.0 and float(out[3]) == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_bypass_mode_is_ppo_on_the_rollout_ratio_or_reinforce_with_sequence_weights(rng, dtype):
    rollout, new, adv, m = loss_inputs(rng)
    # REINFORCE with verl's default correction: sequence-level weights min(exp(sum of log(pi / mu)), 2), no gradient
    seq_weight = np.minimum(np.exp(np.clip((m * (new - rollout)).sum(-1), -20, 20)), 2.0)
    weights = seq_weight[:, None] * m
    assert (seq_weight[m.sum(-1) > 0] < 2).any() and (seq_weight == 2).any()
    ppo_tokens = ref_ppo_tokens(rollout, new, adv, 0.2, 0.2, 3.0)[0]
    with precision(dtype):
        cast = [a.astype(dtype) for a in (rollout, new, adv)]

        def loss(logp, loss_type):
            return policy_loss(
                "bypass_mode", cast[0], logp, cast[2], m, loss_type=loss_type, loss_agg_mode="token-mean"
            )

        reinforce = loss(cast[1], "reinforce")
        grad = jax.jit(jax.grad(lambda logp: loss(logp, "reinforce")[0]))(cast[1])
        clipped = loss(cast[1], "ppo_clip")
        vanilla = policy_loss("vanilla", *cast, m)
    close(reinforce[0], ref_agg(-adv * new * weights, m, "token-mean"), dtype)
    close(grad, -adv * weights * ref_agg_weights(m, "token-mean"), dtype)
    close(reinforce[2], ref_masked_mean(rollout - new, m), dtype)
    close(clipped[0], ref_agg(ppo_tokens, m, "token-mean"), dtype)  # the IS weights are not applied
    for a, b in zip(clipped, vanilla, strict=True):
        close(a, float(b), dtype)
    with pytest.raises(
        ValueError, match=r"loss_type \(bypass mode's loss\) must be one of \['ppo_clip', 'reinforce'\]"
    ):
        policy_loss("bypass_mode", rollout, new, adv, m, loss_type="pg")


def test_verl_policy_loss_names_are_registered_and_callable_by_the_actor(rng):
    verl_names = {
        "vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo",
        "bypass_mode",
    }  # fmt: skip
    assert verl_names <= set(algos.policy_losses())
    for name in verl_names - {"dro"}:
        check_actor_policy_loss(name)
    with pytest.raises(ValueError, match=r"policy loss 'dro' needs \['dro_beta'\]"):
        check_actor_policy_loss("dro")  # verl has no default for dro_beta either
    old, new, adv, m = loss_inputs(rng)
    with pytest.raises(ValueError, match=r"dro_beta .* must be > 0, got 0.0"):
        policy_loss("dro", old, new, adv, m, dro_beta=0.0)
    for a, b in zip(policy_loss("gpg", old, new, adv, m), policy_loss("pg", old, new, adv, m), strict=True):
        assert float(a) == float(b)
