"""Multi-turn trajectories in training: environment tokens never reach the policy loss (zero gradient, the loss of a
sequence with them removed), the trainer's log probs of model tokens equal the rollout's with environment tokens in
the context, rewards sit on each turn's last model token, and GRPO and PPO run on trajectories with turn metrics."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.rl_setup import build_run_inputs, rl_config, with_moe_policy

from hfjax.algos.losses import policy_loss
from hfjax.config.rl import load_rl_config
from hfjax.controller import LocalWorkerGroup
from hfjax.data import BatchLoader, PromptDataset
from hfjax.models import load_tokenizer
from hfjax.protocol import DataProto
from hfjax.rewards.token_level import last_response_index, scores_to_token_level
from hfjax.trainer.launch import run_rl
from hfjax.typed_config import ConfigError
from hfjax.workers.actor import ActorRolloutRefWorker

pytest_plugins = ["support.ray_cluster"]
# wall times, throughput, the env wait share and the KV cache per device vary between placements; so do the counts
# of compiled generation programs (rollout/*_programs), as each host compiles the shapes of its own trajectories
VARIABLE = ("timing_s/", "timeline/", "perf/", "agent/env_wait_share", "async/", "sync/")
PER_PROCESS = "_programs"
LAYOUTS = {  # the same global layouts on 1 x 8 and 2 x 4 devices
    "actor": {"train_layout": {"mesh": {"fsdp": 8}, "rules": "fsdp"}, "ppo_mini_batch_size": 8, "micro_batch_size": 8},
    "critic": {"layout": {"mesh": {"fsdp": 8}, "rules": "fsdp"}, "ppo_mini_batch_size": 8, "micro_batch_size": 8},
}

ENV_FILE = '''
from hfjax.envs import Environment, StepResult


class EchoEnv(Environment):
    """Ends after 1 + (ground truth's length) % 3 turns; each observation is 3 tokens; the final reward is the
    number of distinct characters of the last turn (so samples differ), 0.25 after every other turn."""

    def reset(self, row):
        self.turns, self.left = 0, 1 + len(str(row["reward_model"]["ground_truth"])) % 3

    def step(self, action):
        self.turns += 1
        if self.turns >= self.left:
            return StepResult(None, reward=float(len(set(action))), done=True)
        return StepResult([5, 6, 7], reward=0.25)
'''


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent_rl")
    out = build_run_inputs(root)
    (root / "echo_env.py").write_text(ENV_FILE)
    out["env"] = f"{root / 'echo_env.py'}:EchoEnv"
    return out


def _agent_config(inputs, run_dir, algorithm="grpo", **extra):
    rollout = {"response_length": 24, "agent": {"env": inputs["env"], "max_turns": 3, "max_tokens_per_turn": 5}}
    return rl_config(inputs, run_dir, algorithm, rollout=rollout, reward={"use_rule": False}, **extra)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_policy_loss_gradient_is_zero_on_environment_tokens(mode):
    rng = np.random.default_rng(0)
    rows, width = 3, 12
    model_tokens = rng.random((rows, width)) < 0.6
    model_tokens[:, 0] = True
    old, adv = rng.normal(-2, 0.3, (rows, width)), rng.normal(0, 1, (rows, width))
    logp = old + rng.normal(0, 0.1, (rows, width))

    def loss(logp_, old_, adv_, mask_):
        return policy_loss("ppo", old_, logp_, adv_, mask_, loss_agg_mode=mode)[0]

    mask = jnp.asarray(model_tokens, jnp.float32)
    grad = np.asarray(jax.grad(loss)(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), mask))
    assert not grad[~model_tokens].any()  # exactly zero on environment tokens
    assert np.abs(grad[model_tokens]).min() > 0
    # the same loss as the sequences with the environment tokens removed (model tokens moved together)
    compact = np.zeros((rows, width), bool)
    packed = [np.zeros((rows, width)) for _ in range(3)]
    for i in range(rows):
        n = model_tokens[i].sum()
        compact[i, :n] = True
        for out, src in zip(packed, (logp, old, adv), strict=True):
            out[i, :n] = src[i, model_tokens[i]]
    removed = loss(*(jnp.asarray(a) for a in packed), jnp.asarray(compact, jnp.float32))
    assert float(loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), mask)) == pytest.approx(float(removed))


def test_rewards_sit_on_the_last_model_token_of_a_trajectory():
    mask = np.array([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 0, 1, 1, 1]])
    assert last_response_index(mask).tolist() == [4, 0, 0, 5]
    levels = scores_to_token_level(np.array([1.0, 2.0, 3.0, 4.0]), mask)
    assert levels[0, 4] == 1.0 and levels[1, 0] == 2.0 and not levels[2].any() and levels[3, 5] == 4.0
    assert levels.sum() == 7.0


def test_trainer_log_probs_of_model_tokens_equal_the_rollout_with_observations_in_context(inputs):
    cfg = load_rl_config(_agent_config(inputs, "unused"))
    group = LocalWorkerGroup(ActorRolloutRefWorker, cfg.actor, cfg.rollout, "actor_rollout", max_prompt_length=16)
    group.init_model()
    data = PromptDataset(cfg.data.train_files, load_tokenizer(inputs["policy"]), max_prompt_length=16)
    batch = next(iter(BatchLoader(data, 4, shuffle=False)))
    prompts = DataProto.from_dict(batch.tensors, batch.non_tensors, meta_info={"n": 2, "seed": 1})
    rollout = group.generate_sequences(prompts)
    mask = rollout.batch["response_mask"].astype(bool)
    attended = rollout.batch["attention_mask"][:, -24:].astype(bool)
    observed = attended & ~mask
    assert observed.any() and mask.any()
    # the environment's tokens, 3 per observation, where the mask is 0
    assert set(rollout.batch["responses"][observed].tolist()) == {5, 6, 7}
    assert not rollout.batch["rollout_log_probs"][observed].any()
    old = group.compute_log_prob(rollout).batch["old_log_probs"]
    np.testing.assert_allclose(old[mask], rollout.batch["rollout_log_probs"][mask], rtol=0, atol=1e-5)
    rewards = rollout.batch["env_rewards"]
    truths = [str(t) for t in np.repeat(batch.non_tensors["ground_truth"], 2)]
    for row, truth in enumerate(truths):
        turns = 1 + len(truth) % 3
        assert np.count_nonzero(rewards[row] == 0.25) == turns - 1
        assert rewards[row, last_response_index(rollout.batch["response_mask"][row : row + 1])[0]] >= 1.0


@pytest.mark.parametrize("algorithm", ["grpo", pytest.param("ppo", marks=pytest.mark.slow)])
def test_algorithms_train_on_trajectories(inputs, tmp_path, algorithm):
    history = run_rl(load_rl_config(_agent_config(inputs, tmp_path / algorithm, algorithm)))
    assert len(history) == 3
    for metrics in history:
        assert all(math.isfinite(v) for v in metrics.values())
        assert 1.0 <= metrics["agent/turns_mean"] <= 3.0
        assert 0 < metrics["agent/env_token_share"] < 1
        assert metrics["agent/finish/done"] + metrics["agent/finish/max_turns"] + metrics["agent/finish/length"] == 1
        assert metrics["critic/score/mean"] >= 1.0  # the final reward counts at least one distinct character


def test_a_mixture_of_experts_agent_replays_its_rollouts_routes(inputs, tmp_path):
    """A GRPO step of multi-turn trajectories of a mixture-of-experts policy with `actor.router_replay`: the training
    pass routes every token (prompt, model turns, observations) as the rollout did, and its log probs of the model's
    tokens are the rollout's (float32)."""
    moe = with_moe_policy(inputs, tmp_path)
    config = _agent_config(moe, tmp_path / "run", actor={"router_replay": True}, trainer={"total_steps": 1})
    (metrics,) = run_rl(load_rl_config(config))
    assert 0 < metrics["agent/env_token_share"] < 1
    assert metrics["rollout_corr/log_prob_abs_diff_max"] < 1e-4


def test_bad_agent_config_is_named(inputs, tmp_path):
    missing = _agent_config(inputs, tmp_path)
    missing["rollout"]["agent"]["env"] = f"{tmp_path}/none.py:Env"
    with pytest.raises(ConfigError, match=r"rollout\.agent\.env: .*no such file"):
        load_rl_config(missing)
    bad = _agent_config(inputs, tmp_path)
    bad["rollout"]["agent"]["max_tokens_per_trajectory"] = 99
    with pytest.raises(ConfigError, match="max_tokens_per_trajectory: 99 exceeds response_length 24"):
        load_rl_config(bad)


def _deterministic(history):
    return [{k: v for k, v in m.items() if not k.startswith(VARIABLE) and not k.endswith(PER_PROCESS)} for m in history]


@pytest.mark.slow
@pytest.mark.ray
def test_agent_runs_on_two_hosts_equal_one_host(ray_cluster, inputs, tmp_path):
    """Each host runs its own trajectories (the keys follow each prompt's index in the whole batch), so GRPO on
    trajectories over 2 hosts x 4 devices gives the metrics of 1 x 8."""
    runs = []
    for hosts in (1, 2):
        config = _agent_config(inputs, tmp_path / f"h{hosts}", **LAYOUTS)
        config["rollout"]["gen_layout"] = {"mesh": {"data": 4, "tensor": 2}, "rules": "dp_tp_gen"}
        config["trainer"].update(backend="ray", hosts=hosts, devices_per_host=8 // hosts)
        runs.append(_deterministic(run_rl(load_rl_config(config))))
    assert len(runs[0]) == len(runs[1]) == 3
    for step, (one, two) in enumerate(zip(*runs, strict=True)):
        assert one.keys() == two.keys(), step
        for key in one:
            assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-5), (step, key)


@pytest.mark.slow
@pytest.mark.ray
def test_agent_runs_with_the_rollout_on_its_own_devices_one_step_stale(ray_cluster, inputs, tmp_path):
    config = _agent_config(inputs, tmp_path / "async")
    config["actor"].update(train_layout={"mesh": {"fsdp": 4}, "rules": "fsdp"})
    config["rollout"]["gen_layout"] = {"mesh": {"data": 4}, "rules": "dp_tp_gen"}
    config["trainer"].update(backend="ray", placement="disaggregated", devices_per_host=8)
    config["async"] = {"max_staleness": 1}
    history = run_rl(load_rl_config(config))
    assert len(history) == 3
    for metrics in history:
        assert all(math.isfinite(v) for v in metrics.values())
        assert 1.0 <= metrics["agent/turns_mean"] <= 3.0 and 0 < metrics["agent/env_token_share"] < 1
