"""hfjax.algos.rollout_correction against a hand-written float64 numpy reference (plain loops over rows and tokens), on
fresh random float32 log-probs with ragged masks (an all-masked row, a full row, NaN/inf hidden under the mask), and
the policy losses' `token_weights` against hand-written weighted losses (values and gradients)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hfjax import algos
from hfjax.algos import CORRECTION_LEVELS, policy_loss, register_policy_loss, rollout_correction
from hfjax.algos.rollout_correction import LOG_RATIO_CLAMP

BS, T = 8, 10
TOL = dict(rtol=1e-5, atol=1e-6)
THRESHOLDS = [  # (is_threshold, rs_threshold, rs_threshold_lower)
    (2.0, 2.0, None),
    (1.3, 1.25, 0.9),
]
METRICS = (
    "log_prob_abs_diff",
    "log_prob_abs_diff_max",
    "kl",
    "k3_kl",
    "ratio_mean",
    "ratio_max",
    "ratio_min",
    "seq_ratio_mean",
    "is_truncated_frac",
    "rs_masked_frac",
)


def make_inputs(seed=11, bs=BS, length=T):
    """float32 (old, rollout, mask): log-probs < 0, old = rollout + noise; row 0 all masked, row 1 full, the rest
    random with holes; masked positions hold junk (NaN, -inf, large values) that must never reach a result."""
    rng = np.random.default_rng(seed)
    rollout = -rng.exponential(1.0, (bs, length)) - 0.01
    old = np.minimum(rollout + rng.normal(0.0, 0.45, (bs, length)), -1e-3)
    mask = (rng.random((bs, length)) < 0.75).astype(np.float32)
    mask[0], mask[1] = 0, 1
    holes = np.argwhere(mask == 0)
    old[tuple(holes[0])], rollout[tuple(holes[1])], old[tuple(holes[2])] = np.nan, -np.inf, 1e4
    return old.astype(np.float32), rollout.astype(np.float32), mask


def clamp(x, bound=LOG_RATIO_CLAMP):
    return min(max(x, -bound), bound)


def ref_correction(old, rollout, mask, is_level, is_threshold, rs_level, rs_threshold, rs_lower):
    """Loops, in float64: (weights, loss_mask, metrics without the prefix, token ratios, sequence ratios)."""
    old, rollout = old.astype(np.float64), rollout.astype(np.float64)
    lower = 1.0 / rs_threshold if rs_lower is None else rs_lower
    bs, length = mask.shape
    token_ratio = np.ones((bs, length))
    seq_ratio = np.ones(bs)
    for b in range(bs):
        total = 0.0
        for t in range(length):
            if mask[b, t]:
                total += old[b, t] - rollout[b, t]
                token_ratio[b, t] = math.exp(clamp(old[b, t] - rollout[b, t]))
        seq_ratio[b] = math.exp(clamp(total))

    weights, loss_mask = np.zeros((bs, length)), np.zeros((bs, length))
    abs_diffs, kls, k3s, ratios, truncated, rejected, seq_ratios = [], [], [], [], [], [], []
    for b in range(bs):
        if mask[b].any():
            seq_ratios.append(seq_ratio[b])
        for t in range(length):
            if not mask[b, t]:
                continue
            at = {"token": token_ratio[b, t], "sequence": seq_ratio[b]}
            if is_level == "none":
                weights[b, t] = 1.0
                truncated.append(0.0)
            else:
                weights[b, t] = min(at[is_level], is_threshold)
                truncated.append(float(at[is_level] > is_threshold))
            keep = rs_level == "none" or lower <= at[rs_level] <= rs_threshold
            loss_mask[b, t] = float(keep)
            rejected.append(float(not keep))
            d = old[b, t] - rollout[b, t]
            abs_diffs.append(abs(d))
            kls.append(rollout[b, t] - old[b, t])
            k3s.append(math.exp(clamp(d)) - clamp(d) - 1)
            ratios.append(token_ratio[b, t])

    def mean(xs):
        return sum(xs) / len(xs) if xs else 0.0

    metrics = {
        "log_prob_abs_diff": mean(abs_diffs),
        "log_prob_abs_diff_max": max(abs_diffs, default=0.0),
        "kl": mean(kls),
        "k3_kl": mean(k3s),
        "ratio_mean": mean(ratios),
        "ratio_max": max(ratios, default=0.0),
        "ratio_min": min(ratios, default=0.0),
        "seq_ratio_mean": mean(seq_ratios),
        "is_truncated_frac": mean(truncated),
        "rs_masked_frac": mean(rejected),
    }
    return weights, loss_mask, metrics, token_ratio, seq_ratio


def check(result, expected):
    weights, loss_mask, metrics = result
    ref_weights, ref_mask, ref_metrics = expected[:3]
    np.testing.assert_allclose(np.asarray(weights), ref_weights, **TOL)
    np.testing.assert_array_equal(np.asarray(loss_mask), ref_mask)
    assert set(metrics) == {f"rollout_corr/{name}" for name in METRICS}
    for name in METRICS:
        value = metrics[f"rollout_corr/{name}"]
        assert value.shape == () and np.isfinite(value), name
        np.testing.assert_allclose(float(value), ref_metrics[name], **TOL, err_msg=name)


@pytest.mark.parametrize("thresholds", THRESHOLDS, ids=["defaults", "custom"])
@pytest.mark.parametrize("rs_level", CORRECTION_LEVELS)
@pytest.mark.parametrize("is_level", CORRECTION_LEVELS)
def test_matches_reference(is_level, rs_level, thresholds):
    is_threshold, rs_threshold, rs_lower = thresholds
    old, rollout, mask = make_inputs()
    expected = ref_correction(old, rollout, mask, is_level, is_threshold, rs_level, rs_threshold, rs_lower)
    # the data exercises every branch, and no ratio sits within float32 rounding of a threshold
    token_ratio, seq_ratio = expected[3][mask != 0], expected[4][mask.any(axis=1)]
    bounds = (is_threshold, rs_threshold, 1 / rs_threshold if rs_lower is None else rs_lower)
    for ratios in (token_ratio, seq_ratio):
        assert all(abs(r / bound - 1) > 1e-4 for r in ratios for bound in bounds)
        assert (ratios > max(bounds)).any() and (ratios < min(bounds)).any() and (ratios > 1).any()
    if is_level != "none":
        assert 0 < expected[2]["is_truncated_frac"] < 1
    if rs_level != "none":
        assert 0 < expected[2]["rs_masked_frac"] < 1

    kwargs = dict(is_level=is_level, is_threshold=is_threshold, rs_level=rs_level, rs_threshold=rs_threshold)
    result = rollout_correction(old, rollout, mask, **kwargs, rs_threshold_lower=rs_lower)
    check(result, expected)
    assert all(a.dtype == jnp.float32 for a in result[:2])


def test_jit_int_and_bool_masks_give_the_same_results():
    old, rollout, mask = make_inputs(seed=7)
    kwargs = dict(is_level="sequence", is_threshold=1.5, rs_level="token", rs_threshold=1.8)
    expected = ref_correction(old, rollout, mask, "sequence", 1.5, "token", 1.8, None)
    jitted = jax.jit(rollout_correction, static_argnames=tuple(kwargs))
    check(jitted(old, rollout, mask, **kwargs), expected)
    check(rollout_correction(old, rollout, mask.astype(np.int32), **kwargs), expected)
    check(rollout_correction(old, rollout, mask.astype(bool), **kwargs), expected)


def test_log_ratios_are_clamped():
    rollout = np.full((3, 4), -2.0, np.float32)
    old = rollout.copy()
    old[0, 1] = rollout[0, 1] + 30.0  # token log ratio 30 -> 20; sequence sum 30 -> 20
    old[1, :] = rollout[1, :] - 7.0  # every token -7; sequence sum -28 -> -20
    old[2, :] = rollout[2, :] + np.float32(4.0)  # every token 4: exact; sequence sum 16: exact
    mask = np.ones((3, 4), np.float32)
    weights, _, metrics = rollout_correction(old, rollout, mask, is_level="token", is_threshold=1e12)
    np.testing.assert_allclose(np.asarray(weights)[0], [1, math.exp(20), 1, 1], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(weights)[1:], np.exp([[-7.0] * 4, [4.0] * 4]), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["rollout_corr/log_prob_abs_diff_max"]), 30.0, rtol=1e-6)
    weights, _, metrics = rollout_correction(old, rollout, mask, is_level="sequence", is_threshold=1e12)
    np.testing.assert_allclose(np.asarray(weights)[:, 0], np.exp([20.0, -20.0, 16.0]), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["rollout_corr/seq_ratio_mean"]), np.exp([20, -20, 16]).mean(), rtol=1e-5)
    assert all(np.isfinite(float(v)) for v in metrics.values())


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_identical_policies_change_nothing(level):
    _, rollout, mask = make_inputs(seed=3)
    rollout = np.where(mask != 0, rollout, -1.0).astype(np.float32)  # drop the junk: old == rollout exactly
    weights, loss_mask, metrics = rollout_correction(
        rollout, rollout, mask, is_level=level, is_threshold=1.0, rs_level=level, rs_threshold=1.0
    )
    np.testing.assert_array_equal(np.asarray(weights), mask)
    np.testing.assert_array_equal(np.asarray(loss_mask), mask)
    for name in ("log_prob_abs_diff", "log_prob_abs_diff_max", "kl", "k3_kl", "is_truncated_frac", "rs_masked_frac"):
        assert float(metrics[f"rollout_corr/{name}"]) == 0.0, name
    for name in ("ratio_max", "ratio_min"):
        assert float(metrics[f"rollout_corr/{name}"]) == 1.0, name
    for name in ("ratio_mean", "seq_ratio_mean"):
        np.testing.assert_allclose(float(metrics[f"rollout_corr/{name}"]), 1.0, rtol=1e-6)


def test_all_masked_batch_gives_zeros_not_nan():
    old, rollout, _ = make_inputs(seed=5)
    mask = np.zeros((BS, T), np.float32)
    weights, loss_mask, metrics = rollout_correction(old, rollout, mask, is_level="token", rs_level="sequence")
    assert not np.asarray(weights).any() and not np.asarray(loss_mask).any()
    assert {name: float(value) for name, value in metrics.items()} == dict.fromkeys(metrics, 0.0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weights_and_mask_carry_no_gradient(level):
    old, rollout, mask = make_inputs(seed=11)

    def total(old, rollout):
        weights, loss_mask, _ = rollout_correction(old, rollout, mask, is_level=level, rs_level=level)
        return jnp.sum(weights) + jnp.sum(loss_mask)

    grads = jax.grad(total, argnums=(0, 1))(old, rollout)
    assert all(not np.asarray(g).any() for g in grads)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        (dict(is_level="tokens"), "is_level"),
        (dict(rs_level="seq"), "rs_level"),
        (dict(is_level=None), "is_level"),
        (dict(is_threshold=0.0), "is_threshold"),
        (dict(is_threshold=-1.0), "is_threshold"),
        (dict(is_threshold=float("nan")), "is_threshold"),
        (dict(rs_threshold=0.0), "rs_threshold"),
        (dict(rs_threshold_lower=0.0), "rs_threshold_lower"),
        (dict(rs_threshold_lower=-0.5), "rs_threshold_lower"),
        (dict(rs_threshold=1.5, rs_threshold_lower=2.0), "rs_threshold_lower"),
    ],
)
def test_bad_arguments_raise(kwargs, argument):
    old, rollout, mask = make_inputs(bs=2, length=3)
    with pytest.raises(ValueError, match=argument):
        rollout_correction(old, rollout, mask, **kwargs)


def test_unusual_but_valid_thresholds_are_accepted():
    old, rollout, mask = make_inputs(seed=2)
    # is_threshold < 1 and a band [lower, upper] that excludes 1 are allowed
    kwargs = dict(is_level="token", is_threshold=0.8, rs_level="token", rs_threshold=3.0, rs_threshold_lower=1.2)
    check(rollout_correction(old, rollout, mask, **kwargs), ref_correction(old, rollout, mask, *kwargs.values()))


# ---------------------------------------------------------------- token_weights in the policy losses


def loss_inputs(seed=21):
    old, _, mask = make_inputs(seed)
    rng = np.random.default_rng(seed + 1)
    old = np.where(mask != 0, old, -1.0).astype(np.float32)
    logp = (old + rng.normal(0, 0.3, old.shape)).astype(np.float32)
    adv = rng.normal(size=old.shape).astype(np.float32)
    weights = (rng.random(old.shape) * 2 * mask).astype(np.float32)
    return old, jnp.asarray(logp), adv, mask, weights


def hand_aggregate(token_losses, mask, mode):
    """token-mean or seq-mean-token-mean of `token_losses` (already weighted), written out."""
    if mode == "token-mean":
        return jnp.sum(token_losses * mask) / jnp.sum(mask)
    rows = [jnp.sum(token_losses[b] * mask[b]) / (mask[b].sum() + 1e-8) for b in range(mask.shape[0]) if mask[b].any()]
    return sum(rows) / len(rows)


def hand_ppo(old, logp, adv, mask, weights, mode, low=0.2, high=0.28, dual=3.0):
    ratio = jnp.exp(jnp.clip(logp - old, -20.0, 20.0))
    surrogate = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - low, 1 + high))
    surrogate = jnp.where(adv < 0, jnp.minimum(surrogate, -adv * dual), surrogate)
    return hand_aggregate(surrogate * weights, mask, mode)


def hand_pg(old, logp, adv, mask, weights, mode):
    return hand_aggregate(-adv * logp * weights, mask, mode)


def hand_gspo(old, logp, adv, mask, weights, mode, low=0.2, high=0.28):
    counts = np.maximum(mask.sum(axis=1, keepdims=True), 1)
    seq = jax.lax.stop_gradient(jnp.sum((logp - old) * mask, axis=1, keepdims=True) / counts)
    ratio = jnp.exp(jnp.minimum(seq + logp - jax.lax.stop_gradient(logp), 10.0))
    surrogate = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - low, 1 + high))
    return hand_aggregate(surrogate * weights, mask, mode)


HAND = {"ppo": hand_ppo, "pg": hand_pg, "gspo": hand_gspo}
OPTIONS = {"ppo": dict(clip_ratio_high=0.28), "gspo": dict(clip_ratio_high=0.28), "pg": {}}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("name", ["ppo", "gspo", "pg"])
def test_token_weights_match_hand_written_loss_and_gradient(name, mode):
    old, logp, adv, mask, weights = loss_inputs()
    options = dict(OPTIONS[name], loss_agg_mode=mode)

    def loss(logp):
        return policy_loss(name, old, logp, adv, mask, token_weights=weights, **options)[0]

    value, grad = jax.value_and_grad(loss)(logp)
    ref_value, ref_grad = jax.value_and_grad(lambda lp: HAND[name](old, lp, adv, mask, weights, mode))(logp)
    np.testing.assert_allclose(float(value), float(ref_value), **TOL)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(ref_grad), **TOL)
    # weights change the loss (the check above is not vacuous), and only the loss: the diagnostics stay unweighted
    out, plain = (
        policy_loss(name, old, logp, adv, mask, token_weights=weights, **options),
        policy_loss(name, old, logp, adv, mask, **options),
    )
    assert float(out[0]) != float(plain[0])
    assert all(float(a) == float(b) for a, b in zip(out[1:], plain[1:], strict=True))


@pytest.mark.parametrize("name", ["ppo", "gspo", "pg"])
def test_no_token_weights_is_bit_for_bit_unchanged(name):
    old, logp, adv, mask, _ = loss_inputs(seed=31)

    def run(**weights):
        fn = jax.value_and_grad(lambda lp: policy_loss(name, old, lp, adv, mask, **weights)[0])
        return fn(logp), policy_loss(name, old, logp, adv, mask, **weights)

    (base_value, base_grad), base_out = run()
    for kwargs in (dict(token_weights=None), dict(token_weights=jnp.ones_like(logp))):
        (value, grad), out = run(**kwargs)
        assert np.asarray(value).tobytes() == np.asarray(base_value).tobytes()
        assert np.asarray(grad).tobytes() == np.asarray(base_grad).tobytes()
        assert all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in zip(out, base_out, strict=True))


@register_policy_loss("test_rollout_correction_unweighted")
def _unweighted_loss(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean"):
    zero = jnp.zeros(())
    return algos.agg_loss(-advantages * log_prob, response_mask, loss_agg_mode), zero, zero, zero


def test_user_loss_without_token_weights_keeps_working():
    old, logp, adv, mask, weights = loss_inputs(seed=41)
    name = "test_rollout_correction_unweighted"
    expected = policy_loss("pg", old, logp, adv, mask)[0]
    assert float(policy_loss(name, old, logp, adv, mask)[0]) == float(expected)
    assert float(policy_loss(name, old, logp, adv, mask, token_weights=None)[0]) == float(expected)
    with pytest.raises(ValueError, match=rf"policy loss '{name}' does not take token_weights"):
        policy_loss(name, old, logp, adv, mask, token_weights=weights)


def test_correction_feeds_a_policy_loss():
    """rollout_correction's weights and mask plugged into PPO equal the hand-written TIS + MIS loss and gradient."""
    old, rollout, mask = make_inputs(seed=51)
    _, logp, adv, _, _ = loss_inputs(seed=51)
    old = np.where(mask != 0, old, -1.0).astype(np.float32)
    kwargs = dict(is_level="token", is_threshold=1.5, rs_level="sequence", rs_threshold=2.0)
    weights, loss_mask, _ = rollout_correction(old, rollout, mask, **kwargs)
    ref_weights, ref_mask = ref_correction(old, rollout, mask, "token", 1.5, "sequence", 2.0, None)[:2]
    assert 0 < ref_mask.sum() < mask.sum()

    def loss(logp):
        return policy_loss("ppo", old, logp, adv, loss_mask, token_weights=weights, clip_ratio_high=0.28)[0]

    value, grad = jax.value_and_grad(loss)(logp)
    ref = jax.value_and_grad(lambda lp: hand_ppo(old, lp, adv, ref_mask, ref_weights.astype(np.float32), "token-mean"))
    ref_value, ref_grad = ref(logp)
    np.testing.assert_allclose(float(value), float(ref_value), **TOL)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(ref_grad), **TOL)
