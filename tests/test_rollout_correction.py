"""hfjax.algos.rollout_correction and .rollout_rejection against float64 numpy references written from verl 0.9.1's
definitions (`rollout_correction_reference`: plain loops), on fresh random float32 log-probs with ragged masks (an
all-masked row, a full row, NaN/inf hidden under the mask); hand-computed cases for the conventions where hfjax used
to differ (k1 bounds on mu / pi_old, per-token clamps inside sequence sums, shares of sequences, the unclamped k3
metric); the mismatch metrics of micro-batches combined as the trainer combines them; and the policy losses'
`token_weights` against hand-written weighted losses (values and gradients)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.rollout_correction_reference import (
    BS,
    T,
    make_inputs,
    ref_importance,
    ref_mismatch,
    ref_rejection,
)

from hfjax import algos
from hfjax.algos import REJECTION_OPTIONS, mismatch_metrics, policy_loss, register_policy_loss, rollout_correction
from hfjax.optim.train_state import combine_metric
from hfjax.workers.model_role import step_metrics

TOL = dict(rtol=1e-5, atol=1e-6)
# thresholds that split the test data of `make_inputs()` (k1 bands asymmetric on purpose)
RS_THRESHOLDS = {
    "token_k1": "0.6_1.3",
    "token_k2": 0.05,
    "token_k3": 0.05,
    "seq_sum_k1": "0.6_1.3",
    "seq_sum_k2": 0.6,
    "seq_sum_k3": 0.6,
    "seq_mean_k1": "0.9_1.1",
    "seq_mean_k2": 0.07,
    "seq_mean_k3": 0.07,
    "seq_max_k2": 0.3,
    "seq_max_k3": 0.3,
}


def assert_metrics(got, want):
    assert set(got) == {f"rollout_corr/{name}" for name in want}
    for name, value in want.items():
        value_got = got[f"rollout_corr/{name}"]
        assert value_got.shape == () and np.isfinite(value_got), name
        np.testing.assert_allclose(float(value_got), value, **TOL, err_msg=name)


# ---------------------------------------------------------------- importance weights


@pytest.mark.parametrize("batch_normalize", [False, True], ids=["raw", "batch_normalized"])
@pytest.mark.parametrize("threshold", [1.5, "0.7_1.6"], ids=["tis", "icepop"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_importance_weights_match_verl(level, threshold, batch_normalize):
    old, rollout, mask = make_inputs()
    kwargs = dict(rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=batch_normalize)
    weights, kept, metrics = rollout_correction(old, rollout, mask, **kwargs)
    ref_weights, ref_metrics = ref_importance(old, rollout, mask, level, threshold, batch_normalize)
    assert (
        0 < ref_metrics["rollout_is_ratio_fraction_high"] < 1 and 0 < ref_metrics["rollout_is_ratio_fraction_low"] < 1
    )
    np.testing.assert_allclose(np.asarray(weights), ref_weights, **TOL)
    assert weights.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(kept), mask)
    assert_metrics(metrics, {**ref_metrics, **ref_mismatch(old, rollout, mask)})


def test_sequence_truncation_share_counts_sequences_not_tokens():
    """Sequence-level TIS: one long sequence over the threshold and two short ones under it share 1/3 of the
    sequences (verl's `rollout_is_ratio_fraction_high`), although they hold 8/10 of the tokens."""
    rollout = np.full((3, 8), -1.0, np.float32)
    old = rollout + np.float32(0.25)  # a sequence's log ratio is 0.25 per token
    mask = np.zeros((3, 8), np.float32)
    mask[0], mask[1, :1], mask[2, :1] = 1, 1, 1  # 8 tokens (ratio e^2 > 2), 1 token (e^0.25 < 2), 1 token
    _, _, metrics = rollout_correction(old, rollout, mask, rollout_is="sequence", rollout_is_threshold=2.0)
    assert float(metrics["rollout_corr/rollout_is_ratio_fraction_high"]) == pytest.approx(1 / 3)


# ---------------------------------------------------------------- rejection


@pytest.mark.parametrize("option", REJECTION_OPTIONS)
def test_each_rejection_option_matches_verl(option):
    old, rollout, mask = make_inputs()
    threshold = RS_THRESHOLDS[option]
    weights, kept, metrics = rollout_correction(old, rollout, mask, rollout_rs=option, rollout_rs_threshold=threshold)
    ref_kept, ref_metrics, closest = ref_rejection(old, rollout, mask, option, threshold)
    assert closest > 1e-4  # no statistic within float32 rounding of a bound
    assert 0 < ref_kept.sum() < mask.sum()  # the option splits the data
    assert weights is None
    np.testing.assert_array_equal(np.asarray(kept), ref_kept)
    assert kept.dtype == mask.dtype
    assert_metrics(metrics, {**ref_metrics, **ref_mismatch(old, rollout, mask)})


@pytest.mark.parametrize(
    ("options", "thresholds"),
    [("token_k1,seq_sum_k2,seq_max_k3", "0.5_1.5,0.8,0.4"), ("seq_mean_k2, token_k3,seq_mean_k2", "0.07")],
    ids=["one_threshold_each", "one_shared_threshold"],
)
def test_chained_options_keep_what_every_option_keeps(options, thresholds):
    old, rollout, mask = make_inputs()
    _, kept, metrics = rollout_correction(
        old, rollout, mask, rollout_is="token", rollout_rs=options, rollout_rs_threshold=thresholds
    )
    ref_kept, ref_metrics, closest = ref_rejection(old, rollout, mask, options, thresholds)
    assert closest > 1e-4 and 0 < ref_kept.sum() < mask.sum()
    singles = [ref_rejection(old, rollout, mask, o, t)[0] for o, t in _per_option(options, thresholds)]
    np.testing.assert_array_equal(ref_kept, np.prod(singles, axis=0))  # the reference chains by AND
    for i, single in enumerate(singles):  # each option rejects tokens that the others keep
        others = np.prod([s for j, s in enumerate(singles) if j != i], axis=0)
        assert ((single == 0) & (others == 1) & (mask != 0)).any()
    np.testing.assert_array_equal(np.asarray(kept), ref_kept)
    for name, value in ref_metrics.items():
        np.testing.assert_allclose(float(metrics[f"rollout_corr/{name}"]), value, **TOL, err_msg=name)


def _per_option(options, thresholds):
    """[(option, its threshold)] of a chain, duplicates dropped, a single threshold shared."""
    names = list(dict.fromkeys(o.strip() for o in options.split(",")))
    specs = thresholds.split(",")
    return list(zip(names, specs * len(names) if len(specs) == 1 else specs, strict=True))


def test_k1_bounds_apply_to_rollout_over_old():
    """verl's token_k1 with "0.5_1.5" keeps 0.5 <= mu / pi_old <= 1.5: a token with pi_old / mu = 1.8 (mu / pi_old
    0.56) stays, one with pi_old / mu = 0.6 (mu / pi_old 1.67) goes; bounds on pi_old / mu would do the opposite."""
    rollout = np.full((1, 2), -1.0, np.float32)
    old = rollout + np.log([1.8, 0.6]).astype(np.float32)
    _, kept, _ = rollout_correction(
        old, rollout, np.ones((1, 2)), rollout_rs="token_k1", rollout_rs_threshold="0.5_1.5"
    )
    np.testing.assert_array_equal(np.asarray(kept), [[1, 0]])


def test_sequence_sums_clamp_each_token():
    """seq_sum_k1 sums per-token log ratios clamped to +-20: +30 and -25 count as +20 and -20, a sum of 0 (kept);
    clamping the sum instead (+5, mu / pi_old = e^-5) would reject the sequence."""
    rollout = np.full((1, 2), -40.0, np.float32)
    old = rollout + np.array([[30.0, -25.0]], np.float32)
    _, kept, metrics = rollout_correction(
        old, rollout, np.ones((1, 2)), rollout_rs="seq_sum_k1", rollout_rs_threshold=2.0
    )
    np.testing.assert_array_equal(np.asarray(kept), [[1, 1]])
    assert float(metrics["rollout_corr/rollout_rs_masked_fraction"]) == 0


# ---------------------------------------------------------------- mismatch metrics


def test_k3_metric_uses_the_unclamped_log_ratio():
    """verl's k3_kl is the token mean of e^d - 1 - d with d unclamped (d = 21 beyond the +-20 clamp of the weights)."""
    rollout = np.full((1, 2), -30.0, np.float32)
    old = rollout + np.array([[21.0, 0.5]], np.float32)
    metrics = mismatch_metrics(old, rollout, np.ones((1, 2)))
    want = (math.expm1(21) - 21 + math.expm1(0.5) - 0.5) / 2
    np.testing.assert_allclose(float(metrics["rollout_corr/k3_kl"]), want, rtol=1e-5)


@pytest.mark.parametrize("micro", [1, 2, BS])
def test_micro_batch_metrics_combine_to_the_whole_batch(micro):
    """The actor's mismatch metrics of micro-batches (rows grouped by length, as `trim_padding` groups them, so the
    micro-batches hold unequal token counts) combined as the trainer combines them (`TrainState.update`, then
    `step_metrics`) equal the whole batch's; the extremes are the numpy max / min over every valid token."""
    old, rollout, mask = make_inputs(seed=13)
    order = np.argsort(mask.sum(axis=1), kind="stable")
    parts = [
        mismatch_metrics(old[i], rollout[i], mask[i], token_count=mask.sum()) for i in np.split(order, BS // micro)
    ]
    update = {key: combine_metric(key, [float(p[key]) for p in parts]) for key in parts[0]}
    combined = step_metrics([(update, len(parts))], "actor", 0)
    whole = ref_mismatch(old, rollout, mask)
    for name, value in whole.items():
        np.testing.assert_allclose(combined[f"rollout_corr/{name}"], value, **TOL, err_msg=name)
    valid = mask != 0
    d = old.astype(np.float64) - rollout
    assert combined["rollout_corr/log_prob_abs_diff_max"] == pytest.approx(np.abs(d[valid]).max(), rel=1e-6)
    assert combined["rollout_corr/ratio_max"] == pytest.approx(np.exp(d[valid]).max(), rel=1e-6)
    assert combined["rollout_corr/ratio_min"] == pytest.approx(np.exp(d[valid]).min(), rel=1e-6)


# ---------------------------------------------------------------- conventions and errors


def test_jit_int_and_bool_masks_give_the_same_results():
    old, rollout, mask = make_inputs(seed=7)
    kwargs = dict(rollout_is="sequence", rollout_is_threshold=1.5, rollout_rs="token_k1", rollout_rs_threshold=1.8)
    expected = rollout_correction(old, rollout, mask, **kwargs)
    jitted = jax.jit(rollout_correction, static_argnames=tuple(kwargs))
    for result in (
        jitted(old, rollout, mask, **kwargs),
        rollout_correction(old, rollout, mask.astype(np.int32), **kwargs),
        rollout_correction(old, rollout, mask.astype(bool), **kwargs),
    ):
        np.testing.assert_allclose(np.asarray(result[0]), np.asarray(expected[0]), rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(result[1]).astype(np.float32), np.asarray(expected[1]))
        for key, value in expected[2].items():
            np.testing.assert_allclose(float(result[2][key]), float(value), rtol=1e-6, err_msg=key)


def test_identical_policies_change_nothing():
    _, rollout, mask = make_inputs(seed=3)
    rollout = np.where(mask != 0, rollout, -1.0).astype(np.float32)  # drop the junk: old == rollout exactly
    weights, kept, metrics = rollout_correction(
        rollout, rollout, mask, rollout_is="token", rollout_rs="seq_sum_k1,token_k3", rollout_rs_threshold="1.0,0.0001"
    )
    np.testing.assert_array_equal(np.asarray(weights), mask)
    np.testing.assert_array_equal(np.asarray(kept), mask)
    zero = ("log_prob_abs_diff", "log_prob_abs_diff_max", "kl", "k3_kl", "rollout_rs_masked_fraction")
    assert all(float(metrics[f"rollout_corr/{name}"]) == 0.0 for name in zero)
    assert float(metrics["rollout_corr/ratio_max"]) == float(metrics["rollout_corr/ratio_min"]) == 1.0


def test_all_masked_batch_gives_zeros_not_nan():
    """verl raises (or gives NaN) for a batch without a valid token; hfjax gives 0 for every metric."""
    old, rollout, _ = make_inputs(seed=5)
    mask = np.zeros((BS, T), np.float32)
    weights, kept, metrics = rollout_correction(
        old,
        rollout,
        mask,
        rollout_is="token",
        rollout_is_batch_normalize=True,
        rollout_rs="seq_max_k2",
        rollout_rs_threshold=0.1,
    )
    assert not np.asarray(weights).any() and not np.asarray(kept).any()
    norm = metrics.pop("rollout_corr/rollout_is_batch_norm_factor")
    assert float(norm) == 1.0  # nothing to normalise by
    assert {name: float(value) for name, value in metrics.items()} == dict.fromkeys(metrics, 0.0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weights_carry_no_gradient(level):
    old, rollout, mask = make_inputs(seed=11)

    def total(old, rollout):
        weights, _, _ = rollout_correction(old, rollout, mask, rollout_is=level, rollout_is_batch_normalize=True)
        return jnp.sum(weights)

    grads = jax.grad(total, argnums=(0, 1))(old, rollout)
    assert all(not np.asarray(g).any() for g in grads)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(rollout_is="tokens"), "rollout_is: expected one of"),
        (
            dict(rollout_is="token", rollout_is_threshold=0.0),
            "rollout_is_threshold: the upper bound must be a positive",
        ),
        (dict(rollout_is="token", rollout_is_threshold=float("nan")), "rollout_is_threshold: the upper bound must be"),
        (dict(rollout_is="token", rollout_is_threshold="2_1"), "rollout_is_threshold: expected lower <= upper"),
        (dict(rollout_is="token", rollout_is_threshold="a_2"), "rollout_is_threshold: the lower bound 'a' is not"),
        (dict(rollout_is="token", rollout_is_threshold=True), "rollout_is_threshold: expected a number"),
        (dict(rollout_rs="token_k4", rollout_rs_threshold=2.0), "rollout_rs: unknown option 'token_k4'"),
        (dict(rollout_rs=" , ", rollout_rs_threshold=2.0), "rollout_rs: expected at least one"),
        (dict(rollout_rs="token_k1"), "rollout_rs_threshold: required"),
        (dict(rollout_rs="token_k1,token_k2", rollout_rs_threshold="2,1,1"), "one per option"),
        (dict(rollout_rs="token_k2", rollout_rs_threshold="0.5_2.0"), r"\(option token_k2\): takes a single upper"),
        (dict(rollout_rs="token_k1", rollout_rs_threshold=0.5), r"\(option token_k1\): a single bound u .* u >= 1"),
        (dict(rollout_rs="seq_sum_k1", rollout_rs_threshold="0_2"), "the lower bound must be a positive number"),
    ],
)
def test_bad_arguments_raise_naming_the_field(kwargs, message):
    old, rollout, mask = make_inputs(bs=2, length=3)
    with pytest.raises(ValueError, match=message):
        rollout_correction(old, rollout, mask, **kwargs)


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
    """token-mean or seq-mean-token-mean of `token_losses` (already weighted), written out: verl divides the sum of
    the rows' token means by all rows (a row without a valid token adds 0)."""
    if mode == "token-mean":
        return jnp.sum(token_losses * mask) / jnp.sum(mask)
    rows = [jnp.sum(token_losses[b] * mask[b]) / (mask[b].sum() + 1e-8) for b in range(mask.shape[0])]
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
    """rollout_correction's weights and kept mask plugged into PPO, normalised by the kept tokens, equal the
    hand-written TIS + rejection loss and gradient (a mean over the kept tokens only)."""
    old, rollout, mask = make_inputs(seed=51)
    _, logp, adv, _, _ = loss_inputs(seed=51)
    old = np.where(mask != 0, old, -1.0).astype(np.float32)
    kwargs = dict(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="seq_sum_k1", rollout_rs_threshold=2.0)
    weights, kept, _ = rollout_correction(old, rollout, mask, **kwargs)
    ref_weights = ref_importance(old, rollout, mask, "token", 1.5, False)[0]
    ref_kept = ref_rejection(old, rollout, mask, "seq_sum_k1", 2.0)[0]
    assert 0 < ref_kept.sum() < mask.sum()

    def loss(logp):
        kept_tokens = jnp.sum(kept)
        options = dict(token_weights=weights, clip_ratio_high=0.28, global_tokens=kept_tokens)
        return policy_loss("ppo", old, logp, adv, kept, **options)[0]

    value, grad = jax.value_and_grad(loss)(logp)
    ref = jax.value_and_grad(lambda lp: hand_ppo(old, lp, adv, ref_kept, ref_weights.astype(np.float32), "token-mean"))
    ref_value, ref_grad = ref(logp)
    np.testing.assert_allclose(float(value), float(ref_value), **TOL)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(ref_grad), **TOL)
