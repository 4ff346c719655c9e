"""SFT on images (`hfjax sft`): a tiny random Gemma 3 vision-language checkpoint saved with its processor, SFT rows in
verl's multimodal schema (prompts with no image, one, two), the vision tower frozen. The first step's loss is
transformers' response-token NLL of the same rows (each row alone, its pixel values from the processor); the export
is a checkpoint transformers reads whole, with the processor, whose tower alone is the original's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.vision import (
    build_gemma3_processor,
    checkpoint_tensors,
    only_the_tower_kept,
    pixels,
    png,
    save_vision_policy,
)

from hfjax.config import SFTConfig
from hfjax.data import DataError, SFTDataset, write_rows
from hfjax.data.images import image_messages
from hfjax.records.metrics import read_metrics
from hfjax.trainer.sft import run_sft
from hfjax.trainer.supervised import check_supervised_run
from hfjax.typed_config import ConfigError, load_config

RESPONSES = ("3", "how many shapes", "2 shapes")


def _rows(count: int) -> list[dict]:
    rows = []
    for i in range(count):
        images = [{"bytes": png(pixels(7 * i + k))} for k in range(i % 3)]
        prompt = [{"role": "user", "content": "<image>" * len(images) + " how many"}]
        rows.append({"prompt": prompt, "response": RESPONSES[i % 3], "images": images})
    return rows


def _reference_loss(policy, rows: list[dict]) -> float:
    """Transformers' mean NLL of every response token (eos included) over `rows`, each row a batch of its own."""
    import io

    import transformers as tf
    from PIL import Image

    processor = tf.AutoProcessor.from_pretrained(policy)
    model = tf.Gemma3ForConditionalGeneration.from_pretrained(policy, dtype=torch.float32)
    tokenizer = processor.tokenizer
    nll, tokens = 0.0, 0
    for row in rows:
        images = [Image.open(io.BytesIO(image["bytes"])).convert("RGB") for image in row["images"]]
        text = processor.apply_chat_template(image_messages(row["prompt"])[0], add_generation_prompt=True)
        out = processor(text=[text], images=[images] if images else None, return_tensors="pt")
        response = tokenizer(row["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = torch.cat([out["input_ids"], torch.tensor([response])], 1)
        extra = {}
        if images:
            extra = {"pixel_values": out["pixel_values"], "token_type_ids": (ids == tokenizer.image_token_id).long()}
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits
        logp = torch.log_softmax(logits[0, -len(response) - 1 : -1], -1)
        nll -= float(logp[torch.arange(len(response)), torch.tensor(response)].sum())
        tokens += len(response)
    return nll / tokens


def _config(policy, train, run_dir, **model) -> SFTConfig:
    return load_config(
        SFTConfig,
        {
            "model": {"path": str(policy), **model},
            "data": {"train_files": [str(train)], "val_files": [str(train)], "max_length": 40, "batch_size": 8,
                     "micro_batch_size": 4, "shuffle": False},
            "optim": {"lr": 1e-2},
            "trainer": {"run_dir": str(run_dir), "total_steps": 2, "progress": False, "plot": False},
        },
    )  # fmt: skip


def test_sft_on_images_starts_at_transformers_loss_and_exports_with_the_tower_frozen(tmp_path) -> None:
    from transformers import AutoProcessor

    policy = save_vision_policy(tmp_path / "policy", build_gemma3_processor())
    rows = _rows(8)
    train = write_rows(rows, tmp_path / "sft.parquet")
    run_dir = tmp_path / "run"
    final = run_sft(_config(policy, train, run_dir, freeze_vision_tower=True))
    first = read_metrics(run_dir)[0]
    assert first["train/loss"] == pytest.approx(_reference_loss(policy, rows), rel=1e-5)
    assert np.isfinite(final["val/loss"]) and final["val/loss"] < first["train/loss"]
    assert only_the_tower_kept(checkpoint_tensors(policy), checkpoint_tensors(run_dir / "hf"))
    exported = AutoProcessor.from_pretrained(run_dir / "hf")
    assert exported.image_seq_length == build_gemma3_processor().image_seq_length


def test_a_response_holding_the_image_placeholder_and_bad_settings_are_refused(tmp_path) -> None:
    processor = build_gemma3_processor()
    policy = save_vision_policy(tmp_path / "policy", processor)
    rows = _rows(3)
    rows[2]["response"] = "<image_soft_token> 3"
    bad = write_rows(rows, tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: row 3: field 'response': holds the image placeholder"):
        SFTDataset(bad, processor.tokenizer, max_length=40, processor=processor)
    with pytest.raises(ConfigError, match=r"model\.path: .* expected it as the policy, not as a seq_cls model"):
        check_supervised_run(_config(policy, bad, tmp_path / "run"), head="seq_cls")
