"""The vision quickstart (`task_type: shapes`): its images hold as many shapes as their answer says, one per cell, and
only its teacher's answers to images of 3 or 4 miss one; its random Gemma 3 base model is one transformers reads to
the same logits; (slow) a smoke run goes through SFT and RL on images, and the full run gains at least 20 points of
held-out greedy accuracy, and as much again with its RL on two simulated hosts."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
import transformers as tf
from PIL import Image
from support.rl_setup import QUICKSTART_SMOKE, same_accuracy
from support.settings import run_command, user_env

from hfjax.cli.quickstart import QuickstartConfig, run_quickstart
from hfjax.cli.quickstart_models import BaseModelSection, VisionTowerSection, build_vision_base_model
from hfjax.config.rl import load_rl_config
from hfjax.data import read_rows, shapes_task
from hfjax.data.images import image_messages
from hfjax.trainer.launch import run_rl
from hfjax.typed_config import load_config

pytest_plugins = ["support.ray_cluster"]
SCHEDULE_FIRST = 4  # about this many minutes of tests in CI: started early on a worker (conftest.py)
CLAIM_STEPS = 25  # of the config's 50 RL steps: its first validation step (test_freq: 25)
SMOKE = [*QUICKSTART_SMOKE, "model.vision.hidden_size=16", "model.vision.intermediate_size=32",
         "model.vision.num_layers=1", "model.vision.num_heads=2"]  # fmt: skip


def _occupied_cells(image: np.ndarray) -> list[int]:
    """The 2 x 2 grid's cells (row-major) holding a pixel brighter than the background's noise (< 40)."""
    half = image.shape[0] // 2
    cells = [image[r * half : (r + 1) * half, c * half : (c + 1) * half] for r in (0, 1) for c in (0, 1)]
    return [i for i, cell in enumerate(cells) if cell.max() >= 100]


def test_images_hold_their_count_and_only_the_teacher_misses(tmp_path):
    task = shapes_task.ShapesTask(num_train=200, num_test=100, num_sft=1200, sft_miss=0.6)
    files = shapes_task.write_shapes_task(task, tmp_path)
    rows = {split: [row for _, row in read_rows(path)] for split, path in files.items()}
    assert [len(rows[s]) for s in ("train", "test", "sft")] == [200, 100, 1200]
    for split in ("train", "test"):
        for row in rows[split]:
            (image,) = row["images"]
            pixels = np.asarray(Image.open(io.BytesIO(image["bytes"])))
            assert pixels.shape == (32, 32, 3)
            assert len(_occupied_cells(pixels)) == int(row["reward_model"]["ground_truth"])
            assert row["data_source"] == shapes_task.DATA_SOURCE
            assert row["prompt"] == [{"role": "user", "content": "<image>how many shapes?"}]
    counts, answers = [], []
    for row in rows["sft"]:
        pixels = np.asarray(Image.open(io.BytesIO(row["images"][0]["bytes"])))
        counts.append(len(_occupied_cells(pixels)))
        answers.append(int(row["response"]))
    counts, answers = np.asarray(counts), np.asarray(answers)
    assert set(counts) == {1, 2, 3, 4} and all(abs(np.mean(counts == n) - 0.25) < 0.05 for n in range(1, 5))
    assert np.all(answers[counts < 3] == counts[counts < 3])  # the teacher sees 1 or 2 shapes right
    misses = answers[counts >= 3] != counts[counts >= 3]
    assert np.all(answers[counts >= 3][misses] == counts[counts >= 3][misses] - 1)
    assert abs(misses.mean() - 0.6) < 0.06


def test_base_model_is_a_gemma3_transformers_reads_to_the_same_logits(tmp_path):
    from hfjax.models.vision_lm import load_vision_lm

    task = shapes_task.ShapesTask(num_train=1, num_test=0, num_sft=0)
    processor = shapes_task.build_shapes_processor(task)
    tower = VisionTowerSection(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2)
    spec = BaseModelSection(
        hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, vision=tower
    )
    path = build_vision_base_model(tmp_path, spec, processor)
    model, info = tf.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.text_config.layer_types == ["sliding_attention", "full_attention"]

    saved = tf.AutoProcessor.from_pretrained(path)
    image = shapes_task.shape_images(task)["train"][0][0]
    text = saved.apply_chat_template(image_messages([{"role": "user", "content": shapes_task.QUESTION}])[0],
                                     add_generation_prompt=True)  # fmt: skip
    batch = saved(text=[text], images=[[Image.fromarray(image)]], return_tensors="np")
    ids, pixels = batch["input_ids"], batch["pixel_values"]
    assert (ids == saved.tokenizer.image_token_id).sum() == spec.vision.tokens_per_image
    mask, positions = np.ones_like(ids), np.arange(ids.shape[1])[None]
    with torch.no_grad():
        expected = model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            pixel_values=torch.tensor(pixels),
            token_type_ids=torch.tensor((ids == saved.tokenizer.image_token_id).astype(np.int64)),
        ).logits.numpy()
    ours = np.asarray(load_vision_lm(path)(ids, mask, positions, pixels[None]))
    assert np.linalg.norm(ours - expected) / np.linalg.norm(expected) < 1e-5


@pytest.mark.slow  # about 20 s; test_vision_sft.py and test_vision_rl.py hold SFT and RL on images by default
def test_vision_quickstart_smoke(tmp_path):
    cfg = load_config(QuickstartConfig, "configs/vision_quickstart.yaml", [*SMOKE, f"run_dir={tmp_path}"])
    result = run_quickstart(cfg)
    assert 0.0 <= result["sft_accuracy"] <= 1.0 and 0.0 <= result["rl_accuracy"] <= 1.0
    trained = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in trained if "actor/pg_loss" in s] == [1, 2]
    for model_dir in (tmp_path / "base", tmp_path / "sft" / "hf"):
        assert tf.AutoConfig.from_pretrained(model_dir).architectures == ["Gemma3ForConditionalGeneration"]


@pytest.mark.slow
@pytest.mark.ray
def test_vision_quickstart_gains_20_points_on_one_host_and_on_two(request, tmp_path, monkeypatch):
    """The claim after the first 25 of the config's 50 RL steps, run as a user runs it (`hfjax quickstart` in a
    process of its own with the user's XLA settings: tests/support/settings.py; its RL stage on Ray, 1 host x 2
    devices). Then the same RL steps from the same SFT checkpoint on 2 simulated hosts x 1 device, each a JAX process
    of its own reading its rows' images, at the same held-out accuracy up to what the test set can tell apart."""
    steps = f"rl.trainer.total_steps={CLAIM_STEPS}"
    run_command(["quickstart", "configs/vision_quickstart.yaml", f"run_dir={tmp_path}", steps],
                tmp_path / "quickstart.log", 3600)  # fmt: skip
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["gain_points"] >= 20, result

    key = f"val/test_score/{shapes_task.DATA_SOURCE}"
    two_hosts = [f"trainer.total_steps={CLAIM_STEPS}", f"trainer.run_dir={tmp_path / 'rl-2-hosts'}",
                 "trainer.hosts=2", "trainer.devices_per_host=1"]  # fmt: skip
    request.getfixturevalue("ray_cluster")  # after the command, which starts a Ray of its own
    monkeypatch.setenv("XLA_FLAGS", user_env()["XLA_FLAGS"])  # the workers' settings (`ResourcePool.process_env`)
    accuracy = run_rl(load_rl_config(tmp_path / "rl" / "config.yaml", two_hosts))[-1][key]
    print(f"accuracy at step {CLAIM_STEPS}: 1 x 2 devices {result['rl_accuracy']:.4f}, 2 x 1 {accuracy:.4f}")
    num_test = load_config(QuickstartConfig, "configs/vision_quickstart.yaml").task["num_test"]
    assert same_accuracy(accuracy, result["rl_accuracy"], num_test), (accuracy, result)
