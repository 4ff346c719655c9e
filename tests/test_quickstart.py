"""The quickstart pipeline: a short smoke run (default suite) goes through data, base model, SFT, RL and the
result table; the full run's learning claim (held-out greedy accuracy +20 points after RL) is a slow test."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers as tf

from hfjax.quickstart import QuickstartConfig, run_quickstart
from hfjax.typed_config import load_config

SMOKE = [
    "task.num_train=64",
    "task.num_test=16",
    "task.num_sft=64",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_layers=1",
    "sft.trainer.total_steps=3",
    "rl.trainer.total_steps=2",
    "rl.trainer.test_freq=0",
    "rl.trainer.backend=local",
    "rl.data.train_batch_size=8",
    "rl.rollout.n=2",
    "rl.rollout.slots=16",
    "rl.actor.ppo_mini_batch_size=16",
    "rl.actor.micro_batch_size=16",
]


def test_quickstart_smoke(tmp_path):
    cfg = load_config(QuickstartConfig, "configs/quickstart.yaml", [*SMOKE, f"run_dir={tmp_path}"])
    result = run_quickstart(cfg)
    assert json.loads((tmp_path / "result.json").read_text()) == pytest.approx(result)
    for key in ("sft_accuracy", "rl_accuracy"):
        assert 0.0 <= result[key] <= 1.0
    assert math.isclose(result["gain_points"], 100 * (result["rl_accuracy"] - result["sft_accuracy"]))
    # the base model and the SFT export are real Hugging Face checkpoints
    for model_dir in (tmp_path / "base", tmp_path / "sft" / "hf"):
        model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        assert model.config.num_hidden_layers == 1
    # a second run into the same directory stops before touching the first one
    written = (tmp_path / "result.json").read_bytes()
    with pytest.raises(ValueError, match=r"run_dir: .* already holds a quickstart run \(sft and rl\)"):
        run_quickstart(cfg)
    assert (tmp_path / "result.json").read_bytes() == written


@pytest.mark.slow
@pytest.mark.ray
def test_quickstart_learns(tmp_path):
    cfg = load_config(QuickstartConfig, "configs/quickstart.yaml", [f"run_dir={tmp_path}"])
    result = run_quickstart(cfg)
    assert result["gain_points"] >= 20, result
