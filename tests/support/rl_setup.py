"""A tiny RL run built locally: the addition task, its tokenizer, a tiny Llama policy and a tiny score model, and
a config dict for `hfjax.config.rl.load_rl_config` (override what a test needs)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hfjax.data.synthetic import AdditionTask, build_addition_tokenizer, write_addition_task
from support.checkpoints import save_hf_model

# metrics that vary between identical runs (wall times, throughput, idle shares, the device memory peak so far on GPU
# and TPU, which a resumed run starts afresh): left out when runs are compared
VARIABLE = (
    "timing_s/",
    "timeline/",
    "perf/throughput",
    "perf/samples_per_s",
    "perf/worker_seconds",
    "perf/device_peak_bytes",
)


def deterministic(metrics: dict[str, Any]) -> dict[str, Any]:
    """`metrics` without the `VARIABLE` keys and the `step` a JSONL record carries."""
    return {k: v for k, v in metrics.items() if not k.startswith(VARIABLE) and k != "step"}


# a quickstart (either task) shrunk to a smoke run: tiny data and model, 3 SFT and 2 RL steps in-process
QUICKSTART_SMOKE = [
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
    "rl.trainer.devices_per_host=8",  # backend local runs on every device of the process: conftest's 8
    "rl.data.train_batch_size=8",
    "rl.rollout.n=2",
    "rl.rollout.slots=16",
    "rl.actor.ppo_mini_batch_size=16",
    "rl.actor.micro_batch_size=16",
]


TINY = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


def build_run_inputs(root: Path) -> dict[str, str]:
    """Writes data, tokenizer, policy and score-model checkpoints under `root`; returns their paths."""
    tokenizer = build_addition_tokenizer()
    vocab = len(tokenizer)
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, vocab_size=vocab)
    _, policy = save_hf_model(root, "llama", **TINY, **ids)
    tokenizer.save_pretrained(policy)
    _, scorer = save_hf_model(root, "llama", head="SequenceClassification", num_labels=1, **TINY, **ids)
    files = write_addition_task(AdditionTask(min_digits=1, max_digits=2, num_train=32, num_test=8, num_sft=8), root)
    return {"policy": str(policy), "scorer": str(scorer), "train": str(files["train"]), "test": str(files["test"])}


def with_moe_policy(inputs: dict[str, str], root: Path) -> dict[str, str]:
    """`inputs` (`build_run_inputs`) with a tiny Qwen3-MoE policy (every MLP a mixture of experts) on the addition
    tokenizer instead."""
    tokenizer = build_addition_tokenizer()
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, vocab_size=len(tokenizer))
    _, policy = save_hf_model(root, "qwen3_moe", **TINY, **ids, mlp_only_layers=[])
    tokenizer.save_pretrained(policy)
    return {**inputs, "policy": str(policy)}


def write_varied_reward(root: Path) -> str:
    """A reward function file scoring a response by its distinct characters (it differs between random samples, so
    advantages are not all zero); returns its `path.py:name` for `reward.function`."""
    path = root / "distinct_characters.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(set(solution_str)))\n"
    )
    return f"{path}:compute_score"


def rl_config(inputs: dict[str, str], run_dir: Path, algorithm: str = "grpo", **sections: Any) -> dict[str, Any]:
    """A 3-step config on 8 devices, in-process unless `trainer.backend` is overridden."""
    config = {
        "model_path": inputs["policy"],
        "data": {
            "train_files": [inputs["train"]],
            "val_files": [inputs["test"]],
            "max_prompt_length": 16,
            "train_batch_size": 4,
            "val_batch_size": 8,
        },
        "actor": {"ppo_mini_batch_size": 4, "micro_batch_size": 4, "optim": {"lr": 1e-3}, "use_kl_loss": True},
        "critic": {"ppo_mini_batch_size": 4, "micro_batch_size": 4},
        "rollout": {"n": 2, "response_length": 6, "slots": 8},
        # the reference policy in the actor's loss everywhere, and in the reward where a critic learns from it
        "algorithm": {"name": algorithm, "use_kl_in_reward": algorithm in ("ppo", "remax", "safe_rlhf")},
        "trainer": {"run_dir": str(run_dir), "total_steps": 3, "backend": "local", "progress": False, "plot": False},
    }
    if algorithm == "safe_rlhf":
        config["reward"] = {"cost_model": {"model_path": inputs["scorer"]}}
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return config


def same_accuracy(a: float, b: float, problems: int) -> bool:
    """Whether two held-out accuracies agree up to what the test set can tell apart (two standard errors of the
    difference of two accuracies over its problems)."""
    mean = (a + b) / 2
    return abs(a - b) <= 2 * math.sqrt(2 * mean * (1 - mean) / problems)
