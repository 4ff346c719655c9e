"""The compile check (`hfjax compile`'s programs) of a vision-language policy, on this machine's 8 CPU devices: every
program of the run is built with the vision tower and the rows' images (`data.max_images` a row), and compiles; with
the tower frozen, the update's gradients leave out exactly the tower's parameters; the shipped vision config names a
model whose shape needs no download."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from support.rl_setup import rl_config
from support.vision import build_gemma3_processor, save_vision_policy

from hfjax.automap.compiled.programs import AbstractModel, measure
from hfjax.automap.compiled.report import model_shape, run_roles
from hfjax.cli.packaged import config_path
from hfjax.config.rl import load_rl_config
from hfjax.models.presets import vision_language_shape

PROGRAMS = ["actor loss+grad", "actor optimizer step", "actor log probs", "actor ref log probs",
            "rollout prefill 8 x 32", "rollout decode 8 slots"]  # fmt: skip


def _config(tmp_path, freeze: bool):
    policy = save_vision_policy(tmp_path / "policy", build_gemma3_processor())
    files = {"policy": str(policy), "train": "unread.parquet", "test": "unread.parquet"}
    config = rl_config(files, tmp_path / "run", trainer={"devices_per_host": 8}, data={"max_prompt_length": 32})
    config["actor"] |= {"freeze_vision_tower": freeze, "train_layout": {"mesh": {"fsdp": 8}, "rules": "fsdp"},
                        "micro_batch_size": 8, "ppo_mini_batch_size": 8}  # fmt: skip
    return load_rl_config(config)


def _tower_bytes_per_device(cfg) -> int:
    """Bytes per device of the vision tower's float32 parameters as the training layout shards them (JAX's shard
    shapes of the abstract policy's parameters)."""
    from hfjax.parallel.layout import Layout

    layout = Layout.from_config(cfg.actor.train_layout, "actor.train_layout").on_devices(jax.devices())
    shape, vision = model_shape(cfg.actor.model_path, "actor"), vision_language_shape(cfg.actor.model_path)
    policy = AbstractModel.build(shape, "causal_lm", layout, "float32", "float32", vision=vision)
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(policy.params):
        if any(getattr(key, "key", None) == "vision_tower" for key in path):
            total += int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * jnp.dtype(leaf.dtype).itemsize
    return total


def _output_bytes_per_device(traced) -> int:
    """Bytes per device of a compiled program's outputs, by its own output shardings (the compiler's buffer sizes
    add a few bytes of alignment per buffer on top)."""
    compiled = traced.lower().compile()
    leaves = zip(jax.tree.leaves(traced.out_info), jax.tree.leaves(compiled.output_shardings), strict=True)
    return sum(int(np.prod(s.shard_shape(a.shape))) * jnp.dtype(a.dtype).itemsize for a, s in leaves)


def test_every_program_of_a_vision_policy_compiles_with_its_images(tmp_path):
    gradients = {}
    for freeze in (False, True):
        cfg = _config(tmp_path / str(freeze), freeze)
        cfg.data.max_images = 1 if freeze else 4  # each pass reads rows of this many images (32 tokens hold 8)
        (actor,) = run_roles(cfg, jax.devices())
        traces = list(actor.programs(0))
        assert [f"{t.group} {t.program}" for t in traces] == PROGRAMS
        for trace in traces:
            if trace.program in ("loss+grad", "log probs", "prefill 8 x 32"):  # each reads the rows' images
                shapes = [a.shape for a in jax.tree.leaves(trace.traced.jaxpr.in_avals)]
                assert (8, cfg.data.max_images, 3, 32, 32) in shapes, (trace.program, shapes)
            if freeze:  # every program compiles (the trained-tower run's update below)
                assert measure(trace).temporaries > 0
        gradients[freeze] = _output_bytes_per_device(traces[0].traced)
    tower = _tower_bytes_per_device(cfg)
    assert tower > 0
    assert gradients[False] - gradients[True] == tower  # the frozen update's gradients lack exactly the tower's


def test_the_shipped_vision_config_names_a_known_shape():
    cfg = load_rl_config(str(config_path("vision/gemma-3-4b-grpo-lora-tpu-v5e-8.yaml")))
    vision = vision_language_shape(cfg.actor.model_path)
    assert vision is not None and vision.vision.image_size == 896 and vision.vision.tokens_per_image == 256
    assert model_shape(cfg.actor.model_path, "actor.model_path") == vision.text
