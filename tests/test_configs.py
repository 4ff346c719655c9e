"""The shipped configs validate: every RL config of configs/gsm8k loads into `RLConfig`, its layouts fit the devices
it names and shard the named model shape evenly; the quickstart and supervised configs load too. No download."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import pytest
from flax import nnx

from hfjax.automap import ClusterSpec, CostModel, role_shapes
from hfjax.cli.quickstart import QuickstartConfig
from hfjax.config.rl import load_rl_config
from hfjax.config.supervised import RMConfig, SFTConfig
from hfjax.models.hf import abstract_model
from hfjax.models.presets import named_config
from hfjax.parallel import Layout
from hfjax.parallel.layout import is_param_leaf
from hfjax.predict.run_config import predict_run, run_cost_options, run_dataflow, run_models, run_workload
from hfjax.typed_config import load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
GSM8K = sorted((CONFIGS / "gsm8k").glob("*.yaml"))
SHIPPED = GSM8K + sorted((CONFIGS / "long").glob("*.yaml"))  # and the long-trajectory configs


SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b", "llama-3.2-1b", "llama-3.1-8b", "gemma-3-1b", "qwen3-30b-a3b")
HARDWARE = {"tpu-v5e": "tpu-v5e", "tpu-v5p": "tpu-v5p", "gpu": "h100"}  # file name part -> built-in device profile


def _shape_name(path: Path) -> str:
    return next(name for name in SHAPES if path.name.startswith(name))


def _check_layout(config: dict, devices: int, params, where: str) -> None:
    layout = Layout.from_config(config, where)
    assert layout.size == devices, f"{where}: {layout.describe()} has {layout.size} devices, the group has {devices}"
    for leaf in jax.tree.leaves(params, is_leaf=is_param_leaf):
        layout.spec(leaf.get_metadata()["logical_axes"], leaf.shape, where)  # raises when a dimension does not divide


def test_gsm8k_configs_cover_algorithms_and_hardware():
    assert len(GSM8K) >= 8
    names = " ".join(p.name for p in GSM8K)
    for algorithm in ("ppo", "grpo", "remax", "safe_rlhf"):
        assert f"-{algorithm}-" in names
    for hardware in ("1gpu", "8gpu", "tpu-v5e-8"):
        assert hardware in names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_gsm8k_config_validates(path):
    cfg = load_rl_config(path)
    params = nnx.state(abstract_model(named_config(_shape_name(path)), "causal_lm", "bfloat16"), nnx.Param)
    groups = len(cfg.worker_groups())
    hosts, per_host = cfg.group_shape("actor")
    devices = hosts * per_host  # each group's, the actor's and the critic's alike
    assert devices * groups <= cfg.trainer.hosts * cfg.trainer.devices_per_host
    _check_layout(cfg.actor.train_layout, devices, params, f"{path.name}: actor.train_layout")
    _check_layout(cfg.rollout.gen_layout, devices, params, f"{path.name}: rollout.gen_layout")
    if cfg.uses_critic:
        _check_layout(cfg.critic.layout, devices, params, f"{path.name}: critic.layout")
    samples = cfg.data.train_batch_size * cfg.rollout.n
    assert samples % cfg.actor.ppo_mini_batch_size == 0
    assert math.prod(cfg.actor.train_layout["mesh"].values()) == devices


def _hardware(path: Path) -> str:
    return next(profile for part, profile in HARDWARE.items() if part in path.stem)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_gsm8k_config_fits_its_hardware_memory(path):
    """The cost model's memory per device for the config's own mapping (master weights, Adam state, gradients,
    generation copy, KV cache, activations) fits the device memory of the hardware its name gives."""
    cfg = load_rl_config(path)
    cluster = ClusterSpec.builtin(_hardware(path), cfg.trainer.hosts, cfg.trainer.devices_per_host)
    shape = named_config(_shape_name(path))
    prediction = predict_run(cfg, cluster, {role: shape for role in run_models(cfg)})  # raises when it does not fit
    usable = cluster.device_memory_bytes * 0.9
    assert max(prediction.group_peak_bytes) <= usable, (prediction.group_peak_bytes, usable)


def test_cost_model_counts_master_weights_optimizer_state_generation_copy_and_kv_cache():
    """By hand for Qwen2.5-0.5B GRPO on one GPU: float32 master (4 bytes per parameter), two float32 Adam moments
    (8), float32 gradients twice (4 + 4: a micro-batch's beside the accumulator, 16 micro-batches of 16 rows per
    optimizer step), a bfloat16 frozen reference (2), a bfloat16 generation copy beside the master (2), and a
    bfloat16 KV cache of 2 x layers x kv heads x head dim per token for every sequence of one wave."""
    path = CONFIGS / "gsm8k" / "qwen2.5-0.5b-grpo-1gpu.yaml"
    cfg = load_rl_config(path)
    shape = named_config("qwen2.5-0.5b")
    prediction = predict_run(cfg, ClusterSpec.builtin("h100", 1, 1), {role: shape for role in run_models(cfg)})
    actor, ref = prediction.roles["actor"].memory, prediction.roles["ref"].memory
    params = shape.num_params
    assert cfg.actor.ppo_mini_batch_size // cfg.actor.micro_batch_size == 16
    assert actor["params"] == 4 * params and actor["optimizer"] == 8 * params and actor["grads"] == 2 * 4 * params
    assert ref["params"] == 2 * params and actor["gen_extra_params"] == 2 * params
    waves = prediction.roles["actor"].detail["gen_waves"]
    sequences = math.ceil(cfg.data.train_batch_size * cfg.rollout.n / waves)
    per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2
    seq_len = cfg.data.max_prompt_length + cfg.rollout.response_length
    assert actor["kv_cache"] == sequences * seq_len * per_token


def test_other_shipped_configs_load():
    load_config(QuickstartConfig, CONFIGS / "quickstart.yaml")
    load_config(SFTConfig, CONFIGS / "sft_addition.yaml")
    load_config(RMConfig, CONFIGS / "rm_example.yaml")


def test_cost_model_prices_no_old_log_prob_pass_that_the_update_computes():
    """GRPO with one optimizer step per iteration (`actor.old_log_prob: auto`) takes the old log probs from the update's
    own forward, so the actor has no inference pass; `recompute` adds the pass, priced as the actor's `infer` seconds
    plus one call's overhead, and its activations."""
    path = CONFIGS / "gsm8k" / "qwen2.5-0.5b-grpo-1gpu.yaml"
    cluster = ClusterSpec.builtin("h100", 1, 1)
    shape = named_config("qwen2.5-0.5b")
    base = load_rl_config(path)
    whole = f"actor.ppo_mini_batch_size={base.data.train_batch_size * base.rollout.n}"  # one optimizer step
    reused, recomputed = (load_rl_config(path, [whole, f"actor.old_log_prob={m}"]) for m in ("auto", "recompute"))
    assert reused.reuses_update_log_probs and not recomputed.reuses_update_log_probs
    auto, separate = (predict_run(c, cluster, {role: shape for role in run_models(c)}) for c in (reused, recomputed))
    assert auto.roles["actor"].seconds["inference"] == 0 and "infer_activations" not in auto.roles["actor"].memory
    flow = run_dataflow(recomputed)
    model = CostModel(cluster, flow, run_workload(recomputed), run_cost_options(recomputed))
    actor = separate.roles["actor"]
    actor_shape = role_shapes(flow, {"actor": shape})["actor"]
    expected = model.infer("actor", actor_shape, actor.sizes)["seconds"] + cluster.profile.call_overhead_s
    assert actor.seconds["inference"] == pytest.approx(expected)
    assert auto.roles["ref"].seconds == separate.roles["ref"].seconds  # the reference pass runs in both
