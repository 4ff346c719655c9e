"""RL on images end to end (`hfjax train`'s trainer, in process): a tiny random Gemma 3 vision-language policy saved
with its processor, prompt files in verl's multimodal schema (rows with one image, two, none), GRPO with a
rollout correction on and the vision tower frozen, or LoRA on the language model. The engine's log probs of its
samples, which it computed with each prompt's images at prefill, equal the trainer's recomputed ones, which read the
images each sample carried, to float32 rounding; a sampled response token that is the image placeholder id stays
text in both (the random policy samples it). `hfjax export` writes a checkpoint transformers reads whole, with the
processor, in which only the frozen tower is the original's (LoRA merged into the language model's projections)."""

from __future__ import annotations

import numpy as np
import pytest
from support.checkpoints import save_hf_model
from support.rl_setup import rl_config, write_varied_reward
from support.vision import (
    build_gemma3_processor,
    checkpoint_tensors,
    only_the_tower_kept,
    pixels,
    png,
    save_vision_policy,
)

from hfjax.config.rl import load_rl_config
from hfjax.data import write_rows
from hfjax.trainer.launch import export_run, run_rl
from hfjax.trainer.preflight import check_rl_run
from hfjax.typed_config import ConfigError


def _prompt_rows(count: int) -> list[dict]:
    rows = []
    for i in range(count):
        images = [{"bytes": png(pixels(10 * i + k))} for k in range(i % 3)]
        marks = "<image>" * len(images)
        rows.append({"data_source": "shapes", "prompt": [{"role": "user", "content": f"{marks} how many"}],
                     "images": images, "reward_model": {"ground_truth": "3"}})  # fmt: skip
    return rows


# LoRA end to end in the slow suite: the default one holds its actor's passes (test_vision_lora.py)
@pytest.mark.parametrize("adapters", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["frozen_tower", "lora"])
def test_grpo_on_images_samples_and_trains_with_the_same_log_probs(tmp_path, adapters) -> None:
    from transformers import AutoProcessor

    policy = save_vision_policy(tmp_path / "policy", build_gemma3_processor())
    train = write_rows(_prompt_rows(8), tmp_path / "train.parquet")
    files = {"policy": str(policy), "train": str(train), "test": str(train)}
    config = rl_config(files, tmp_path / "run", "grpo", trainer={"total_steps": 2}, data={"max_prompt_length": 32,
                       "val_files": []}, reward={"function": write_varied_reward(tmp_path)})  # fmt: skip
    config["actor"] |= {"rollout_correction": {"rollout_is": "token"}, "freeze_vision_tower": not adapters}
    if not adapters:  # and each device encodes its images one at a time, in the prefill and every pass
        config["actor"] |= {"images_per_step": 1}
    if adapters:  # LoRA on the language model (the tower frozen with the rest of the base)
        config["actor"] |= {"lora": {"rank": 4}, "optim": {"lr": 1e-2}}
    history = run_rl(load_rl_config(config))
    assert len(history) == 2
    for metrics in history:
        assert np.isfinite(metrics["actor/pg_loss"])
        assert metrics["rollout_corr/log_prob_abs_diff_max"] < 1e-5  # the largest over the step's tokens

    assert export_run(tmp_path / "run", None, tmp_path / "hf") == 2
    assert only_the_tower_kept(checkpoint_tensors(policy), checkpoint_tensors(tmp_path / "hf"))
    exported = AutoProcessor.from_pretrained(tmp_path / "hf")
    assert exported.image_seq_length == build_gemma3_processor().image_seq_length

    if adapters:
        return
    text = save_hf_model(tmp_path / "text", "llama")[1]
    text_actor = load_rl_config(config | {"actor": config["actor"] | {"model_path": str(text)}})
    with pytest.raises(ConfigError, match=r"actor\.freeze_vision_tower: .* a text model without a vision tower"):
        check_rl_run(text_actor)
    stepped = config["actor"] | {"model_path": str(text), "freeze_vision_tower": False, "images_per_step": 2}
    with pytest.raises(ConfigError, match=r"actor\.images_per_step: 2 on a text model; expected 0"):
        check_rl_run(load_rl_config(config | {"actor": stepped}))


def test_the_memory_check_counts_the_vision_tower(tmp_path):
    """The cost model's actor memory (what the preflight's memory check adds up) for a vision-language policy on one
    device, against transformers' parameter count of the same checkpoint (with the embedding's padding rows):
    float32 master weights of every parameter, the vision tower and projector included, and Adam's state and the
    gradients of the same; with the tower frozen, optimizer state and gradients of all but the tower's parameters
    (the projector still trains)."""
    import transformers as tf

    from hfjax.models.config import VOCAB_MULTIPLE
    from hfjax.trainer.preflight import predict_memory

    policy = save_vision_policy(tmp_path / "policy", build_gemma3_processor())
    model = tf.Gemma3ForConditionalGeneration.from_pretrained(policy)
    text = model.config.text_config  # hfjax stores the (tied) embedding with its rows padded to VOCAB_MULTIPLE
    total = model.num_parameters() + (-text.vocab_size % VOCAB_MULTIPLE) * text.hidden_size
    tower = sum(p.numel() for name, p in model.named_parameters() if ".vision_tower." in name)
    assert 0 < tower < total
    files = {"policy": str(policy), "train": "train.parquet", "test": "train.parquet"}
    config = rl_config(files, tmp_path / "run", trainer={"devices_per_host": 1})

    def actor_memory(freeze: bool) -> dict[str, float]:
        actor = config["actor"] | {"freeze_vision_tower": freeze, "micro_batch_size": 1, "ppo_mini_batch_size": 4}
        return predict_memory(load_rl_config(config | {"actor": actor}), 1e15).roles["actor"].memory

    trained, frozen = actor_memory(False), actor_memory(True)
    assert trained["params"] == frozen["params"] == 4 * total
    assert trained["optimizer"] == 8 * total and frozen["optimizer"] == 8 * (total - tower)
    assert trained["grads"] in (4 * total, 8 * total)  # one micro-batch's, or beside the accumulator
    assert frozen["grads"] == trained["grads"] * (total - tower) / total
