"""The off-policy correction in a run: verl's `algorithm.rollout_correction` keys load unchanged into
`actor.rollout_correction`; asynchronous runs get token-level TIS by default, with a warning (and a warning when
left uncorrected); a correction needs the separate old-log-prob pass; and the controller applies it before the
advantages, as verl does: rejected tokens leave the response mask (the advantages, the critic and the actor's token
counts see only the kept ones), the weights and the mask reach the actor, and the metrics are the whole batch's."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from hfjax.algos import rollout_correction
from hfjax.config.rl import load_rl_config
from hfjax.protocol import DataProto
from hfjax.trainer.step import Step
from hfjax.typed_config import ConfigError

BASE = {
    "model_path": "/unused",
    "data": {"train_files": ["/unused.parquet"], "train_batch_size": 4},
    "rollout": {"n": 2},
}
ASYNC = {"async": {"max_staleness": 1}, "trainer": {"placement": "disaggregated", "backend": "ray"}}
SINGLE_STEP = {"ppo_mini_batch_size": 8, "micro_batch_size": 4}  # one optimizer step: the update may reuse log probs
VERL_SECTION = """
rollout_is: sequence
rollout_is_threshold: "0.5_5.0"
rollout_is_batch_normalize: true
rollout_rs: token_k1,seq_mean_k3
rollout_rs_threshold: "0.8_1.25,0.01"
"""


def _config(correction=None, **sections):
    actor = {**SINGLE_STEP, **({"rollout_correction": correction} if correction is not None else {})}
    return load_rl_config({**BASE, **sections, "actor": actor})


def test_a_verl_section_loads_unchanged():
    section = yaml.safe_load(VERL_SECTION)
    correction = _config(section).actor.rollout_correction
    assert {key: getattr(correction, key) for key in section} == section
    with pytest.raises(ConfigError, match=r"actor\.rollout_correction\.rollout_rs: unknown option 'seq_max_k1'"):
        _config({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 2.0})
    with pytest.raises(ConfigError, match=r"rollout_rs_threshold: required with rollout_rs='token_k2'"):
        _config({"rollout_rs": "token_k2"})


def test_stale_rollouts_are_corrected_by_default_with_a_warning():
    with pytest.warns(UserWarning, match=r"max_staleness=1: .*rollout_is defaults to token"):
        cfg = _config(**ASYNC)
    assert cfg.actor.rollout_correction.rollout_is == "token"
    assert not cfg.reuses_update_log_probs  # the controller needs pi_old before the advantages
    with pytest.warns(UserWarning, match="without importance weights or rejection"):
        cfg = _config({"rollout_is": None}, **ASYNC)
    assert cfg.actor.rollout_correction.rollout_is is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _config({"rollout_is": "sequence"}, **ASYNC).actor.rollout_correction.rollout_is == "sequence"
        cfg = _config()  # synchronous: rollouts come from the trainer's policy, nothing is turned on
    assert cfg.actor.rollout_correction.rollout_is is None and cfg.reuses_update_log_probs


@pytest.mark.parametrize(
    "correction", [{"rollout_is": "token"}, {"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": 2.0}]
)
def test_a_correction_needs_the_separate_old_log_prob_pass(correction):
    assert not _config(correction).reuses_update_log_probs


def _batch(rng):
    """8 responses of 4 prompts (uid), ragged masks, a score per response, and pi_old / mu log probs whose sequence
    log ratios put some sequences outside [0.5, 2]."""
    lengths = np.array([6, 2, 5, 6, 1, 4, 6, 3])
    mask = (np.arange(6)[None] < lengths[:, None]).astype(np.int32)
    rollout = -rng.exponential(1.0, mask.shape).astype(np.float32)
    old = (rollout + rng.normal(0, 0.4, mask.shape)).astype(np.float32)
    scores = np.zeros(mask.shape, np.float32)
    scores[np.arange(8), lengths - 1] = rng.normal(size=8)
    arrays = {"response_mask": mask, "token_level_scores": scores, "old_log_probs": old, "rollout_log_probs": rollout}
    for key in ("input_ids", "attention_mask", "position_ids", "responses"):  # what an update sends along
        arrays[key] = np.ones_like(mask)
    uid = np.repeat(np.arange(4), 2).astype(object)
    return DataProto.from_dict(arrays, non_tensors={"uid": uid})


class _Recorder:
    """A role that records the batch an update receives."""

    def __init__(self):
        self.data = None

    def update_actor(self, data):
        self.data = data
        return DataProto(meta_info={"metrics": {}})


def test_the_controller_corrects_before_the_advantages_and_the_actor_gets_the_kept_tokens():
    settings = {"rollout_is": "token", "rollout_is_threshold": 1.5, "rollout_rs": "seq_sum_k1"}
    cfg = _config({**settings, "rollout_rs_threshold": 2.0})
    batch = _batch(np.random.default_rng(0))
    original = {key: np.array(value) for key, value in batch.batch.items()}
    actor = _Recorder()
    step = Step(cfg, {"actor": actor}, batch, 0, SimpleNamespace())
    step.advantages()
    step.advantages()  # a second call does not reject again
    step.update_actor()

    weights, kept, metrics = rollout_correction(
        original["old_log_probs"],
        original["rollout_log_probs"],
        original["response_mask"],
        **settings,
        rollout_rs_threshold=2.0,
    )
    kept = np.asarray(kept)
    assert 0 < kept.sum() < original["response_mask"].sum()  # some sequences rejected, some kept
    data = step.batch.batch
    np.testing.assert_array_equal(data["response_mask"], kept)
    assert data["response_mask"].dtype == np.int32
    np.testing.assert_array_equal(data["rollout_is_weights"], np.asarray(weights))
    assert all(not data["advantages"][row].any() for row in np.flatnonzero(~kept.any(-1)))  # rejected: no advantage
    assert data["advantages"][kept.astype(bool)].any()
    for key, value in metrics.items():
        assert step.metrics[key] == pytest.approx(float(value), rel=1e-6), key
    sent = actor.data.batch
    np.testing.assert_array_equal(sent["response_mask"], kept)  # the actor's token counts are the kept tokens
    np.testing.assert_array_equal(sent["rollout_is_weights"], np.asarray(weights))
    assert "rollout_log_probs" not in sent  # the controller measured the mismatch


def test_metrics_only_run_measures_on_the_controller_or_in_the_update():
    """No correction: the mask and advantages are untouched; with old log probs the controller logs the whole
    batch's mismatch metrics; when the update makes the old log probs itself, the actor gets the rollout's."""
    batch = _batch(np.random.default_rng(1))
    mask = np.array(batch.batch["response_mask"])
    step = Step(_config({"rollout_is": None}), {}, batch, 0, SimpleNamespace())
    step.advantages()
    np.testing.assert_array_equal(step.batch.batch["response_mask"], mask)
    assert "rollout_is_weights" not in step.batch.batch
    assert step.metrics["rollout_corr/log_prob_abs_diff"] > 0

    cfg, actor = _config(), _Recorder()
    assert cfg.reuses_update_log_probs
    batch = _batch(np.random.default_rng(1))
    batch.batch.pop("old_log_probs")
    step = Step(cfg, {"actor": actor}, batch, 0, SimpleNamespace())
    step.advantages()
    step.update_actor()
    assert not any(key.startswith("rollout_corr/") for key in step.metrics)
    assert "rollout_log_probs" in actor.data.batch and "old_log_probs" not in actor.data.batch


def test_a_correction_without_old_log_probs_says_what_to_call():
    batch = _batch(np.random.default_rng(2))
    batch.batch.pop("old_log_probs")
    step = Step(_config({"rollout_is": "token"}), {}, batch, 0, SimpleNamespace())
    with pytest.raises(ValueError, match=r"call step\.old_log_prob\(\) first"):
        step.advantages()
