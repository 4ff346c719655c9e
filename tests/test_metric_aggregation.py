"""Step metrics against numpy hand computations: the actor's and critic's update metrics are the same whatever the
micro-batch size (one micro-batch of the whole mini-batch, or four) and their clip fractions, ppo_kl, value loss and
rollout mismatch (`rollout_corr/*`: means over every token, extremes over every token) are the mini-batch's; the
reward KL penalty is verl's mean over sequences of their token means."""

from __future__ import annotations

import numpy as np
import pytest
from support.rl_setup import build_run_inputs, rl_config

from hfjax.algos import make_kl_controller
from hfjax.config.rl import load_rl_config
from hfjax.controller import LocalWorkerGroup
from hfjax.data.tokenize import position_ids
from hfjax.protocol import DataProto
from hfjax.trainer.roles import ControllerState, Scorer
from hfjax.trainer.step import Step
from hfjax.workers.actor import ActorRolloutRefWorker
from hfjax.workers.critic import CriticWorker

MINI, PROMPT, RESPONSE = 8, 5, 40
# unequal: micro-batches of two hold different token counts, and trim_padding cuts them to 16, 16, 32 and 40 columns
RESPONSE_LENGTHS = [40, 3, 10, 30, 5, 40, 20, 12]
CLIP_RATIO, CLIP_RATIO_C, CLIPRANGE_VALUE = 0.2, 3.0, 0.5


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_run_inputs(tmp_path_factory.mktemp("metric_aggregation"))


def _config(inputs, tmp_path, micro: int, mode: str = "token-mean"):
    sizes = {"ppo_mini_batch_size": MINI, "micro_batch_size": micro, "loss_agg_mode": mode}
    rollout = {"response_length": RESPONSE}
    return load_rl_config(rl_config(inputs, tmp_path, "ppo", actor=sizes, critic=sizes, rollout=rollout))


def _agg(token_losses: np.ndarray, mask: np.ndarray, mode: str) -> float:
    """token-mean, or seq-mean-token-sum-norm with the full response length as the constant normaliser."""
    if mode == "token-mean":
        return token_losses[mask].mean()
    return (token_losses * mask).sum() / mask.any(-1).sum() / RESPONSE


def _sequences(rng: np.random.Generator, vocab: int) -> dict[str, np.ndarray]:
    """Left-padded prompts of 2-5 tokens and right-padded responses of `RESPONSE_LENGTHS` tokens."""
    prompt_mask = np.zeros((MINI, PROMPT), np.int32)
    for row, length in enumerate(rng.integers(2, PROMPT + 1, MINI)):
        prompt_mask[row, PROMPT - length :] = 1
    response_mask = (np.arange(RESPONSE)[None] < np.array(RESPONSE_LENGTHS)[:, None]).astype(np.int32)
    attention_mask = np.concatenate([prompt_mask, response_mask], axis=1)
    input_ids = (rng.integers(3, vocab, attention_mask.shape) * attention_mask).astype(np.int32)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids(attention_mask),
        "responses": input_ids[:, PROMPT:],
        "response_mask": response_mask,
    }


def _update(group: LocalWorkerGroup, method: str, batch: dict[str, np.ndarray]) -> dict[str, float]:
    metrics = getattr(group, method)(DataProto.from_dict(batch)).meta_info["metrics"]
    return {k: float(np.mean(v)) for k, v in metrics.items() if k != "worker_seconds"}


def _assert_same(got: dict[str, float], want: dict[str, float]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_actor_metrics_do_not_depend_on_the_micro_batch_size(inputs, tmp_path, mode):
    """Four micro-batches of unequal token counts (and, trimmed, of unequal widths) against one: the same step."""
    rng = np.random.default_rng(0)
    metrics, reference = {}, {}
    for micro in (MINI, MINI // 4):
        cfg = _config(inputs, tmp_path / str(micro), micro, mode)
        group = LocalWorkerGroup(ActorRolloutRefWorker, cfg.actor, cfg.rollout, "actor", max_prompt_length=PROMPT)
        group.init_model()
        if not reference:
            batch = _sequences(rng, group.worker.policy.config.vocab_size)
            mask = batch["response_mask"].astype(bool)
            logp = group.compute_log_prob(DataProto.from_dict(batch)).batch["old_log_probs"].astype(np.float64)
            # ratios e^1.5 (beyond the dual clip), e^0.5, 1, e^-0.5: none near a clip boundary
            offsets = rng.choice([-1.5, -0.5, 0.0, 0.5], size=mask.shape)
            advantages = rng.normal(size=mask.shape)
            batch["old_log_probs"] = (logp + offsets).astype(np.float32)
            batch["advantages"] = advantages.astype(np.float32)
            batch["ref_log_prob"] = (logp + rng.normal(0, 0.3, mask.shape)).astype(np.float32)
            batch["rollout_log_probs"] = (batch["old_log_probs"] - rng.normal(0, 0.3, mask.shape)).astype(np.float32)
            gap = batch["old_log_probs"].astype(np.float64) - batch["rollout_log_probs"]  # log pi_old - log mu
            ratio = np.exp(-offsets)
            clipped = ((advantages > 0) & (ratio > 1 + CLIP_RATIO)) | ((advantages < 0) & (ratio < 1 - CLIP_RATIO))
            lower = (advantages < 0) & (ratio > CLIP_RATIO_C)
            clip_loss = np.maximum(-advantages * ratio, -advantages * np.clip(ratio, 1 - CLIP_RATIO, 1 + CLIP_RATIO))
            token_losses = np.where(advantages < 0, np.minimum(clip_loss, -advantages * CLIP_RATIO_C), clip_loss)
            reference = {
                "actor/pg_loss": _agg(token_losses, mask, mode),
                "actor/pg_clipfrac": clipped[mask].mean(),
                "actor/pg_clipfrac_lower": lower[mask].mean(),
                "actor/ppo_kl": offsets[mask].mean(),
                "rollout_corr/log_prob_abs_diff": np.abs(gap[mask]).mean(),
                "rollout_corr/log_prob_abs_diff_max": np.abs(gap[mask]).max(),
                "rollout_corr/kl": -gap[mask].mean(),
                "rollout_corr/k3_kl": (np.expm1(gap[mask]) - gap[mask]).mean(),
                "rollout_corr/ratio_mean": np.exp(gap[mask]).mean(),
                "rollout_corr/ratio_max": np.exp(gap[mask]).max(),
                "rollout_corr/ratio_min": np.exp(gap[mask]).min(),
            }
        metrics[micro] = _update(group, "update_actor", batch)
    assert 0 < reference["actor/pg_clipfrac"] < 1 and 0 < reference["actor/pg_clipfrac_lower"] < 1
    _assert_same(metrics[MINI // 4], metrics[MINI])
    for key, want in reference.items():
        assert metrics[MINI][key] == pytest.approx(want, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_critic_metrics_do_not_depend_on_the_micro_batch_size(inputs, tmp_path, mode):
    rng = np.random.default_rng(1)
    metrics, reference = {}, {}
    for micro in (MINI, MINI // 4):
        cfg = _config(inputs, tmp_path / str(micro), micro, mode)
        group = LocalWorkerGroup(CriticWorker, cfg.critic)
        group.init_model()
        if not reference:
            batch = _sequences(rng, group.worker.critic.config.vocab_size)
            mask = batch["response_mask"].astype(bool)
            vpreds = group.compute_values(DataProto.from_dict(batch)).batch["values"].astype(np.float64)
            old = vpreds + rng.choice([-1.0, 0.0, 1.0], size=mask.shape)  # |offset| 1: clipped by 0.5
            returns = vpreds + rng.normal(size=mask.shape)
            batch["values"], batch["returns"] = old.astype(np.float32), returns.astype(np.float32)
            unclipped = np.square(vpreds - returns)
            clipped = np.square(np.clip(vpreds, old - CLIPRANGE_VALUE, old + CLIPRANGE_VALUE) - returns)
            reference = {
                "critic/vf_clipfrac": (clipped > unclipped)[mask].mean(),
                "critic/vf_loss": 0.5 * _agg(np.maximum(unclipped, clipped), mask, mode),
            }
        metrics[micro] = _update(group, "update_critic", batch)
    assert 0 < reference["critic/vf_clipfrac"] < 1
    _assert_same(metrics[MINI // 4], metrics[MINI])
    for key, want in reference.items():
        assert metrics[MINI][key] == pytest.approx(want, rel=1e-5, abs=1e-6), key


def test_reward_kl_penalty_is_the_mean_over_sequences_of_their_token_means(inputs, tmp_path):
    """`actor/reward_kl_penalty` and the adaptive KL controller's input are verl's `apply_kl_penalty` KL: each
    sequence's token-mean KL, averaged over sequences (not one token mean over the batch, which weights long
    responses more)."""
    rng = np.random.default_rng(2)
    lengths = np.array([1, 6, 2, 5])
    mask = (np.arange(RESPONSE)[None] < lengths[:, None]).astype(np.int32)
    old = rng.normal(-2, 0.5, mask.shape)
    ref = old - np.where(np.arange(len(lengths)) == 0, 2.0, 0.1)[:, None]  # the one-token response: a large KL
    kl = (old - ref) * mask  # k1 ("kl"), zero on padding
    want = np.mean(kl.sum(-1) / lengths)
    token_mean = kl.sum() / mask.sum()
    assert abs(want - token_mean) > 0.1

    init, horizon = 0.05, 10
    target = want * 1.1  # the controller's error stays inside its +-0.2 clip
    config = rl_config(inputs, tmp_path, "ppo")
    config["algorithm"].update(kl_ctrl="adaptive", kl_coef=init, target_kl=float(target), horizon=horizon)
    cfg = load_rl_config(config)
    assert cfg.algorithm.use_kl_in_reward and cfg.algorithm.kl_penalty == "kl"
    state = ControllerState(
        make_kl_controller("adaptive", kl_coef=init, target_kl=target, horizon=horizon), 0.0, Scorer(None)
    )
    scores = rng.normal(size=mask.shape).astype(np.float32) * mask
    batch = DataProto.from_dict(
        {
            "response_mask": mask,
            "token_level_scores": scores,
            "old_log_probs": old.astype(np.float32),
            "ref_log_prob": ref.astype(np.float32),
        }
    )
    step = Step(cfg, {}, batch, 0, state)
    rewards = step._rewards("token_level_scores")

    np.testing.assert_allclose(rewards, scores - init * kl, rtol=1e-5, atol=1e-6)
    assert step.metrics["actor/reward_kl_penalty"] == pytest.approx(want, rel=1e-5)
    assert step.metrics["actor/reward_kl_penalty_coeff"] == init
    error = np.clip(want / target - 1, -0.2, 0.2)
    assert state.kl_ctrl.value == pytest.approx(init * (1 + error * len(lengths) / horizon), rel=1e-6)
