"""The step's roles and controller state (`hfjax.trainer.roles`): the reward model is called like every role (its
worker group's timeline lane, the dispatch metrics), the controller's rewards stay on the controller lane, and the
controller state survives a checkpoint round trip."""

from __future__ import annotations

import numpy as np
import pytest

from hfjax.algos.kl import make_kl_controller
from hfjax.config.rl import load_rl_config
from hfjax.protocol import DataProto
from hfjax.trainer.roles import ControllerState, Roles, Scorer, group_names
from hfjax.trainer.step import Step
from hfjax.trainer.timeline import Timeline


class _RewardModel:
    """A reward model's group handle: a score per row (the sum of its response tokens), and the worker's seconds."""

    def __init__(self) -> None:
        self.calls = 0

    def compute_rm_score(self, data: DataProto) -> DataProto:
        self.calls += 1
        scores = data.batch["responses"].sum(-1).astype(np.float32)
        return DataProto.from_dict({"rm_scores": scores}, meta_info={"metrics": {"worker_seconds": [0.25, 0.5]}})


def _batch(rows: int) -> DataProto:
    rng = np.random.default_rng(0)
    responses = rng.integers(0, 5, size=(rows, 3)).astype(np.int32)
    env = np.zeros((rows, 3), np.float32)
    env[:, -1] = np.arange(rows, dtype=np.float32)  # an environment reward on each trajectory's last token
    return DataProto.from_dict({"responses": responses, "response_mask": np.ones_like(responses), "env_rewards": env})


def test_the_reward_model_is_a_role_call_on_its_lane_with_its_dispatch_metrics(tmp_path):
    cfg = load_rl_config(
        {
            "model_path": "unused",
            "rollout": {"n": 2},
            "reward": {"use_rule": False, "reward_model": {"model_path": "unused-rm"}},
            "trainer": {"placement": "split", "backend": "ray"},
        }
    )
    lanes = group_names(cfg)
    assert lanes["reward_model"] != lanes["actor"]  # its own worker group under `split`
    timeline = Timeline(tmp_path / "timeline.jsonl")
    reward_model, batch = _RewardModel(), _batch(4)
    state = ControllerState(make_kl_controller("fixed", kl_coef=0.0), 0.0, Scorer(None))
    step = Step(cfg, {"actor": object(), "reward_model": reward_model}, batch, 3, state, timeline=timeline)
    sent = batch.nbytes()  # what the reward model is sent: the batch before the scores join it
    step.score()

    responses, env = batch.batch["responses"], batch.batch["env_rewards"]
    np.testing.assert_array_equal(step.batch.batch["scores"], responses.sum(-1) + env.sum(-1))
    spans = {(s.group, s.name, s.step) for s in timeline.spans()}
    assert spans == {(lanes["reward_model"], "compute_rm_score", 3), ("controller", "reward", 3)}
    assert reward_model.calls == 1
    assert step.metrics["perf/worker_seconds"] == 0.5  # the slowest rank's
    assert step.metrics["perf/dispatch_bytes_sent"] == sent == 3 * 4 * 3 * 4
    assert step.metrics["perf/dispatch_bytes_received"] == 4 * 4  # four float32 scores


def test_the_controller_state_round_trips_through_its_state_dict():
    cfg = load_rl_config(
        {
            "model_path": "unused",
            "rollout": {"n": 2},
            "reward": {"use_rule": False},
            "algorithm": {"kl_ctrl": "adaptive", "kl_coef": 0.1, "target_kl": 0.5, "horizon": 100},
        }
    )
    state = ControllerState.from_config(cfg, tokenizer=None)
    state.kl_ctrl.update(2.0, 10)
    state.lagrange = 1.75
    restored = ControllerState.from_config(cfg, tokenizer=None)
    restored.load_state_dict(state.state_dict())
    assert (restored.kl_ctrl.value, restored.lagrange) == (state.kl_ctrl.value, 1.75)
    assert restored.kl_ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100.0))


def test_roles_name_what_the_run_does_not_start_and_type_checks_the_role_kind():
    roles = Roles({"actor": object()}, "algorithm.name=grpo")
    with pytest.raises(
        ValueError, match=r"calls the critic role, which this run does not start \(algorithm.name=grpo\)"
    ):
        roles.value_model("critic")
    with pytest.raises(ValueError, match=r"value model 'actor': expected one of \('critic', 'cost_critic'\)"):
        roles.value_model("actor")
    assert "actor" in roles and "critic" not in roles and list(roles) == ["actor"]
    assert roles.get("critic") is None and roles.get("actor") is roles["actor"]
