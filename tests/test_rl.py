"""The RL dataflow on a tiny model: every algorithm runs 3 iterations with finite metrics, log probs of the trainer
equal the engine's, resume equals an uninterrupted run, a damaged latest checkpoint falls back, Ray placements run."""

from __future__ import annotations

import gc
import math
import shutil

import jax
import numpy as np
import pytest
from support.rl_setup import build_run_inputs, deterministic, rl_config, write_varied_reward

from hfjax.config.rl import ALGORITHMS, load_rl_config
from hfjax.controller import LocalWorkerGroup
from hfjax.data import BatchLoader, PromptDataset
from hfjax.models import load_tokenizer
from hfjax.protocol import DataProto
from hfjax.trainer.launch import export_run, run_rl
from hfjax.workers.actor import ActorRolloutRefWorker

SCHEDULE_FIRST = 5  # about this many minutes of tests in CI: started early on a worker (conftest.py)

pytest_plugins = ["support.ray_cluster"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_run_inputs(tmp_path_factory.mktemp("rl"))


def _finite(history):
    assert history, "no steps ran"
    for metrics in history:
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert not bad, bad


def test_log_probs_equal_rollout_log_probs(inputs):
    cfg = load_rl_config(rl_config(inputs, "unused", "grpo"))
    group = LocalWorkerGroup(ActorRolloutRefWorker, cfg.actor, cfg.rollout, "actor_rollout", max_prompt_length=16)
    group.init_model()
    data = PromptDataset(cfg.data.train_files, load_tokenizer(inputs["policy"]), max_prompt_length=16)
    batch = next(iter(BatchLoader(data, 4, shuffle=False)))
    prompts = DataProto.from_dict(batch.tensors, meta_info={"n": 2, "seed": 1})
    rollout = group.generate_sequences(prompts)
    old = group.compute_log_prob(rollout).batch["old_log_probs"]
    mask = rollout.batch["response_mask"].astype(bool)
    assert mask.sum() > 0
    np.testing.assert_allclose(old[mask], rollout.batch["rollout_log_probs"][mask], rtol=0, atol=1e-5)


def test_update_reusing_its_log_probs_equals_a_recomputed_old_log_prob_pass(inputs, tmp_path):
    """One optimizer step per iteration: `old_log_prob: auto` skips the separate pass and must train exactly as
    verl's recompute does (same losses, KL and gradient norms over 2 iterations)."""
    single_step = {"ppo_mini_batch_size": 8, "micro_batch_size": 4}
    varied = write_varied_reward(tmp_path)
    runs = {}
    for mode in ("auto", "recompute"):
        config = rl_config(inputs, tmp_path / mode, "grpo", actor={**single_step, "old_log_prob": mode})
        config["trainer"]["total_steps"] = 2
        config["reward"] = {"function": varied}
        cfg = load_rl_config(config)
        assert cfg.reuses_update_log_probs == (mode == "auto")
        runs[mode] = run_rl(cfg)
    assert all("timing_s/old_log_prob" not in m for m in runs["auto"])
    assert all("timing_s/old_log_prob" in m for m in runs["recompute"])
    for auto, recompute in zip(runs["auto"], runs["recompute"], strict=True):
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean"):
            assert auto[key] == pytest.approx(recompute[key], rel=1e-5, abs=1e-7), key
        assert auto["critic/advantages/max"] > 0
        assert auto["actor/ppo_kl"] == 0.0 and abs(recompute["actor/ppo_kl"]) < 1e-6


def test_optimizer_offload_during_generation_trains_identically(inputs, tmp_path, monkeypatch):
    """`rollout.offload_optimizer`: the actor's optimizer state sits in pinned host memory while it generates and
    comes back for the update. XLA:CPU has that memory space although it is the same RAM, so the engine is made to
    use it here; the run must equal one without offload."""
    import hfjax.parallel.hybrid_engine as hybrid_engine

    moves = []
    to_memory = hybrid_engine.to_memory_kind
    monkeypatch.setattr(hybrid_engine, "has_separate_host_memory", lambda layout: True)
    monkeypatch.setattr(hybrid_engine, "to_memory_kind", lambda tree, kind: moves.append(kind) or to_memory(tree, kind))
    two = {"total_steps": 2}
    plain = run_rl(load_rl_config(rl_config(inputs, tmp_path / "plain", "grpo", trainer=two)))
    assert not moves
    offload = {"offload_optimizer": True}
    offloaded = run_rl(load_rl_config(rl_config(inputs, tmp_path / "offload", "grpo", trainer=two, rollout=offload)))
    assert len(moves) >= 4 and moves == ["pinned_host", "device"] * (len(moves) // 2)  # a round trip per rollout
    for got, want in zip(offloaded, plain, strict=True):
        assert deterministic(got) == deterministic(want)


def test_resume_equals_uninterrupted_and_damaged_latest_falls_back(inputs, tmp_path, caplog):
    two = {"total_steps": 2, "save_freq": 1}
    full = run_rl(load_rl_config(rl_config(inputs, tmp_path / "full", "ppo", trainer=two)))
    run_rl(load_rl_config(rl_config(inputs, tmp_path / "part", "ppo", trainer={**two, "total_steps": 1})))
    resumed = run_rl(load_rl_config(rl_config(inputs, tmp_path / "part", "ppo", trainer=two)))
    assert len(resumed) == 1
    got, want = deterministic(resumed[0]), deterministic(full[1])
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key

    # Damage the trainer state of the latest step (2): resuming must fall back to step 1 and redo step 2.
    latest = tmp_path / "part" / "checkpoints" / "trainer" / "2"
    assert latest.is_dir()
    for file in latest.rglob("*"):
        if file.is_file():
            file.write_bytes(b"garbage")
    again = run_rl(load_rl_config(rl_config(inputs, tmp_path / "part", "ppo", trainer=two)))
    assert "falling back to the previous step" in caplog.text
    assert len(again) == 1
    for key in want:
        assert deterministic(again[0])[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), key


def test_export_writes_hf_checkpoint(inputs, tmp_path):
    import torch
    import transformers as tf

    run_rl(load_rl_config(rl_config(inputs, tmp_path / "run", "grpo", trainer={"total_steps": 1})))
    out = tmp_path / "hf"
    assert export_run(tmp_path / "run", None, out) == 1
    model = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    # the checkpoint's vocabulary (the tokenizer's, added tokens included), not the padded one the model trains with
    vocab = tf.AutoConfig.from_pretrained(inputs["policy"]).vocab_size
    assert model.config.vocab_size == vocab == len(load_tokenizer(out))
    assert model.get_input_embeddings().weight.shape[0] == vocab
    shutil.rmtree(out)


@pytest.mark.ray
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_each_algorithm_runs_colocated_on_ray(ray_cluster, inputs, tmp_path, algorithm):
    history = run_rl(load_rl_config(rl_config(inputs, tmp_path / "run", algorithm, trainer={"backend": "ray"})))
    assert len(history) == 3
    _finite(history)
    assert {"actor/pg_loss", "critic/score/mean", "timing_s/gen", "perf/throughput"} <= history[-1].keys()
    if algorithm in ("ppo", "safe_rlhf"):
        assert "critic/vf_loss" in history[-1] and "critic/vf_explained_var" in history[-1]
    if algorithm == "safe_rlhf":
        assert "safe/lambda" in history[-1] and "cost_critic/vf_loss" in history[-1]


@pytest.mark.ray
@pytest.mark.slow
def test_split_placement_on_ray(ray_cluster, inputs, tmp_path):
    trainer = {"backend": "ray", "placement": "split", "devices_per_host": 8, "total_steps": 2}
    history = run_rl(load_rl_config(rl_config(inputs, tmp_path / "run", "ppo", trainer=trainer)))
    assert len(history) == 2
    _finite(history)


def test_an_in_process_run_leaves_no_arrays_alive(inputs, tmp_path):
    """After `run_rl` with the local backend returns, none of its arrays (parameters, optimizer state, caches) is
    still alive: JAX's compile cache keeps the static arguments of the training step, so the loss functions must not
    be bound methods of the workers."""
    gc.collect()
    earlier = jax.live_arrays()
    run_rl(load_rl_config(rl_config(inputs, tmp_path / "run", "ppo", trainer={"total_steps": 1})))
    gc.collect()
    before = {id(a) for a in earlier}
    left = [a for a in jax.live_arrays() if id(a) not in before]
    assert not left, f"{len(left)} arrays ({sum(a.nbytes for a in left)} bytes) outlived the run"
