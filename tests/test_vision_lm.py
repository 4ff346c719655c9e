"""Gemma 3's vision-language model (`hfjax.models.vision_lm`) against transformers on a tiny random
`Gemma3ForConditionalGeneration`: logits with images equal transformers' (float32, relative 1e-5) with left padding,
two images in one row and a row without images, on a sliding-window layer and a full one; every parameter's
gradient, the vision tower's included, equals PyTorch's (relative 1e-4); a text-only batch equals transformers'
without pixels; under fsdp 4 x tensor 2 logits and gradients equal one device's."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from flax import nnx
from safetensors.numpy import load_file, save_file
from support.gemma3_vision import (
    ARCH,
    IMAGE,
    RESPONSE,
    batch,
    gradients,
    hf_loss,
    loss_weights,
    per_row,
    policy_rows,
    positions,
    relative,
    save_tiny_gemma3,
    torch_logits,
    torch_name,
)
from support.rl_setup import rl_config

from hfjax.config.rl import load_rl_config
from hfjax.models import CheckpointError
from hfjax.models.attention import attention_mask, causal_attention
from hfjax.models.hf import checkpoint_index
from hfjax.models.model_io import load_model
from hfjax.models.program import program_layout
from hfjax.models.vision_lm import (
    VisionLanguageConfig,
    checkpoint_names,
    image_blocks,
    load_vision_lm,
    save_vision_lm,
    vision_lm_plan,
)
from hfjax.parallel import Layout
from hfjax.protocol import DataProto
from hfjax.rollout.engine import JaxEngine
from hfjax.rollout.generator import OfflineGenerator
from hfjax.rollout.sampling import SamplingParams
from hfjax.trainer.preflight import check_weights
from hfjax.typed_config import ConfigError
from hfjax.workers.actor import ActorRolloutRefWorker


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[tf.Gemma3ForConditionalGeneration, Path]:
    path = tmp_path_factory.mktemp("gemma3_vlm")
    return save_tiny_gemma3(path), path


def test_image_blocks_number_each_run_of_placeholders() -> None:
    ids, _, _ = batch()
    blocks = np.asarray(image_blocks(jnp.asarray(ids) == IMAGE))
    assert set(blocks[0][ids[0] == IMAGE]) == {0} and set(blocks[1][ids[1] == IMAGE]) == {0, 1}
    assert np.all(blocks[ids != IMAGE] == -1) and np.all(blocks[2] == -1)


def test_an_image_block_across_the_causal_key_blocks_sees_its_later_tokens() -> None:
    """At 128 positions the xla attention skips the keys after each quarter of the queries (causal); a block of
    image tokens across a quarter's end (positions 28..35) must still see all of its own: equal to a hand-written
    softmax over the whole mask, and not to the causal one."""
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 128, h, 8)), jnp.float32) for h in (4, 2, 2))
    ids = np.full((1, 128), 5)
    ids[0, 28:36] = IMAGE
    segments, index = jnp.ones((1, 128), jnp.int32), jnp.arange(128)
    mask = attention_mask(segments, index, index, None, image_blocks(jnp.asarray(ids) == IMAGE))
    got = causal_attention(q, k, v, valid=segments, mask=mask, sees_ahead=True, implementation="xla")
    scores = np.einsum("tkgd,skd->kgts", np.asarray(q[0]).reshape(128, 2, 2, 8), np.asarray(k[0])) / np.sqrt(8)
    scores = np.where(np.asarray(mask[0]), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("kgts,skd->tkgd", probs / probs.sum(-1, keepdims=True), np.asarray(v[0])).reshape(128, 4, 8)
    np.testing.assert_allclose(np.asarray(got[0]), want, rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(mask[0, 30, 33])) and not np.asarray(mask[0, 27, 30])


def test_logits_with_images_equal_transformers(checkpoint) -> None:
    hf_model, path = checkpoint
    ids, mask, pixels = batch()
    model = load_vision_lm(path)
    with torch.no_grad():
        want = torch_logits(hf_model, ids, mask, pixels).numpy()
        text_only = torch_logits(hf_model, ids[2:], mask[2:], None).numpy()
    got = model(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(positions(mask)), jnp.asarray(per_row(pixels)))
    got = np.asarray(got)
    real = mask.astype(bool)
    assert relative(got[real], want[real]) < 1e-5
    # the image blocks matter: the same logits with causal attention only differ
    causal = model.language_model.model(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(positions(mask)))
    assert relative(np.asarray(model.language_model.logits(causal))[real][:, :300], want[real]) > 1e-2
    got_text = np.asarray(model(jnp.asarray(ids[2:]), jnp.asarray(mask[2:]), jnp.asarray(positions(mask[2:]))))
    assert relative(got_text[real[2:]], text_only[real[2:]]) < 1e-5


def test_save_and_reload_is_bitwise_and_transformers_reads_it(checkpoint, tmp_path) -> None:
    hf_model, path = checkpoint
    model = load_vision_lm(path)
    saved = save_vision_lm(model, tmp_path / "saved")
    again = nnx.to_flat_state(nnx.state(load_vision_lm(saved)))
    for (name, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model)), again, strict=True):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(name))
    ids, mask, pixels = batch()
    reread = tf.Gemma3ForConditionalGeneration.from_pretrained(saved).eval()
    with torch.no_grad():
        want, got = (torch_logits(m, ids, mask, pixels).numpy() for m in (hf_model, reread))
    np.testing.assert_array_equal(got, want)


def test_greedy_generation_with_images_equals_transformers_generate(checkpoint) -> None:
    """Prompts of one image, two images and none, two samples each sharing the prompt's prefill (its images read
    once): greedy tokens and their log probs equal transformers' `generate` for each prompt alone (end of sequence
    suppressed on both sides, so every sample runs its 8 tokens)."""
    hf_model, path = checkpoint
    ids, mask, pixels = batch()
    prompts = [row[m.astype(bool)].tolist() for row, m in zip(ids, mask, strict=True)]
    images = [pixels[:1], pixels[1:3], None]
    model = load_vision_lm(path)
    engine = JaxEngine(model, max_concurrent_decodes=8, max_prefill_length=32, max_new_tokens=8)
    generator = OfflineGenerator(engine, nnx.state(model, nnx.Param), eos_token_ids=[], progress=False)
    outputs = generator.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0, n=2), images=images)
    for out in outputs:
        prompt = torch.tensor([prompts[out.request]])
        extra = {}
        if images[out.request] is not None:
            extra = {"pixel_values": torch.tensor(images[out.request]), "token_type_ids": (prompt == IMAGE).long()}
        settings = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "output_logits": True}
        want = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), return_dict_in_generate=True,
                                 **settings, **extra)  # fmt: skip
        assert out.tokens.tolist() == want.sequences[0, prompt.shape[1] :].tolist(), out.request
        logprobs = [torch.log_softmax(step[0], -1)[t].item() for step, t in zip(want.logits, out.tokens, strict=True)]
        np.testing.assert_allclose(out.logprobs, logprobs, rtol=1e-4, atol=1e-5)


def test_a_checkpoint_that_does_not_match_is_refused_before_loading(checkpoint, tmp_path) -> None:
    _, path = checkpoint
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["multi_modal_projector.mm_soft_emb_norm.weight"]
    tensors["vision_tower.extra.weight"] = np.zeros(3, np.float32)
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError) as caught:
        load_vision_lm(broken)
    assert "missing tensors: multi_modal_projector.mm_soft_emb_norm.weight" in str(caught.value)
    assert "unexpected tensors: vision_tower.extra.weight" in str(caught.value)
    (broken / "config.json").write_text((path / "config.json").read_text().replace(ARCH, "LlamaForCausalLM"))
    with pytest.raises(ValueError, match="architectures"):
        load_vision_lm(broken)


def test_every_gradient_equals_pytorchs(checkpoint) -> None:
    hf_model, path = checkpoint
    ids, mask, pixels = batch()
    hf_model.zero_grad()
    hf_loss(hf_model, ids, mask, pixels).backward()
    torch_grads = {name: p.grad.numpy() for name, p in hf_model.named_parameters()}
    ours = gradients(load_vision_lm(path), ids, mask, jnp.asarray(per_row(pixels)))
    plan = vision_lm_plan(
        VisionLanguageConfig.from_hf(hf_model.config.to_dict()), checkpoint_names(checkpoint_index(path))
    )
    for mapping in plan:
        theirs = mapping.to_model(torch_grads[torch_name(mapping.hf_name)], ours[mapping.path].shape)
        if mapping.hf_name.endswith("k_proj.bias"):  # the same score added to every key of a query: softmax ignores it
            assert np.linalg.norm(ours[mapping.path]) < 1e-5 and np.linalg.norm(theirs) < 1e-5, mapping.hf_name
        else:
            assert relative(ours[mapping.path], theirs) < 1e-4, mapping.hf_name


def test_fsdp_and_tensor_parallelism_equal_one_device(checkpoint) -> None:
    _, path = checkpoint
    ids, mask, pixels = batch()
    rows = [0, 1, 2, 0, 1, 2, 0, 0]  # 8 rows (16 image slots), both split over fsdp
    ids, mask, pixels = ids[rows], mask[rows], per_row(pixels)[rows]
    model = load_vision_lm(path)
    want_logits = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(positions(mask)),
                                   jnp.asarray(pixels)))  # fmt: skip
    want_grads = gradients(model, ids, mask, jnp.asarray(pixels))
    layout = Layout.from_config({"mesh": {"fsdp": 4, "tensor": 2}, "rules": "fsdp_tp"})
    graphdef, state = nnx.split(load_vision_lm(path, layout=layout))
    rows = layout.sharding(("batch", None), ids.shape)
    ids_d, mask_d = jax.device_put(ids, rows), jax.device_put(mask, rows)
    pixels_d = jax.device_put(pixels, layout.sharding(("batch", None, None, None, None), pixels.shape))

    def loss_and_logits(state, ids, mask, pixels):
        with program_layout(layout):
            model = nnx.merge(graphdef, state)
            logits = model(ids, mask, jnp.maximum(jnp.cumsum(mask, 1) - 1, 0), pixels)
            logp = jax.nn.log_softmax(logits, -1)
            picked = jnp.take_along_axis(logp[:, :-1], ids[:, 1:, None], 2)[..., 0]
            return jnp.sum(picked * loss_weights(np.asarray(ids_host), mask_host)[:, :-1]), logits

    ids_host, mask_host = ids, mask
    grads, logits = jax.jit(jax.grad(loss_and_logits, has_aux=True))(state, ids_d, mask_d, pixels_d)
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(logits)[real], want_logits[real], rtol=1e-5, atol=1e-5)
    for path_, value in nnx.to_flat_state(grads):
        want = want_grads[path_]
        assert relative(np.asarray(value.get_value()), want) < 1e-5 or np.linalg.norm(want) < 1e-6, path_


def test_the_actor_and_reference_read_each_rows_images_as_transformers_does(checkpoint, tmp_path) -> None:
    """An `ActorRolloutRefWorker` whose policy is the vision-language checkpoint: the log-prob and reference passes
    over rows with images (micro-batches of 2 rows, which reorder the rows by length and trim their padding) give
    transformers' log probs of each response token; the update moves the vision tower; packed rows with images are
    refused naming the setting."""
    model, path = checkpoint
    files = {"policy": str(path), "train": str(tmp_path / "train.jsonl"), "test": str(tmp_path / "test.jsonl")}
    actor = {"micro_batch_size": 2, "ppo_mini_batch_size": 4}
    cfg = load_rl_config(rl_config(files, tmp_path / "run", "grpo", actor=actor))
    worker = ActorRolloutRefWorker(cfg.actor, cfg.rollout, "actor_ref", total_steps=2, max_prompt_length=18)
    worker.init_model()
    rows = policy_rows()
    with torch.no_grad():
        logits = torch_logits(model, rows["input_ids"], rows["attention_mask"], batch()[2])
    logp = torch.log_softmax(logits[:, -RESPONSE - 1 : -1], -1)
    want = torch.gather(logp, 2, torch.tensor(rows["responses"][..., None])).squeeze(-1).numpy()
    real = rows["response_mask"].astype(bool)
    got = worker.compute_log_prob(DataProto.from_dict(rows)).batch["old_log_probs"]
    np.testing.assert_allclose(got[real], want[real], rtol=1e-5, atol=1e-5)
    ref = worker.compute_ref_log_prob(DataProto.from_dict(rows)).batch["ref_log_prob"]
    np.testing.assert_allclose(ref[real], want[real], rtol=1e-5, atol=1e-5)  # a copy of its own, another program

    tower = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(worker.params) if p[0] == "vision"}
    advantages = np.random.default_rng(5).normal(size=real.shape).astype(np.float32)
    update = rows | {"advantages": advantages, "old_log_probs": got, "ref_log_prob": ref}
    worker.update_actor(DataProto.from_dict(update))
    moved = {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(worker.params) if p[0] == "vision"}
    assert all(not np.array_equal(moved[p], tower[p]) for p in tower if p[-1] == "kernel")

    worker.cfg = dataclasses.replace(worker.cfg, packed_row_tokens=32)
    with pytest.raises(ValueError, match=r"actor\.packed_row_tokens: rows with images are not packed"):
        worker.compute_log_prob(DataProto.from_dict(rows))


def test_a_vision_checkpoint_as_anything_but_the_policy_is_refused_before_loading(checkpoint) -> None:
    """As a critic's or reward model's checkpoint, one line naming the setting, from the preflight and the loader
    alike; as the policy its tensors pass the preflight."""
    _, path = checkpoint
    check_weights(str(path), "actor.model_path", "causal_lm")
    with pytest.raises(ConfigError, match=r"critic\.model_path: .* expected it as the policy, not as a token_cls"):
        check_weights(str(path), "critic.model_path", "token_cls")
    with pytest.raises(ValueError, match=r"expected it as the policy, not as a seq_cls model"):
        load_model(str(path), dtype="float32", param_dtype=None, layout=None, head="seq_cls")
