"""Worker groups of several processes, one per simulated host (a Ray cluster of separate nodes on this machine, 4
fake CPU devices per process, gloo between them): GRPO and PPO over 2 hosts x 4 devices equal 1 host x 8 devices
with the same seeds and layouts (metrics and final weights), generation splits prompts over the hosts and returns
what one host generates, dispatch padding never reaches a loss, and bad host/device combinations are clear errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file
from support.rl_setup import VARIABLE as RUN_VARIABLE
from support.rl_setup import build_run_inputs, rl_config, write_varied_reward

from hfjax.config.rl import load_rl_config
from hfjax.controller import LocalWorkerGroup, RayWorkerGroup, ResourcePool
from hfjax.data import BatchLoader, PromptDataset
from hfjax.models import load_tokenizer
from hfjax.protocol import DataProto
from hfjax.records.checkpoint import CheckpointManager
from hfjax.records.checksums import MANIFEST
from hfjax.trainer.launch import export_run, run_rl
from hfjax.trainer.rl import RLTrainer
from hfjax.typed_config import ConfigError
from hfjax.workers.actor import ActorRolloutRefWorker

SCHEDULE_FIRST = 7  # about this many minutes of tests in CI: started early on a worker (conftest.py)

pytest_plugins = ["support.ray_cluster"]
# what varies between identical runs (rl_setup), and the KV cache per device, which depends on the placement (each host
# has `rollout.slots`)
VARIABLE = (*RUN_VARIABLE, "perf/kv_cache_bytes")
# the same global layouts on 1 x 8 and 2 x 4 devices: FSDP training, generation as 4 replicas of tensor 2
LAYOUTS = {
    "actor": {"train_layout": {"mesh": {"fsdp": 8}, "rules": "fsdp"}, "ppo_mini_batch_size": 8, "micro_batch_size": 8},
    "rollout": {"gen_layout": {"mesh": {"data": 4, "tensor": 2}, "rules": "dp_tp_gen"}},
    "critic": {"layout": {"mesh": {"fsdp": 8}, "rules": "fsdp"}, "ppo_mini_batch_size": 8, "micro_batch_size": 8},
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    return {**build_run_inputs(root), "reward": write_varied_reward(root)}


def _config(inputs, run_dir, algorithm, hosts, **trainer):
    trainer = {"backend": "ray", "hosts": hosts, "devices_per_host": 8 // hosts, **trainer}
    config = rl_config(inputs, run_dir, algorithm, **LAYOUTS, trainer=trainer)
    config["reward"] = {"function": inputs["reward"]}
    return load_rl_config(config)


def _weights(run_dir, out):
    export_run(run_dir, None, out)
    return load_file(str(next(out.glob("*.safetensors"))))


def _deterministic(history):
    return [{k: v for k, v in m.items() if not k.startswith(VARIABLE)} for m in history]


def _assert_same_metrics(got, want, where):
    assert got.keys() == want.keys(), where
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (where, key)


@pytest.mark.ray
@pytest.mark.slow  # CI runs the slow tests too
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_two_hosts_equal_one_host_and_resume_across_host_counts(ray_cluster, inputs, tmp_path, algorithm):
    """3 steps on 2 hosts x 4 devices equal 1 x 8 (metrics, exported weights). Then one of them, cut back to its
    step-2 checkpoint (a run stopped after step 2), resumes on the other host count (GRPO: 2 x 4 -> 1 x 8, PPO:
    1 x 8 -> 2 x 4) and logs step 3 as before."""
    first, then = (2, 1) if algorithm == "grpo" else (1, 2)
    runs = {
        hosts: _deterministic(
            run_rl(_config(inputs, tmp_path / f"h{hosts}", algorithm, hosts, save_freq=2 if hosts == first else 0))
        )
        for hosts in (1, 2)
    }
    one, two = runs[1], runs[2]
    assert len(one) == len(two) == 3
    assert one[0]["critic/advantages/max"] > 0  # the updates learn something, so equal weights mean equal updates
    for step, (a, b) in enumerate(zip(one, two, strict=True)):
        _assert_same_metrics(b, a, f"step {step + 1}")
    w1, w2 = _weights(tmp_path / "h1", tmp_path / "hf1"), _weights(tmp_path / "h2", tmp_path / "hf2")
    assert w1.keys() == w2.keys()
    for name in w1:
        np.testing.assert_allclose(w2[name], w1[name], rtol=1e-4, atol=1e-5, err_msg=name)
    shutil.copytree(tmp_path / f"h{first}", tmp_path / "resumed")
    for saved in (tmp_path / "resumed" / "checkpoints").iterdir():  # each trained role's and the trainer's record
        assert (saved / "2" / MANIFEST).is_file(), saved  # checksums written by process 0, verified by the resume
        with CheckpointManager(saved) as checkpoints:
            checkpoints.discard_after(2)
    resumed = _deterministic(run_rl(_config(inputs, tmp_path / "resumed", algorithm, then)))
    assert len(resumed) == 1
    _assert_same_metrics(resumed[0], runs[then][2], f"step 3 resumed on {then} host(s)")


def _actor_group(inputs, hosts, policy=None, **actor):
    config = rl_config(inputs, "unused", "grpo", **{**LAYOUTS, "actor": {**LAYOUTS["actor"], **actor}})
    config["model_path"] = policy or inputs["policy"]
    cfg = load_rl_config(config)
    cfg.rollout.response_length = 16
    if hosts == 0:  # in this process
        group = LocalWorkerGroup(ActorRolloutRefWorker, cfg.actor, cfg.rollout, "actor_rollout", max_prompt_length=16)
        group.init_model()
        return group, None
    pool = ResourcePool([8 // hosts] * hosts, strategy="STRICT_SPREAD")
    group = RayWorkerGroup(pool, ActorRolloutRefWorker, cfg.actor, cfg.rollout, "actor_rollout", max_prompt_length=16)
    group.init_model()
    return group, pool


def _prompts(inputs, rows, meta):
    data = PromptDataset([inputs["train"]], load_tokenizer(inputs["policy"]), max_prompt_length=16)
    batch = next(iter(BatchLoader(data, 8, shuffle=False)))
    return DataProto.from_dict({k: v[rows] for k, v in batch.tensors.items()}, meta_info=meta)


def _early_stop_policy(inputs, tmp_path):
    """(a copy of the policy whose end-of-sequence token ends prompt 0's greedy response after 2 tokens but not
    prompt b's within 8, b). One host gets prompt 0 only, the other prompt b: they finish at different steps."""
    group, _ = _actor_group(inputs, 0)
    greedy = group.generate_sequences(_prompts(inputs, list(range(8)), {"do_sample": False})).batch["responses"]
    stop = int(greedy[0, 1])
    other = next(b for b in range(1, 8) if stop not in greedy[b, :8] and stop not in greedy[0, :1])
    policy = tmp_path / "early_stop_policy"
    shutil.copytree(inputs["policy"], policy)
    config = json.loads((policy / "config.json").read_text())
    (policy / "config.json").write_text(json.dumps({**config, "eos_token_id": stop}))
    return str(policy), other


@pytest.mark.slow
@pytest.mark.ray
def test_generation_per_host_and_padding_rows(ray_cluster, inputs, tmp_path):
    """Sampled: 7 prompts x 2 samples, so dispatch pads one prompt for 2 hosts and its 2 samples are dropped; the
    samples equal one host's. Greedy: host 0 holds prompts that stop after 2 tokens, host 1 prompts that run longer;
    each host runs its own loop (fewer decode steps on host 0) and the responses equal one host's. Log probs and an
    update over 13 rows (one padding row on host 1) equal one host's: the padding row is in no loss or normaliser."""
    policy, other = _early_stop_policy(inputs, tmp_path)
    sampled = _prompts(inputs, list(range(7)), {"n": 2, "seed": 3})
    greedy = _prompts(inputs, [0, 0, 0, 0, other, other, other, other], {"do_sample": False})
    outs, updates, pids = {}, {}, {}
    for hosts in (1, 2):
        group, pool = _actor_group(inputs, hosts, policy, ppo_mini_batch_size=16, use_kl_loss=False)
        try:
            pids[hosts] = group.pids
            outs[hosts] = (group.generate_sequences(sampled), group.generate_sequences(greedy))
            rollout = outs[1][0]
            rows = rollout.select(batch_keys=["input_ids", "attention_mask", "position_ids", "responses"])[:13]
            rows.batch["response_mask"] = rollout.batch["response_mask"][:13]
            rows.batch["advantages"] = np.random.default_rng(0).normal(size=rows.batch["response_mask"].shape)
            logp = group.compute_log_prob(rows).batch["old_log_probs"]
            updates[hosts] = (logp, group.update_actor(rows).meta_info["metrics"])
        finally:
            group.shutdown()
            pool.release()
    assert len(set(pids[2])) == 2
    for one, two in zip(outs[1], outs[2], strict=True):
        assert len(one) == len(two)
        for key in ("responses", "response_mask", "input_ids", "position_ids"):
            np.testing.assert_array_equal(two.batch[key], one.batch[key], err_msg=key)
        mask = one.batch["response_mask"].astype(bool)
        np.testing.assert_allclose(
            two.batch["rollout_log_probs"][mask], one.batch["rollout_log_probs"][mask], atol=1e-5
        )
    assert len(outs[1][0]) == 14
    lengths = outs[2][1].batch["response_mask"].sum(axis=1)
    assert set(lengths[:4]) == {2} and min(lengths[4:]) > 8
    steps = outs[2][1].meta_info["metrics"]["gen_decode_steps"]
    assert steps[0] < steps[1], steps  # host 0 finished first, without waiting for host 1
    np.testing.assert_allclose(updates[2][0], updates[1][0], atol=1e-5)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert updates[2][1][key] == [pytest.approx(updates[1][1][key], rel=1e-4, abs=1e-6)] * 2, key


def test_bad_host_and_device_combinations_are_clear_errors(inputs, tmp_path):
    def load(algorithm="grpo", **sections):
        return load_rl_config(rl_config(inputs, tmp_path, algorithm, **sections))

    with pytest.raises(ConfigError, match=r"trainer.devices=8: this key was replaced by trainer.devices_per_host"):
        load(trainer={"devices": 8})
    with pytest.raises(ConfigError, match=r"trainer.hosts=3: placement 'split' has 2 worker groups.*multiple of 2"):
        load("ppo", trainer={"backend": "ray", "hosts": 3, "placement": "split"})
    with pytest.raises(ConfigError, match=r"trainer.hosts=2: several hosts need trainer.backend=ray"):
        load(trainer={"hosts": 2})
    two_hosts = {"backend": "ray", "hosts": 2, "devices_per_host": 4}
    with pytest.raises(
        ConfigError,
        match=r"rollout.gen_layout: mesh\(tensor=8\) has data=1, which 2 hosts cannot share.*make "
        r"rollout.gen_layout.mesh.data a multiple of 2 .*trainer.hosts",
    ):
        load(trainer=two_hosts, rollout={"gen_layout": {"mesh": {"tensor": 8}}})
    # a replica per host exists (the HybridEngine takes it, tests/test_hybrid_engine.py), whatever the training layout
    load(
        trainer=two_hosts,
        actor={"train_layout": {"mesh": {"tensor": 8}, "rules": "tp"}},
        rollout={"gen_layout": {"mesh": {"data": 2, "tensor": 4}, "rules": "tp"}},
    )
    with pytest.raises(
        ConfigError, match=r"actor.train_layout: mesh\(fsdp=4\) has 4 devices, but the actor group has 2"
    ):
        load(
            trainer={"backend": "ray", "hosts": 2, "devices_per_host": 4}, actor={"train_layout": {"mesh": {"fsdp": 4}}}
        )
    with pytest.raises(ConfigError, match=r"actor.micro_batch_size=3: its group has 2 hosts"):
        load(trainer={"backend": "ray", "hosts": 2}, actor={"micro_batch_size": 3, "ppo_mini_batch_size": 3})


@pytest.mark.ray
def test_more_hosts_than_ray_nodes_is_a_clear_error(ray_cluster, inputs, tmp_path):
    trainer = {"backend": "ray", "hosts": 8, "devices_per_host": 1}
    sizes = {"micro_batch_size": 8, "ppo_mini_batch_size": 8}
    cfg = load_rl_config(rl_config(inputs, tmp_path, "grpo", actor=sizes, trainer=trainer))
    with pytest.raises(ValueError, match=r"trainer.hosts=8, but the Ray cluster has 4 node\(s\)"):
        run_rl(cfg)


@pytest.mark.ray
@pytest.mark.slow
def test_split_placement_with_two_hosts_per_group(ray_cluster, inputs, tmp_path):
    """PPO split on 4 hosts x 2 devices: the actor group and the critic group each span 2 hosts (2 processes each),
    distinct processes (so split equals standalone for PPO's two trained roles)."""
    trainer = {"backend": "ray", "placement": "split", "hosts": 4, "devices_per_host": 2, "total_steps": 2}
    trainer_run = RLTrainer(load_rl_config(rl_config(inputs, tmp_path / "run", "ppo", trainer=trainer)))
    try:
        actor, critic = trainer_run.roles["actor"].group, trainer_run.roles["critic"].group
        assert len(set(actor.pids)) == 2 and len(set(critic.pids)) == 2 and not set(actor.pids) & set(critic.pids)
        history = trainer_run.fit()
    finally:
        trainer_run.close()
    assert len(history) == 2 and all(np.isfinite(v) for m in history for v in m.values())
    assert "critic/vf_loss" in history[-1]
