"""hfjax.algos against hand-written float64 numpy references (plain loops), on fresh random inputs with ragged masks:
an all-masked row, a full row, interior holes, groups of one, gamma/lam < 1. float32 runs are compared at float32
rounding; float64 runs (inside `jax.enable_x64`) at float64 rounding."""

import math

import jax
import jax.numpy as jnp
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
    ref_agg,
    ref_grpo,
    ref_masked_mean,
    ref_ppo_tokens,
    ref_whiten,
    seeded_rng,
)

from hfjax import algos
from hfjax.algos import (
    AGG_MODES,
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    compute_advantage,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    make_kl_controller,
    mask_counts,
    masked_mean,
    masked_seq_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    token_share,
    value_loss,
)

# ---------------------------------------------------------------- numpy references


def ref_gae(r, v, m, gamma, lam):
    adv = np.zeros_like(r)
    for i in range(r.shape[0]):
        next_value, last_gae = 0.0, 0.0
        for t in reversed(range(r.shape[1])):
            gae = r[i, t] + gamma * next_value - v[i, t] + gamma * lam * last_gae
            if m[i, t]:  # masked positions pass the next valid position's value and advantage through
                next_value, last_gae = v[i, t], gae
            adv[i, t] = last_gae
    return ref_whiten(adv, m), adv + v


def ref_reinforce_pp(r, m, gamma):
    """verl 0.9.1: a masked position returns 0 and passes the running return through untouched."""
    returns = np.zeros_like(r)
    for i in range(r.shape[0]):
        running = 0.0
        for t in reversed(range(r.shape[1])):
            if m[i, t]:
                running = r[i, t] + gamma * running
                returns[i, t] = running
    return ref_whiten(returns, m) * m, returns


def ref_remax(r, m, baselines):
    returns = np.zeros_like(r)
    for i in range(r.shape[0]):
        for t in range(r.shape[1]):
            returns[i, t] = sum(r[i, s] * m[i, s] for s in range(t, r.shape[1]))
    return returns - baselines[:, None] * m, returns


def ref_rloo(r, m, index):
    scores = r.sum(-1)
    adv = scores.copy()  # a group of one keeps its score
    for rows in groups_of(index):
        if len(rows) > 1:
            for i in rows:
                others = [scores[j] for j in rows if j != i]
                adv[i] = scores[i] - sum(others) / len(others)
    return adv[:, None] * m


def ref_reinforce_pp_baseline(r, m, index):
    scores = r.sum(-1)
    centered = scores.copy()
    for rows in groups_of(index):
        if len(rows) > 1:
            for i in rows:
                centered[i] = scores[i] - np.mean(scores[rows])
    return ref_whiten(centered[:, None] * m, m) * m


def ref_opo(r, m, index):
    scores, lengths = r.sum(-1), m.sum(-1)
    adv = scores.copy()
    for rows in groups_of(index):
        if len(rows) > 1:
            baseline = sum(lengths[j] * scores[j] for j in rows) / sum(lengths[j] for j in rows)
            for i in rows:
                adv[i] = scores[i] - baseline
    return adv[:, None] * m


# ---------------------------------------------------------------- inputs


@pytest.fixture
def rng(request):
    return seeded_rng(request)


def token_inputs(rng):
    return dict(
        token_level_rewards=rng.normal(size=(BS, T)),
        values=rng.normal(size=(BS, T)),
        response_mask=ragged_mask(rng),
        reward_baselines=rng.normal(size=BS),
    )


# ---------------------------------------------------------------- masked statistics


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_statistics_match_reference(rng, dtype):
    x, m = rng.normal(size=(BS, T)) * 3 + 1, ragged_mask(rng)
    with precision(dtype):
        close(masked_mean(x.astype(dtype), m), ref_masked_mean(x, m), dtype)
        count, mean = m.sum(), ref_masked_mean(x, m)
        close(masked_var(x.astype(dtype), m), ref_masked_mean((x - mean) ** 2, m) * count / (count - 1), dtype)
        close(masked_var(x.astype(dtype), m, unbiased=False), ref_masked_mean((x - mean) ** 2, m), dtype)
        close(masked_whiten(x.astype(dtype), m), ref_whiten(x, m), dtype)
        close(masked_whiten(x.astype(dtype), m, shift_mean=False), ref_whiten(x, m) + mean, dtype)
        close(masked_mean(x.astype(dtype), m, axis=-1), [ref_masked_mean(x[i], m[i]) for i in range(BS)], dtype)
        # row 0 has no valid token: it counts as 0 (verl's reward KL average)
        close(masked_seq_mean(x.astype(dtype), m), np.mean([ref_masked_mean(x[i], m[i]) for i in range(BS)]), dtype)


def test_masked_statistics_ignore_nan_outside_mask_and_flag_undefined_variance(rng):
    x, m = rng.normal(size=(BS, T)), ragged_mask(rng)
    poisoned = np.where(m > 0, x, np.nan)
    assert np.isfinite(masked_whiten(poisoned, m)[m > 0]).all()
    np.testing.assert_allclose(masked_mean(poisoned, m), ref_masked_mean(x, m), rtol=1e-6)
    assert float(masked_mean(x, np.zeros_like(m))) == 0.0
    one = np.zeros_like(m)
    one[3, 2] = 1
    for mask in (one, np.zeros_like(m)):  # verl raises here; so does hfjax given a concrete mask
        with pytest.raises(ValueError, match=r"masked_var: the unbiased variance needs at least 2 valid elements"):
            masked_var(x, mask)
        with pytest.raises(ValueError, match=r"masked_whiten: .* at least 2 valid elements"):
            masked_whiten(x, mask)
        assert np.isnan(jax.jit(masked_var)(x, mask))  # inside jit a value cannot raise: NaN
    assert float(masked_var(x, one, unbiased=False)) == 0.0


# ---------------------------------------------------------------- advantage estimators


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.7)])
def test_gae_matches_reference_and_runs_under_jit(rng, dtype, gamma, lam):
    inputs = token_inputs(rng)
    r, v, m = inputs["token_level_rewards"], inputs["values"], inputs["response_mask"]
    with precision(dtype):
        adv, ret = compute_advantage(
            "gae", token_level_rewards=r.astype(dtype), values=v.astype(dtype), response_mask=m, gamma=gamma, lam=lam
        )
        assert adv.dtype == dtype and ret.dtype == dtype
        jitted = jax.jit(lambda r, v, m: compute_advantage("gae", token_level_rewards=r, values=v, response_mask=m))
        jit_adv, _ = jitted(r.astype(dtype), v.astype(dtype), m)
        close(jit_adv, ref_gae(r, v, m, 1.0, 1.0)[0], dtype)
    ref_adv, ref_ret = ref_gae(r, v, m, gamma, lam)
    close(adv, ref_adv, dtype)
    close(ret, ref_ret, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma", [1.0, 0.8])
def test_reinforce_plus_plus_and_remax_match_reference(rng, dtype, gamma):
    inputs = token_inputs(rng)
    r, m, b = inputs["token_level_rewards"], inputs["response_mask"], inputs["reward_baselines"]
    with precision(dtype):
        rpp = compute_advantage(
            "reinforce_plus_plus", token_level_rewards=r.astype(dtype), response_mask=m, gamma=gamma
        )
        remax = compute_advantage(
            "remax", token_level_rewards=r.astype(dtype), response_mask=m, reward_baselines=b.astype(dtype)
        )
    for actual, expected in zip(rpp, ref_reinforce_pp(r, m, gamma), strict=True):
        close(actual, expected, dtype)
    for actual, expected in zip(remax, ref_remax(r, m, b), strict=True):
        close(actual, expected, dtype)


def test_reinforce_plus_plus_carries_later_turn_rewards_over_observations():
    """A two-turn trajectory, tokens [turn 1, turn 1, observation, observation, turn 2, turn 2]: verl 0.9.1 carries
    the running return through the observation (which returns 0, adds no reward and no discount step), so turn 1
    sees turn 2's reward. Returns hand-computed with gamma = 0.9; row 1's reward inside the observation is dropped."""
    mask = np.array([[1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0]], np.float64)
    rewards = np.array([[0, 0, 0, 0, 0, 1.0], [0, 0.5, 0, 2.0, 0, 1.0], [0, 0, 0, 1.0, 0, 0]])
    expected = np.array(
        [
            [0.729, 0.81, 0, 0, 0.9, 1.0],  # 0.9 ** 3, 0.9 ** 2: two discount steps back to turn 1, not four
            [1.179, 1.31, 0, 0, 0.9, 1.0],  # 1.31 = 0.5 + 0.9 ** 2; 1.179 = 0.9 * 1.31
            [0.729, 0.81, 0.9, 1.0, 0, 0],  # a right-padded single turn, as before
        ]
    )
    for dtype in DTYPES:
        with precision(dtype):
            adv, ret = compute_advantage(
                "reinforce_plus_plus", token_level_rewards=rewards.astype(dtype), response_mask=mask, gamma=0.9
            )
        close(ret, expected, dtype)
        close(adv, ref_whiten(expected, mask) * mask, dtype)


GROUPED = {
    "grpo": lambda r, m, index: ref_grpo(r, m, index, norm_by_std=True),
    "rloo": ref_rloo,
    "reinforce_plus_plus_baseline": ref_reinforce_pp_baseline,
    "opo": ref_opo,
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("estimator", sorted(GROUPED))
def test_grouped_estimators_match_reference(rng, dtype, estimator):
    inputs = token_inputs(rng)
    r, m, index = inputs["token_level_rewards"], inputs["response_mask"], group_index()
    with precision(dtype):
        adv, ret = compute_advantage(estimator, token_level_rewards=r.astype(dtype), response_mask=m, index=index)
    expected = GROUPED[estimator](r, m, index)
    close(adv, expected, dtype)
    close(ret, expected, dtype)
    assert not np.asarray(adv)[0].any()  # the all-masked row gets no advantage


def test_dr_grpo_and_index_types(rng):
    inputs = token_inputs(rng)
    r, m = inputs["token_level_rewards"], inputs["response_mask"]
    index = group_index()
    adv, _ = compute_advantage(
        "grpo", token_level_rewards=r, response_mask=m, index=index.tolist(), norm_adv_by_std=False
    )
    close(adv, ref_grpo(r, m, index, norm_by_std=False), np.float32)
    renumber = {key: 100 - i for i, key in enumerate(dict.fromkeys(index.tolist()))}
    as_ints = np.array([renumber[key] for key in index], dtype=np.int64)  # the same partition as numpy int ids
    same, _ = compute_advantage("grpo", token_level_rewards=r, response_mask=m, index=as_ints)
    close(same, ref_grpo(r, m, index, norm_by_std=True), np.float32)


def test_opo_group_of_empty_responses_has_zero_baseline(rng):
    r, m = rng.normal(size=(4, T)), ragged_mask(rng, bs=4)
    m[1] = 0  # rows 0 and 1 form a group with no valid token
    adv, _ = compute_advantage("opo", token_level_rewards=r, response_mask=m, index=[0, 0, 1, 1])
    assert np.isfinite(np.asarray(adv)).all() and not np.asarray(adv)[:2].any()
    close(adv[2:], ref_opo(r[2:], m[2:], [1, 1]), np.float32)


def test_estimator_registry_and_input_errors(rng):
    inputs = token_inputs(rng)
    r, m = inputs["token_level_rewards"], inputs["response_mask"]
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'nope'.*gae.*grpo.*opo.*remax.*rloo"):
        compute_advantage("nope", token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match="needs `values`"):
        compute_advantage("gae", token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match="needs `index`"):
        compute_advantage("grpo", token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match=r"values has shape \(9, 6\), expected \(9, 7\)"):
        compute_advantage("gae", token_level_rewards=r, response_mask=m, values=r[:, :-1])
    with pytest.raises(ValueError, match="index has 3 entries"):
        compute_advantage("grpo", token_level_rewards=r, response_mask=m, index=[0, 1, 2])
    with pytest.raises(ValueError, match="hashable"):
        compute_advantage("grpo", token_level_rewards=r, response_mask=m, index=[[i] for i in range(BS)])

    @algos.register_advantage_estimator("test_scaled_score")
    def scaled_score(token_level_rewards, response_mask, gamma):
        adv = gamma * jnp.sum(token_level_rewards, -1, keepdims=True) * response_mask
        return adv, adv

    assert "test_scaled_score" in algos.advantage_estimators()
    adv, _ = compute_advantage("test_scaled_score", token_level_rewards=r, response_mask=m, gamma=0.5)
    close(adv, 0.5 * r.sum(-1, keepdims=True) * m, np.float32)
    with pytest.raises(ValueError, match="already registered"):
        algos.register_advantage_estimator("test_scaled_score")(lambda token_level_rewards: None)
    with pytest.raises(ValueError, match=r"parameters \['temperature'\]"):
        algos.register_advantage_estimator("test_bad")(lambda token_level_rewards, temperature: None)


# ---------------------------------------------------------------- KL


@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_penalties_match_reference(rng, dtype):
    logp, ref = rng.normal(size=(BS, T)) * 8, rng.normal(size=(BS, T)) * 8  # wide enough to hit the k3 clamps
    expected = {
        "k1": logp - ref,
        "abs": np.abs(logp - ref),
        "k2": 0.5 * (logp - ref) ** 2,
        "k3": np.clip(np.exp(np.clip(ref - logp, -20, 20)) - np.clip(ref - logp, -20, 20) - 1, -10, 10),
    }
    assert (expected["k3"] == 10).any() and (expected["k3"] < 10).any()
    with precision(dtype):
        for kind, alias in [("k1", "kl"), ("abs", "abs"), ("k2", "mse"), ("k3", "low_var_kl")]:
            close(kl_penalty(logp.astype(dtype), ref.astype(dtype), kind), expected[kind], dtype)
            close(kl_penalty(logp.astype(dtype), ref.astype(dtype), alias), expected[kind], dtype)
    with pytest.raises(ValueError, match=r"unknown KL penalty kind 'k4'.*low_var_kl"):
        kl_penalty(logp, ref, "k4")


def test_kl_controllers_follow_formula_and_restore(rng):
    ctrl = make_kl_controller("adaptive", kl_coef=0.05, target_kl=0.1, horizon=1000)
    value = 0.05
    for current_kl, n_steps in zip(rng.uniform(0, 0.3, size=6), rng.integers(8, 256, size=6), strict=True):
        ctrl.update(current_kl, n_steps)
        value *= 1 + min(max(current_kl / 0.1 - 1, -0.2), 0.2) * n_steps / 1000
        assert ctrl.value == pytest.approx(value, rel=1e-12)
    assert ctrl.value != 0.05
    restored = AdaptiveKLController(init_kl_coef=0.05, target_kl=0.1, horizon=1000)
    restored.load_state_dict(ctrl.state_dict())
    ctrl.update(0.2, 64)
    restored.update(0.2, 64)
    assert restored.value == ctrl.value

    fixed = make_kl_controller("fixed", kl_coef=0.3)
    fixed.update(5.0, 100)
    assert isinstance(fixed, FixedKLController) and fixed.state_dict() == {"value": 0.3}
    with pytest.raises(ValueError, match="exactly the key 'value'"):
        fixed.load_state_dict({"value": 1.0, "target": 2.0})
    with pytest.raises(ValueError, match="horizon must be > 0"):
        AdaptiveKLController(0.1, 0.1, 0)
    with pytest.raises(ValueError, match="needs target_kl and horizon"):
        make_kl_controller("adaptive", kl_coef=0.1)
    with pytest.raises(ValueError, match="unknown KL controller kind 'pid'"):
        make_kl_controller("pid", kl_coef=0.1)


# ---------------------------------------------------------------- aggregation and losses


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_matches_reference(rng, dtype, mode):
    loss, m = rng.normal(size=(BS, T)), ragged_mask(rng)
    with precision(dtype):
        close(agg_loss(loss.astype(dtype), m, mode), ref_agg(loss, m, mode), dtype)
        close(
            agg_loss(loss.astype(dtype), m, mode, global_tokens=40, global_seqs=13),
            ref_agg(loss, m, mode, 40, 13),
            dtype,
        )
    close(agg_loss(loss, m, mode, norm_length=32), ref_agg(loss, m, mode, norm_length=32), np.float32)
    assert float(agg_loss(loss, np.zeros_like(m), mode)) == 0.0
    in_loss = np.arange(BS) < BS - 2  # the last two rows are not the mini-batch's (padding, or left out)
    masked = m * in_loss[:, None]
    tokens, rows = mask_counts(masked, in_loss)
    assert float(tokens) == masked.sum() and float(rows) == BS - 2 and float(mask_counts(masked)[1]) == BS
    close(
        agg_loss(loss, masked, mode, global_tokens=tokens, global_seqs=rows),
        ref_agg(loss[:-2], m[:-2], mode),
        np.float32,
    )
    with pytest.raises(ValueError, match=r"unknown loss aggregation mode 'token-max'.*token-sum"):
        agg_loss(loss, m, "token-max")


def test_micro_batches_with_global_counts_sum_to_the_mini_batch(rng):
    """Gradient accumulation, every aggregation mode: micro-batch PPO losses of a tiny linear policy, normalised by the
    mini-batch's counts, add up to the mini-batch loss, and so do their gradients."""
    bs, micro, dim = 12, 4, 5
    x, m = rng.normal(size=(bs, T, dim)).astype(np.float32), ragged_mask(rng, bs=bs)
    old_logp = np.log(rng.uniform(0.2, 0.8, size=(bs, T))).astype(np.float32)
    adv = rng.normal(size=(bs, T)).astype(np.float32)
    params = {"w": rng.normal(size=dim).astype(np.float32), "b": np.float32(0.1)}

    @jax.jit
    def losses_and_grads(params, x, old_logp, adv, m, tokens, seqs):
        def loss(params, mode):
            logp = jax.nn.log_sigmoid(x @ params["w"] + params["b"])
            counts = dict(global_tokens=tokens, global_seqs=seqs)
            return policy_loss("ppo", old_logp, logp, adv, m, loss_agg_mode=mode, **counts)[0]

        return {mode: jax.value_and_grad(loss)(params, mode) for mode in AGG_MODES}

    def run(rows, counts_of):
        return losses_and_grads(params, x[rows], old_logp[rows], adv[rows], m[rows], *mask_counts(counts_of))

    full = run(slice(0, bs), m)  # the mini-batch's own counts: the ordinary loss
    new_logp = -np.log1p(np.exp(-(x.astype(np.float64) @ params["w"] + params["b"])))
    ref_tokens = ref_ppo_tokens(old_logp, new_logp, adv, 0.2, 0.2, 3.0)[0]
    for mode in AGG_MODES:
        close(full[mode][0], ref_agg(ref_tokens, m, mode), np.float32)
    splits = [slice(i, i + micro) for i in range(0, bs, micro)]
    parts = [run(rows, m) for rows in splits]  # every micro-batch normalised by the mini-batch's counts
    local = [run(rows, m[rows]) for rows in splits]  # ... by its own counts (what a per-micro-batch mean does)
    for mode in AGG_MODES:
        full_loss, full_grad = full[mode]
        np.testing.assert_allclose(sum(p[mode][0] for p in parts), full_loss, rtol=2e-6)
        for key in params:
            np.testing.assert_allclose(sum(p[mode][1][key] for p in parts), full_grad[key], rtol=2e-5, atol=1e-6)
        own_mean = np.mean([p[mode][0] for p in local])
        if mode == "token-mean":  # micro-batches hold different numbers of tokens: a mean of means is wrong
            assert abs(own_mean - full_loss) > 1e-4
        elif mode.startswith("seq-mean"):  # every row counts (verl's rows), so equal micro-batches average right
            np.testing.assert_allclose(own_mean, full_loss, rtol=2e-6)


@pytest.mark.parametrize("name", ["ppo", "gspo", "pg", "value"])
def test_loss_metrics_of_micro_batches_with_global_counts_sum_to_the_mini_batch_token_means(rng, name):
    """Clip fractions and ppo_kl given the mini-batch's counts are each micro-batch's share of the mini-batch's token
    mean (not the micro-batch's own mean): summed over micro-batches of unequal token counts they equal the numpy
    token means over the whole mini-batch."""
    bs, micro = 12, 3
    m = ragged_mask(rng, bs=bs)
    old, adv = rng.normal(size=(bs, T)), rng.normal(size=(bs, T))
    new = old + rng.normal(size=(bs, T)) * 0.8
    new[1, :2], adv[1, :2] = old[1, :2] + 1.5, -np.abs(adv[1, :2])  # the dual clip bounds these tokens
    old, new, adv = (a.astype(np.float32) for a in (old, new, adv))  # the flags compare float32 terms, as in training
    tokens, seqs = (float(c) for c in mask_counts(m))

    def metrics(rows, **counts):
        if name == "value":
            return value_loss(new[rows], adv[rows], old[rows], m[rows], cliprange_value=0.5, **counts)
        return policy_loss(name, old[rows], new[rows], adv[rows], m[rows], **counts)

    full = metrics(slice(0, bs))
    parts = [metrics(slice(i, i + micro), global_tokens=tokens, global_seqs=seqs) for i in range(0, bs, micro)]
    local = [metrics(slice(i, i + micro)) for i in range(0, bs, micro)]
    for position, value in enumerate(full):
        np.testing.assert_allclose(sum(float(p[position]) for p in parts), float(value), rtol=1e-5, atol=1e-7)
    _, clipped, lower = ref_ppo_tokens(old, new, adv, 0.2, 0.2, 3.0)
    if name == "ppo":
        for position, flags in ((1, clipped), (2, old - new), (3, lower)):
            close(full[position], ref_masked_mean(flags, m), np.float32)
        assert abs(np.mean([float(p[1]) for p in local]) - float(full[1])) > 1e-3  # a mean of means would differ
    if name == "value":
        v_clip = np.clip(new, old - 0.5, old + 0.5)
        close(full[1], ref_masked_mean((v_clip - adv) ** 2 > (new - adv) ** 2, m), np.float32)
    assert float(token_share(old - new, m, global_tokens=0.0)) == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_dual_clip_ppo_matches_reference(rng, dtype, mode):
    m = ragged_mask(rng)
    old, adv = rng.normal(size=(BS, T)), rng.normal(size=(BS, T))
    new = old + rng.normal(size=(BS, T)) * 0.8
    new[1, :2], adv[1, :2] = old[1, :2] + 1.5, -np.abs(adv[1, :2])  # ratio e^1.5 > clip_ratio_c with A < 0
    loss, clipped, lower = ref_ppo_tokens(old, new, adv, 0.2, 0.28, 3.0)
    assert (clipped * m).any() and (lower * m).any() and ((1 - clipped) * m).any()  # every branch is exercised
    with precision(dtype):
        out = policy_loss(
            "ppo",
            old.astype(dtype),
            new.astype(dtype),
            adv.astype(dtype),
            m,
            clip_ratio_low=0.2,
            clip_ratio_high=0.28,
            clip_ratio_c=3.0,
            loss_agg_mode=mode,
        )
    expected = (ref_agg(loss, m, mode), ref_masked_mean(clipped, m), ref_masked_mean(old - new, m))
    for actual, want in zip(out[:3], expected, strict=True):
        close(actual, want, dtype)
    close(out[3], ref_masked_mean(lower, m), dtype)
    with pytest.raises(ValueError, match=r"clip_ratio_c .* must be > 1\.0, got 0\.5"):
        policy_loss("ppo", old, new, adv, m, clip_ratio_c=0.5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gspo_matches_reference_in_value_and_gradient(rng, dtype):
    m = ragged_mask(rng)
    old, adv = rng.normal(size=(BS, T)), rng.normal(size=(BS, T))
    new = old + rng.normal(size=(BS, T)) * 0.3
    counts = m.sum(-1)
    seq_ratio = np.exp(np.array([sum((new - old)[i] * m[i]) / max(counts[i], 1) for i in range(BS)]))
    ratio = np.repeat(seq_ratio[:, None], T, axis=1)
    l1, l2 = -adv * ratio, -adv * np.clip(ratio, 0.8, 1.2)
    # d loss / d logp[i, t]: the unclipped term's -A * s (through pi / sg[pi]) weighted by the seq-mean-token-mean
    # (over all BS rows, the empty row 0 included, as verl divides by the mini-batch's rows).
    weight = m / (counts[:, None] + 1e-8) / BS
    grad_ref = np.where(l2 > l1, 0.0, -adv * ratio) * weight
    assert ((l2 > l1) * m).any() and ((l2 <= l1) * m).any()
    with precision(dtype):
        args = (old.astype(dtype), new.astype(dtype), adv.astype(dtype), m)
        pg_loss, clipfrac, ppo_kl, lower = policy_loss("gspo", *args)
        grad = jax.jit(jax.grad(lambda logp: policy_loss("gspo", args[0], logp, *args[2:])[0]))(args[1])
    close(pg_loss, ref_agg(np.maximum(l1, l2), m, "seq-mean-token-mean"), dtype)
    close(clipfrac, ref_masked_mean((l2 > l1).astype(float), m), dtype)
    close(ppo_kl, ref_masked_mean(old - new, m), dtype)
    close(grad, grad_ref, dtype)
    assert float(lower) == 0.0


def test_plain_policy_gradient_and_policy_loss_registry(rng):
    m, old, new, adv = ragged_mask(rng), *(rng.normal(size=(BS, T)) for _ in range(3))
    pg_loss, clipfrac, ppo_kl, lower = policy_loss("pg", old, new, adv, m, loss_agg_mode="seq-mean-token-mean")
    close(pg_loss, ref_agg(-adv * new, m, "seq-mean-token-mean"), np.float32)
    close(ppo_kl, ref_masked_mean(old - new, m), np.float32)
    assert float(clipfrac) == 0.0 and float(lower) == 0.0
    assert {"ppo", "gspo", "pg"} <= set(algos.policy_losses())
    with pytest.raises(ValueError, match=r"unknown policy loss 'vanila'.*gspo, .*pg, ppo, .*vanilla"):
        policy_loss("vanila", old, new, adv, m)
    with pytest.raises(ValueError, match=r"policy loss 'pg' does not take \['clip_ratio_low'\]"):
        policy_loss("pg", old, new, adv, m, clip_ratio_low=0.2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_value_loss_matches_reference(rng, dtype):
    m = ragged_mask(rng)
    vpreds, returns, values = rng.normal(size=(BS, T)), rng.normal(size=(BS, T)), rng.normal(size=(BS, T))
    clip = 0.5
    token, clipped = np.zeros((BS, T)), np.zeros((BS, T))
    for idx in np.ndindex(BS, T):
        v_clip = min(max(vpreds[idx], values[idx] - clip), values[idx] + clip)
        a, b = (vpreds[idx] - returns[idx]) ** 2, (v_clip - returns[idx]) ** 2
        token[idx], clipped[idx] = max(a, b), b > a
    assert (clipped * m).any() and ((1 - clipped) * m).any()
    with precision(dtype):
        for mode in AGG_MODES:
            vf_loss, vf_clipfrac = value_loss(
                *(a.astype(dtype) for a in (vpreds, returns, values)), m, cliprange_value=clip, loss_agg_mode=mode
            )
            close(vf_loss, 0.5 * ref_agg(token, m, mode), dtype)
            close(vf_clipfrac, ref_masked_mean(clipped, m), dtype)


# ---------------------------------------------------------------- logits


def test_entropy_and_logprobs_from_logits_are_stable(rng):
    vocab = 11
    logits = rng.normal(size=(3, 4, vocab)) * 40  # exp would overflow float32 without the logsumexp shift
    labels = rng.integers(0, vocab, size=(3, 4))
    ref_entropy, ref_logp = np.zeros((3, 4)), np.zeros((3, 4))
    for idx in np.ndindex(3, 4):
        z = logits[idx]
        lse = z.max() + math.log(sum(math.exp(v - z.max()) for v in z))
        logp = z - lse
        ref_entropy[idx] = -sum(math.exp(lp) * lp for lp in logp)
        ref_logp[idx] = logp[labels[idx]]
    # float32 logits of magnitude ~100: rounding of order 100 * 1.2e-7 per term.
    np.testing.assert_allclose(entropy_from_logits(logits.astype(np.float32)), ref_entropy, atol=1e-4)
    np.testing.assert_allclose(logprobs_from_logits(logits.astype(np.float32), labels), ref_logp, rtol=1e-6, atol=1e-4)
    with jax.enable_x64(True):
        np.testing.assert_allclose(entropy_from_logits(logits), ref_entropy, atol=1e-10)
        np.testing.assert_allclose(logprobs_from_logits(logits, labels), ref_logp, rtol=1e-12, atol=1e-10)
    bf16 = logprobs_from_logits(jnp.asarray(logits, jnp.bfloat16), labels)
    assert bf16.dtype == jnp.float32 and np.isfinite(np.asarray(bf16)).all()
