"""LoRA on Gemma 3's vision-language model (`hfjax.models.lora` on `hfjax.models.vision_lm`), against peft on the
transformers model: adapters attach to the language model's projections only (as many parameters as the cost model
counts, none in the vision tower); with random adapters the logits with images equal peft's on the transformers
model that loads hfjax's PEFT export, the merged export read by transformers alone gives them again, and every
adapter's gradient equals peft's (relative 1e-4); an actor with LoRA on it reads its base as the reference
(transformers' log probs), and its update moves the adapters alone."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers as tf
from flax import nnx
from support.gemma3_vision import (
    RESPONSE,
    batch,
    hf_loss,
    our_loss,
    per_row,
    policy_rows,
    positions,
    relative,
    save_tiny_gemma3,
    torch_logits,
)
from support.rl_setup import rl_config
from support.vision import checkpoint_tensors

from hfjax.config.rl import load_rl_config
from hfjax.models.lora import LoraConfig, LoraParam, add_lora, lora_parameter_count, merge_lora
from hfjax.models.peft_io import peft_tensors, save_peft
from hfjax.models.vision_lm import VisionLanguageLM, load_vision_lm, save_vision_lm
from hfjax.protocol import DataProto
from hfjax.workers.actor import ActorRolloutRefWorker

LORA = LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[tf.Gemma3ForConditionalGeneration, Path]:
    path = tmp_path_factory.mktemp("gemma3_vlm_lora")
    return save_tiny_gemma3(path), path


def adapted(path: Path) -> VisionLanguageLM:
    """The checkpoint with adapters on all seven projections, every B random (so each adapter changes the output)."""
    model = add_lora(load_vision_lm(path), LORA, seed=1)
    rng = np.random.default_rng(2)
    for name, value in nnx.to_flat_state(nnx.state(model, LoraParam)):
        if name[-1] == "b":
            value[...] = jnp.asarray(rng.normal(0, 0.05, value.shape), jnp.float32)
    return model


def our_logits(model: VisionLanguageLM) -> np.ndarray:
    ids, mask, pixels = batch()
    return np.asarray(model(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(positions(mask)), per_row(pixels)))


def peft_model(path: Path, adapters: Path) -> peft.PeftModel:
    """The transformers model at `path` with peft's adapters loaded from `adapters` (trainable, eval mode)."""
    base = tf.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return peft.PeftModel.from_pretrained(base, adapters, is_trainable=True).eval()


def test_adapters_sit_on_the_language_model_only_and_start_as_no_change(checkpoint) -> None:
    _, path = checkpoint
    fresh = add_lora(load_vision_lm(path), LORA, seed=1)
    adapters = nnx.to_flat_state(nnx.state(fresh, LoraParam))
    assert adapters and all(name[0] == "language_model" for name, _ in adapters)
    assert sum(value.size for _, value in adapters) == lora_parameter_count(fresh.config, LORA)
    np.testing.assert_array_equal(our_logits(fresh), our_logits(load_vision_lm(path)))


def test_the_peft_and_merged_exports_give_transformers_the_adapted_logits(checkpoint, tmp_path) -> None:
    _, path = checkpoint
    model = adapted(path)
    ids, mask, pixels = batch()
    real = mask.astype(bool)
    ours = our_logits(model)
    save_peft(model, LORA, tmp_path / "adapters", str(path))
    with_adapters = peft_model(path, tmp_path / "adapters")
    loaded = [name for name, _ in with_adapters.named_parameters() if "lora_" in name]
    assert len(loaded) == len(peft_tensors(model)) and not any("vision_tower" in name for name in loaded)
    with torch.no_grad():
        theirs = torch_logits(with_adapters, ids, mask, pixels).numpy()
    assert relative(ours[real], theirs[real]) < 1e-5
    assert relative(ours[real], our_logits(load_vision_lm(path))[real]) > 1e-3  # the adapters matter

    save_vision_lm(merge_lora(model), tmp_path / "merged")
    merged = tf.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        merged_logits = torch_logits(merged, ids, mask, pixels).numpy()
    assert relative(merged_logits[real], theirs[real]) < 1e-5


def test_every_adapter_gradient_equals_pefts(checkpoint, tmp_path) -> None:
    _, path = checkpoint
    model = adapted(path)
    ids, mask, pixels = batch()
    save_peft(model, LORA, tmp_path / "adapters", str(path))
    with_adapters = peft_model(path, tmp_path / "adapters")
    hf_loss(with_adapters, ids, mask, pixels).backward()
    adapter_params = [(name, p) for name, p in with_adapters.named_parameters() if "lora_" in name]
    theirs = {name.replace(".default.", "."): p.grad.numpy() for name, p in adapter_params}
    graphdef, adapters, rest = nnx.split(model, LoraParam, ...)
    grads = jax.jit(jax.grad(lambda a: our_loss(nnx.merge(graphdef, a, rest), ids, mask, per_row(pixels))))(adapters)
    ours = peft_tensors(nnx.merge(graphdef, grads, rest))
    assert ours.keys() == theirs.keys()
    for name, grad in ours.items():
        assert relative(grad, theirs[name]) < 1e-4, name


def test_an_actor_with_lora_reads_its_base_as_reference_and_trains_the_adapters_alone(checkpoint, tmp_path) -> None:
    """Fresh adapters: log probs and reference log probs are transformers' of each response token; after an update
    the reference is still the base's, every base tensor (the vision tower's included) is bitwise as loaded and the
    merged export, read by transformers, gives the policy's new log probs."""
    hf_model, path = checkpoint
    files = {"policy": str(path), "train": str(tmp_path / "train.jsonl"), "test": str(tmp_path / "test.jsonl")}
    actor = {"micro_batch_size": 2, "ppo_mini_batch_size": 4, "lora": {"rank": 4}, "optim": {"lr": 1e-2}}
    cfg = load_rl_config(rl_config(files, tmp_path / "run", "grpo", actor=actor))
    worker = ActorRolloutRefWorker(cfg.actor, cfg.rollout, "actor_ref", total_steps=2, max_prompt_length=18)
    worker.init_model()
    rows = policy_rows()
    real = rows["response_mask"].astype(bool)

    def transformers_log_probs(model) -> np.ndarray:
        with torch.no_grad():
            logits = torch_logits(model, rows["input_ids"], rows["attention_mask"], batch()[2])
        logp = torch.log_softmax(logits[:, -RESPONSE - 1 : -1], -1)
        return torch.gather(logp, 2, torch.tensor(rows["responses"][..., None])).squeeze(-1).numpy()

    base = transformers_log_probs(hf_model)
    got = worker.compute_log_prob(DataProto.from_dict(rows)).batch["old_log_probs"]
    ref = worker.compute_ref_log_prob(DataProto.from_dict(rows)).batch["ref_log_prob"]
    np.testing.assert_allclose(got[real], base[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ref[real], base[real], rtol=1e-5, atol=1e-5)

    frozen = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(worker.params, nnx.Not(LoraParam)))}
    advantages = np.random.default_rng(5).normal(size=real.shape).astype(np.float32)
    update = rows | {"advantages": advantages, "old_log_probs": got, "ref_log_prob": ref}
    worker.update_actor(DataProto.from_dict(update))
    after = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(worker.params, nnx.Not(LoraParam)))}
    assert any(p[0] == "vision" for p in frozen) and all(np.array_equal(after[p], frozen[p]) for p in frozen)
    ref = worker.compute_ref_log_prob(DataProto.from_dict(rows)).batch["ref_log_prob"]
    np.testing.assert_allclose(ref[real], base[real], rtol=1e-5, atol=1e-5)
    new = worker.compute_log_prob(DataProto.from_dict(rows)).batch["old_log_probs"]
    assert np.abs(new[real] - base[real]).max() > 1e-3

    worker.export_hf(str(tmp_path / "merged"))
    tensors = checkpoint_tensors(tmp_path / "merged")
    before = checkpoint_tensors(path)
    assert all(np.array_equal(tensors[n], before[n]) for n in before if ".vision_tower." in n)
    merged = tf.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    np.testing.assert_allclose(transformers_log_probs(merged)[real], new[real], rtol=1e-5, atol=1e-5)
