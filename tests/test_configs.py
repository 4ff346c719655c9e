"""The shipped configs validate: every RL config of configs/gsm8k loads into `RLConfig`, its layouts fit the devices
it names and shard the named model shape evenly; the quickstart and supervised configs load too. No download."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import pytest
from flax import nnx

from hfjax.config import load_rl_config
from hfjax.models.hf import abstract_model
from hfjax.models.presets import named_config
from hfjax.parallel import Layout
from hfjax.parallel.layout import is_param_leaf
from hfjax.quickstart import QuickstartConfig
from hfjax.trainer.rm import RMConfig
from hfjax.trainer.sft import SFTConfig
from hfjax.typed_config import load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
GSM8K = sorted((CONFIGS / "gsm8k").glob("*.yaml"))


SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b", "llama-3.2-1b", "llama-3.1-8b")


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


@pytest.mark.parametrize("path", GSM8K, ids=lambda p: p.stem)
def test_gsm8k_config_validates(path):
    cfg = load_rl_config(path)
    params = nnx.state(abstract_model(named_config(_shape_name(path)), "causal_lm", "bfloat16"), nnx.Param)
    groups = len(cfg.worker_groups())
    hosts, per_host = cfg.trainer.group_hosts(groups)
    devices = hosts * per_host  # each group's, the actor's and the critic's alike
    assert devices * groups <= cfg.trainer.hosts * cfg.trainer.devices_per_host
    _check_layout(cfg.actor.train_layout, devices, params, f"{path.name}: actor.train_layout")
    _check_layout(cfg.rollout.gen_layout, devices, params, f"{path.name}: rollout.gen_layout")
    if cfg.uses_critic:
        _check_layout(cfg.critic.layout, devices, params, f"{path.name}: critic.layout")
    samples = cfg.data.train_batch_size * cfg.rollout.n
    assert samples % cfg.actor.ppo_mini_batch_size == 0
    assert math.prod(cfg.actor.train_layout["mesh"].values()) == devices


def test_other_shipped_configs_load():
    load_config(QuickstartConfig, CONFIGS / "quickstart.yaml")
    load_config(SFTConfig, CONFIGS / "sft_addition.yaml")
    load_config(RMConfig, CONFIGS / "rm_example.yaml")
