"""Every program of a run lowers for a TPU and for a CUDA GPU at a real model's shapes (Qwen2.5-0.5B's widths,
heads and 151,936 vocabulary; 2 layers), with the choices the target makes (its devices' platform, mocked here over
the 8 fake CPU devices): Pallas kernels per shard on a TPU, KV blocks in multiples of 128 lanes. Lowering needs no
plugin (`jax.export`'s path); compiling for the real targets is `-m compile_target` (`tests/test_targets.py`)."""

from __future__ import annotations

import dataclasses

import pytest

from hfjax.automap.compiled.programs import actor_programs, critic_programs
from hfjax.config.rl import load_rl_config
from hfjax.models.decode_attention import KERNEL_MIN_HEAD_DIM
from hfjax.models.hf import abstract_model
from hfjax.models.presets import NAMED_CONFIGS
from hfjax.parallel import Layout
from hfjax.rollout import JaxEngine

SHAPE = dataclasses.replace(NAMED_CONFIGS["qwen2.5-0.5b"], num_layers=2, sliding_windows=(None, None))
CONFIG = {
    "actor": {
        "model_path": "unused",
        "dtype": "bfloat16",
        "micro_batch_size": 8,
        "ppo_mini_batch_size": 8,
        "use_kl_loss": True,
    },
    "critic": {"model_path": "unused", "dtype": "bfloat16", "micro_batch_size": 8, "ppo_mini_batch_size": 8},
    "data": {"max_prompt_length": 128},
    "rollout": {"response_length": 128, "slots": 16, "top_k": 20},
    "algorithm": {"name": "ppo"},
}
TRAIN = {"mesh": {"fsdp": 4, "tensor": 2}, "rules": "fsdp_tp"}
GEN = {"mesh": {"data": 4, "tensor": 2}, "rules": "dp_tp_gen"}


@pytest.mark.parametrize("platform,lowering", [("tpu", "tpu"), ("gpu", "cuda")])
def test_every_program_lowers_for_the_target(monkeypatch, platform, lowering):
    monkeypatch.setattr(Layout, "platform", property(lambda self: platform))
    cfg = load_rl_config(CONFIG)
    train, gen = Layout.from_config(TRAIN), Layout.from_config(GEN)
    traces = [*actor_programs(cfg, SHAPE, train, gen), *critic_programs(cfg, SHAPE, train)]
    names = [t.program.split(" ")[0] for t in traces]
    assert names == ["loss+grad", "optimizer", "log", "ref", "prefill", "decode", "loss+grad", "optimizer", "values"]
    for trace in traces:
        text = trace.traced.lower(lowering_platforms=(lowering,)).as_text()
        kernels = text.count("tpu_custom_call")
        narrow_decode = trace.program.startswith("decode") and SHAPE.head_dim < KERNEL_MIN_HEAD_DIM
        if platform == "tpu" and narrow_decode:  # 64-wide heads decode as xla (no relayout of the cache per step)
            assert kernels == 0, (
                f"{trace.group} {trace.program}: the Pallas decode kernel for {SHAPE.head_dim}-wide heads"
            )
        elif platform == "tpu" and trace.program != "optimizer step":  # every other program with attention
            assert kernels, f"{trace.group} {trace.program}: no Pallas kernel"
        else:
            assert kernels == 0, f"{trace.group} {trace.program}: a TPU kernel in a {lowering} program"
    engine = JaxEngine(abstract_model(SHAPE, "causal_lm", "bfloat16"), gen, max_prefill_length=128, max_new_tokens=128)
    assert engine.block == (128 if platform == "tpu" else 32)  # 256 positions: one lane-wide block on a TPU


@pytest.mark.parametrize("platform,lowering", [("tpu", "tpu"), ("gpu", "cuda")])
def test_packed_programs_lower_for_the_target(monkeypatch, platform, lowering):
    """With `packed_row_tokens` the actor's and critic's gradient and pass programs take packed rows (segment ids in
    the attention: splash segment ids on a TPU, a cuDNN mask on a GPU) and still lower for the target."""
    monkeypatch.setattr(Layout, "platform", property(lambda self: platform))
    packed = {section: {**CONFIG[section], "packed_row_tokens": 512} for section in ("actor", "critic")}
    cfg = load_rl_config({**CONFIG, **packed, "actor": {**packed["actor"], "use_kl_loss": False}})
    train, gen = Layout.from_config(TRAIN), Layout.from_config(GEN)
    traces = [t for t in actor_programs(cfg, SHAPE, train, gen) if t.program in ("loss+grad", "log probs")]
    traces += [t for t in critic_programs(cfg, SHAPE, train) if t.program in ("loss+grad", "values")]
    assert len(traces) == 4
    for trace in traces:
        text = trace.traced.lower(lowering_platforms=(lowering,)).as_text()
        assert "tensor<4x512xi32>" in text  # one packed row of 512 tokens per batch part (fsdp=4)
        assert bool(text.count("tpu_custom_call")) == (platform == "tpu"), f"{trace.group} {trace.program}"
