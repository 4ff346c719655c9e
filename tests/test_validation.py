"""Validation before work (issue #29): every bad input of an RL, SFT, quickstart or generate run fails when the config
loads or in the preflight checks (before Ray, workers or device memory), with hfjax's own error class and one line
naming the field and what was expected. Tiny local checkpoints only; nothing is downloaded."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
from support.rl_setup import build_run_inputs, rl_config, with_moe_policy

from hfjax.cli.main import main
from hfjax.cli.quickstart import QuickstartConfig, run_quickstart
from hfjax.config.rl import load_rl_config
from hfjax.config.supervised import SFTConfig
from hfjax.data.records import DataError, read_rows, write_rows
from hfjax.protocol import DataProto
from hfjax.rewards import RewardError, load_reward_function
from hfjax.rewards.rule_reward import ERRORS_METRIC, RuleReward
from hfjax.trainer import launch, preflight
from hfjax.trainer.preflight import check_rl_run
from hfjax.trainer.supervised import check_supervised_run
from hfjax.typed_config import ConfigError, load_config

BASE = {"model_path": "unused", "rollout": {"n": 2}}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_run_inputs(tmp_path_factory.mktemp("run_inputs"))


def config_error(overrides: list[str], base: dict | None = None) -> str:
    """The one-line ConfigError message of loading BASE (or `base`) with `overrides`."""
    with pytest.raises(ConfigError) as info:
        load_rl_config(base or BASE, overrides)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_critic_micro_batch_zero_is_a_config_error_not_zero_division():
    message = config_error(["algorithm.name=ppo", "critic.micro_batch_size=0"])
    assert message.startswith("critic.micro_batch_size: expected >= 1, got 0")


def test_a_packed_row_must_hold_the_longest_sequence():
    message = config_error(["data.max_prompt_length=64", "rollout.response_length=512", "actor.packed_row_tokens=500"])
    assert "actor.packed_row_tokens=500: a packed row holds whole sequences" in message
    assert "at least data.max_prompt_length + rollout.response_length = 576" in message
    assert config_error(["critic.packed_row_tokens=-1"]).startswith("critic.packed_row_tokens: expected >= 0, got -1")
    load_rl_config(BASE, ["data.max_prompt_length=64", "rollout.response_length=512", "actor.packed_row_tokens=576"])


@pytest.mark.parametrize("field", ["ppo_mini_batch_size", "micro_batch_size", "ppo_epochs"])
def test_negative_critic_sizes_are_rejected_at_load(field):
    message = config_error(["algorithm.name=ppo", f"critic.{field}=-4"])
    assert message.startswith(f"critic.{field}: expected >= 1, got -4")


@pytest.mark.parametrize(
    ("override", "field", "expected"),
    [
        ("actor.clip_ratio_low=-1", "actor.clip_ratio_low", "in [0, 1)"),
        ("actor.clip_ratio_high=-0.1", "actor.clip_ratio_high", ">= 0"),
        ("actor.clip_ratio_c=1", "actor.clip_ratio_c", "> 1"),
        ("actor.kl_loss_coef=-0.01", "actor.kl_loss_coef", ">= 0"),
        ("actor.entropy_coeff=-1", "actor.entropy_coeff", ">= 0"),
        ("algorithm.kl_coef=-0.5", "algorithm.kl_coef", ">= 0"),
        ("algorithm.gamma=1.5", "algorithm.gamma", "in [0, 1]"),
        ("algorithm.lam=-0.1", "algorithm.lam", "in [0, 1]"),
        ("algorithm.target_kl=0", "algorithm.target_kl", "> 0"),
        ("algorithm.horizon=0", "algorithm.horizon", ">= 1"),
        ("algorithm.lambda_init=-1", "algorithm.lambda_init", ">= 0"),
        ("rollout.temperature=0", "rollout.temperature", "> 0"),
        ("rollout.temperature=-1", "rollout.temperature", "> 0"),
        ("rollout.top_p=0", "rollout.top_p", "in (0, 1]"),
        ("rollout.top_p=1.5", "rollout.top_p", "in (0, 1]"),
        ("rollout.top_k=-1", "rollout.top_k", ">= 0"),
        ("rollout.response_length=0", "rollout.response_length", ">= 1"),
        ("rollout.slots=-2", "rollout.slots", ">= 1"),
        ("rollout.seed=-1", "rollout.seed", ">= 0"),
        ("data.max_prompt_length=0", "data.max_prompt_length", ">= 1"),
        ("data.train_batch_size=0", "data.train_batch_size", ">= 1"),
        ("data.val_batch_size=-8", "data.val_batch_size", ">= 1"),
        ("trainer.save_freq=-1", "trainer.save_freq", ">= 0"),
        ("trainer.max_to_keep=0", "trainer.max_to_keep", ">= 1"),
        ("trainer.critic_warmup=-1", "trainer.critic_warmup", ">= 0"),
        ("trainer.device_memory_gib=0", "trainer.device_memory_gib", "a number of GiB > 0"),
        ("reward.reward_model.micro_batch_size=0", "reward.reward_model.micro_batch_size", ">= 1"),
        ("actor.optim.lr=-1e-5", "actor.optim.lr", "> 0"),
        ("critic.optim.b2=1", "critic.optim.b2", "in [0, 1)"),
        ("async.check_every=0", "async.check_every", ">= 1"),
    ],
)
def test_out_of_range_numbers_name_the_field_and_range(override, field, expected):
    message = config_error([override])
    assert message.startswith(f"{field}: expected {expected}"), message
    assert "(from overrides)" in message


def test_nan_is_no_float():
    assert config_error(["algorithm.lam=.nan"]).startswith("algorithm.lam: expected a float that is not NaN, got nan")


@pytest.mark.parametrize(
    ("override", "field", "suggestion"),
    [
        ("actor.policy_loss=ppoo", "actor.policy_loss", "ppo"),
        ("actor.kl_loss_type=low_var", "actor.kl_loss_type", "low_var_kl"),
        ("algorithm.kl_penalty=mes", "algorithm.kl_penalty", "mse"),
        ("algorithm.name=gpro", "algorithm.name", "grpo"),
        ("actor.loss_agg_mode=token_mean", "actor.loss_agg_mode", "token-mean"),
    ],
)
def test_registry_names_are_checked_at_load_with_a_suggestion(override, field, suggestion):
    message = config_error([override])
    assert message.startswith(f"{field}: expected ")
    assert message.endswith(f"did you mean {suggestion!r}?") or f"did you mean {suggestion!r}?" in message


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_mini_batch_message_names_its_section(role):
    message = config_error(["algorithm.name=ppo", f"{role}.ppo_mini_batch_size=12", f"{role}.micro_batch_size=8"])
    assert message.startswith(f"{role}.ppo_mini_batch_size: expected a multiple of micro_batch_size=8, got 12")


def test_lengths_beyond_the_model_positions_name_both_numbers(inputs, tmp_path):
    cfg = load_rl_config(rl_config(inputs, tmp_path, "grpo"), ["rollout.response_length=100000"])
    with pytest.raises(
        ConfigError,
        match=r"rollout.response_length 100000 = 100016 tokens: expected at most the "
        r"max_position_embeddings 128 of the model at model_path",
    ):
        check_rl_run(cfg)


def test_kv_cache_beyond_device_memory_names_slots_and_sizes(inputs, tmp_path):
    cfg = load_rl_config(rl_config(inputs, tmp_path, "grpo"), ["rollout.slots=50000000", "trainer.device_memory_gib=4"])
    with pytest.raises(ConfigError) as info:
        check_rl_run(cfg)
    message = str(info.value)
    assert message.startswith("rollout.slots=50000000: the KV cache of 50000000 slots x 22 tokens x 2 layers")
    assert "GiB per device on 8 devices" in message and "trainer.device_memory_gib=4" in message


def test_run_memory_from_the_cost_model_beyond_device_memory(inputs, tmp_path):
    cfg = load_rl_config(rl_config(inputs, tmp_path, "ppo"), ["trainer.device_memory_gib=1e-6"])
    with pytest.raises(ConfigError, match=r"^memory: actor\+ref\+critic on 8 devices needs .* GiB usable"):
        check_rl_run(cfg)


@pytest.mark.parametrize("platforms", [None, "", "cpu"])
def test_run_memory_is_checked_on_a_cpu_machine_whatever_jax_platforms_says(inputs, tmp_path, monkeypatch, platforms):
    """An absurd LoRA rank on a machine without accelerators fails the memory check, with JAX_PLATFORMS unset, empty
    or cpu (`trainer.device: auto`), instead of the kernel killing the run."""
    if platforms is None:
        monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    else:
        monkeypatch.setenv("JAX_PLATFORMS", platforms)
    monkeypatch.setattr(preflight, "local_accelerator", lambda device: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = load_rl_config(rl_config(inputs, tmp_path, "grpo"), ["actor.lora.rank=100000000"])
    with pytest.raises(ConfigError, match=r"^memory: .* GiB usable.*\(host RAM / trainer.devices_per_host=8\)$"):
        check_rl_run(cfg)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_lora_targets_that_match_no_module_of_a_mixture_of_experts_are_named(inputs, tmp_path, role):
    """MLP-only LoRA targets on a model whose every layer is a mixture of experts (no dense MLP to adapt) fail at
    preflight naming the field, the targets and the modules the model has; attention targets pass that check."""
    moe = with_moe_policy(inputs, tmp_path)
    mlp = {"rank": 4, "targets": ["gate_proj", "up_proj", "down_proj"]}
    cfg = load_rl_config(rl_config(moe, tmp_path / "run", "ppo", **{role: {"lora": mlp}}))
    with pytest.raises(ConfigError) as info:
        check_rl_run(cfg)
    assert str(info.value) == (
        f"{role}.lora.targets: ['gate_proj', 'up_proj', 'down_proj'] match no module of the model at {moe['policy']} "
        "(every layer's MLP is a mixture of experts, whose experts get no adapters); expected at least one of its "
        "modules ['q_proj', 'k_proj', 'v_proj', 'o_proj']"
    )
    mixed = {"rank": 4, "targets": ["q_proj", "gate_proj"]}
    check_rl_run(load_rl_config(rl_config(moe, tmp_path / "run", "ppo", **{role: {"lora": mixed}})))


def test_generate_with_a_million_new_tokens_is_one_clear_line(inputs, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [3, 4, 5]}) + "\n")
    argv = ["generate", "--model", inputs["policy"], "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl")]

    def error(*extra: str) -> str:
        assert main([*argv, *extra]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("hfjax generate: ")
        return lines[0]

    message = error("--max-new-tokens", "1000000")
    assert "--max-new-tokens 1000000 = 1000003 tokens: expected at most the max_position_embeddings 128" in message
    assert "--slots 100000000: the KV cache of 100000000 slots x 103 tokens" in error(
        "--max-new-tokens", "100", "--slots", "100000000"
    )
    assert "sampling.top_p: expected a number in (0, 1], got 2.0" in error("--top-p", "2")


def test_quickstart_typos_fail_when_it_loads_before_sft():
    for override, line in (
        ("rl.algorithm.nme=ppo", "rl.algorithm.nme: unknown key"),
        ("sft.data.micro_batch_size=0", "sft.data.micro_batch_size: expected >= 1, got 0"),
        ("rl.actor.clip_ratio_low=-1", "rl.actor.clip_ratio_low: expected in [0, 1)"),
        ("task.max_digit=3", "task.max_digit: unknown key"),
    ):
        with pytest.raises(ConfigError) as info:
            load_config(QuickstartConfig, "configs/quickstart.yaml", [override])
        assert str(info.value).startswith(line), str(info.value)


def test_quickstart_checks_the_rl_run_against_the_base_model_before_sft(tmp_path):
    small = ["task.num_train=16", "task.num_test=8", "task.num_sft=16", "rl.rollout.response_length=200"]
    cfg = load_config(QuickstartConfig, "configs/quickstart.yaml", [*small, f"run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"rollout.response_length 200 = 216 tokens: expected at most the "):
        run_quickstart(cfg)
    assert not (tmp_path / "sft").exists()


@pytest.mark.parametrize(
    ("path", "hint"), [("/no/such/model", ""), ("Qwen/Qwen2.5-0.5B", "a Hub id is resolved before this check")]
)
def test_missing_model_path_is_named_not_a_hub_error(inputs, tmp_path, path, hint):
    cfg = load_rl_config(rl_config(inputs, tmp_path, "grpo"), [f"model_path={path}"])
    with pytest.raises(ConfigError) as info:
        check_rl_run(cfg)
    assert str(info.value).startswith(f"model_path: no such directory {path!r}")
    assert hint in str(info.value)


def test_missing_sft_model_and_over_long_sft_sequences(inputs, tmp_path):
    data = {"train_files": [inputs["train"]]}
    missing = load_config(SFTConfig, {"model": {"path": str(tmp_path / "nope")}, "data": data})
    with pytest.raises(ConfigError, match=r"^model\.path: no such directory"):
        check_supervised_run(missing)
    long = load_config(SFTConfig, {"model": {"path": inputs["policy"]}, "data": {**data, "max_length": 4096}})
    with pytest.raises(ConfigError, match=r"^data\.max_length 4096 = 4096 tokens: expected at most .* 128"):
        check_supervised_run(long)


REWARD_FILES = {
    "import": ("import no_such_module_hfjax\n", "importing .* failed: ModuleNotFoundError"),
    "name": ("def other(**kw):\n    return 1.0\n", ".*reward.py has no 'score' \\(its functions: \\['other'\\]"),
    "signature": ("def score(text):\n    return 1.0\n", "cannot be called as score"),
}


@pytest.mark.parametrize("case", sorted(REWARD_FILES))
def test_bad_reward_function_files_fail_at_preflight(inputs, tmp_path, case):
    source, pattern = REWARD_FILES[case]
    file = tmp_path / "reward.py"
    file.write_text(source)
    cfg = load_rl_config(rl_config(inputs, tmp_path, "grpo", reward={"function": f"{file}:score"}))
    with pytest.raises(ConfigError, match=f"^reward.function: reward function '{file}:score': {pattern}"):
        check_rl_run(cfg)
    with pytest.raises(RewardError):
        load_reward_function(f"{file}:score")


def test_missing_reward_file_is_named(inputs, tmp_path):
    cfg = load_rl_config(rl_config(inputs, tmp_path, "grpo", reward={"function": f"{tmp_path}/none.py:score"}))
    with pytest.raises(ConfigError, match=r"^reward\.function: .* no such file"):
        check_rl_run(cfg)


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def rollout_batch(rows: int) -> DataProto:
    rng = np.random.default_rng(7)
    responses = rng.integers(0, 26, (rows, 5))
    mask = np.ones((rows, 5), np.int32)
    sources = np.array(["src"] * rows, dtype=object)
    truths = np.array([str(i) for i in range(rows)], dtype=object)
    index = np.array([100 + i for i in range(rows)], dtype=object)
    return DataProto.from_dict(
        {"responses": responses, "response_mask": mask},
        {"data_source": sources, "ground_truth": truths, "index": index},
    )


@pytest.mark.parametrize(
    ("body", "pattern"),
    [
        ("raise KeyError('boom')", "raised KeyError: 'boom'"),
        ("return float('nan')", "returned nan; expected a finite number"),
        ("return None", "returned None; expected a finite number"),
        ("return 'high'", "returned 'high'; expected a finite number"),
    ],
)
def test_reward_function_failures_name_the_function_row_and_value(tmp_path, body, pattern):
    file = tmp_path / "reward.py"
    header = "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
    file.write_text(f"{header}    if ground_truth == '2':\n        {body}\n    return 1.0\n")
    reward = RuleReward(CharTokenizer(), f"{file}:score")
    with pytest.raises(RewardError) as info:
        reward(rollout_batch(4))
    message = str(info.value)
    assert "\n" not in message
    assert f"reward function '{file}:score' " in message and pattern in message
    assert "sample 2 of the batch, row index 102, data_source 'src', response '" in message
    skipping = RuleReward(CharTokenizer(), f"{file}:score", on_error="skip")(rollout_batch(4))
    np.testing.assert_array_equal(skipping.batch["scores"], [1.0, 1.0, 0.0, 1.0])
    assert skipping.meta_info["metrics"][ERRORS_METRIC] == 1.0


def test_skipping_a_reward_that_fails_on_every_sample_is_an_error(tmp_path):
    """`reward.on_error: skip` with a reward function that fails on every sample of a batch: nothing is left to train
    on, so one line naming `reward.on_error`, how many samples failed and the first failure, not a run of zeros."""
    file = tmp_path / "reward.py"
    file.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return None\n")
    with pytest.raises(RewardError) as info:
        RuleReward(CharTokenizer(), f"{file}:score", on_error="skip")(rollout_batch(4))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "reward.on_error=skip: the reward failed on all 4 samples of the batch, which leaves nothing to train on; "
        f"the first: reward function '{file}:score' returned None; expected a finite number"
    )
    assert "(sample 0 of the batch, row index 100, data_source 'src', response '" in message


def test_reward_on_error_is_a_checked_config_value():
    assert config_error(["reward.on_error=ignore"]).startswith("reward.on_error: expected one of 'raise', 'skip'")


def test_rows_without_ground_truth_fail_before_the_run(inputs, tmp_path):
    rows = [row for _, row in read_rows(inputs["train"])]
    rows[3] = {**rows[3], "reward_model": {"style": "rule"}}
    train = write_rows(rows, tmp_path / "no_truth.jsonl")
    cfg = load_rl_config(rl_config(inputs, tmp_path, "grpo", data={"train_files": [str(train)]}))
    with pytest.raises(DataError, match=r"no_truth.jsonl: row 4: missing field 'reward_model.ground_truth'"):
        check_rl_run(cfg)
    cfg = load_rl_config(
        rl_config(inputs, tmp_path, "grpo", data={"train_files": [str(train)]}), ["reward.use_rule=false"]
    )
    check_rl_run(cfg)  # nothing needs the ground truth


def test_a_valid_run_passes_the_preflight(inputs, tmp_path):
    for algorithm in ("grpo", "ppo"):
        check_rl_run(load_rl_config(rl_config(inputs, tmp_path, algorithm)))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["trainer.devices_per_host=512", "trainer.backend=ray"],
            r"trainer.devices_per_host=512: the default actor.train_layout mesh\(fsdp=512\) cannot shard \d+ "
            r"parameters of the model at .*: dimension \d \('embed'\) of shape \(\d+, 32\) is not divisible",
        ),
        (
            ["trainer.placement=standalone"],
            r"trainer.placement=standalone: runs 2 worker groups \(\[\['actor'\], \['critic'\]\]\) on separate "
            r"devices, which needs trainer.backend=ray",
        ),
        (["data.train_batch_size=33"], r"data.train_batch_size=33: expected at most the 32 rows of data.train_files"),
        (  # the 8 fake devices of this process: 2 would be counted by the memory check, 8 used
            ["trainer.devices_per_host=2"],
            r"trainer.devices_per_host=2, but backend local runs on every device of this process and it has 8 \(cpu\)",
        ),
    ],
)
def test_device_placement_and_batch_errors_name_the_field_before_ray_starts(
    inputs, tmp_path, capsys, overrides, message
):
    """One `hfjax train` line with exit code 2, from the preflight (the 32-row dataset, the 32-wide tiny model)."""
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps(rl_config(inputs, tmp_path / "run", "ppo")))
    assert main(["train", str(config), *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(rf"hfjax train: {message}.*", err[-1]), err[-1]
    assert not (tmp_path / "run").exists()  # nothing started: no run directory, no Ray


def test_an_accelerator_this_machine_lacks_is_named(inputs, tmp_path, monkeypatch):
    cfg = load_rl_config(rl_config(inputs, tmp_path, "grpo"), ["trainer.device=gpu", "trainer.backend=ray"])
    monkeypatch.setattr(preflight, "local_accelerator", lambda device: False)  # as on a machine without GPUs
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match=r"^trainer.device=gpu: this machine has no GPU \(no /dev/nvidia\* or"):
        check_rl_run(cfg)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a cluster's GPUs are checked when it is joined
    check_rl_run(cfg)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("truncate", r"do not fit shape .* in a file of \d+ bytes"),
        ("reshape", r"checkpoint does not match the model: mis-shaped tensors: model.layers.0.mlp.gate_proj.weight"),
        ("config", r"is not a readable Hugging Face model directory"),
    ],
)
def test_damaged_checkpoints_fail_at_preflight_from_their_headers(inputs, tmp_path, damage, message):
    """A truncated safetensors file, a config.json whose shapes disagree with the tensors, and an unreadable
    config.json: one ConfigError naming the field, from the headers alone (before Ray or any worker)."""
    model = tmp_path / "model"
    shutil.copytree(inputs["policy"], model)
    weights, config = model / "model.safetensors", model / "config.json"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-64])
    elif damage == "reshape":
        hf = json.loads(config.read_text())
        config.write_text(json.dumps({**hf, "intermediate_size": hf["intermediate_size"] * 2}))
    else:
        config.write_text("{not json")
    cfg = load_rl_config(rl_config(inputs, tmp_path / "run", "ppo"), [f"model_path={model}"])
    with pytest.raises(ConfigError, match=rf"^model_path: .*{message}"):
        check_rl_run(cfg)


def _long_prompt_rows(rows: list[dict], words: int) -> list[dict]:
    """`rows` with `words` more words of text in each prompt's first message."""
    padding = " seven" * words
    return [{**row, "prompt": [{**row["prompt"][0], "content": row["prompt"][0]["content"] + padding}]} for row in rows]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (  # every prompt of the 32 rows has 10 to 12 tokens with the chat template
            {"max_prompt_length": 8},
            r"data.max_prompt_length=8: 32 of the 32 prompts of data.train_files \(.*train.parquet\) are longer with "
            r"the chat template and data.truncation=filter drops them, leaving 0 where one batch "
            r"\(data.train_batch_size\) needs 4; set data.max_prompt_length to at least 10",
        ),
        (  # six prompts of 10 tokens fit, and a batch takes 8
            {"max_prompt_length": 10, "train_batch_size": 8},
            r"data.max_prompt_length=10: 26 of the 32 prompts of data.train_files .* leaving 6 where one batch "
            r"\(data.train_batch_size\) needs 8; set data.max_prompt_length to at least 11",
        ),
        (
            {"max_prompt_length": 11, "truncation": "error"},
            r"data.max_prompt_length=11: .*train.parquet: row \d+: the prompt has 12 tokens with the chat template, "
            r"and data.truncation=error stops the run on it \(11 of the 32 prompts of data.train_files are longer\)",
        ),
        (
            {"max_prompt_length": 12, "val_files": ["LONG"]},
            r"data.max_prompt_length=12: 8 of the 8 prompts of data.val_files \(.*long_test.jsonl\) are longer .* "
            r"leaving 0 where validation needs 1; set data.max_prompt_length to at least \d\d+",
        ),
    ],
)
def test_prompts_too_long_for_the_run_fail_before_ray_starts(inputs, tmp_path, monkeypatch, capsys, data, message):
    """Prompts tokenized as the run tokenizes them (chat template included) against data.max_prompt_length and
    data.truncation: one `hfjax train` line with exit code 2, naming the field, the file and how many rows are too
    long, before Ray starts (the addition task's 32 prompts: 6 of 10 tokens, 15 of 11, 11 of 12)."""
    if data.get("val_files") == ["LONG"]:
        rows = _long_prompt_rows([row for _, row in read_rows(inputs["test"])], words=10)
        data = {**data, "val_files": [str(write_rows(rows, tmp_path / "long_test.jsonl"))]}
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps(rl_config(inputs, tmp_path / "run", "grpo", data=data)))

    def no_ray(cfg):
        raise AssertionError("Ray started")

    monkeypatch.setattr(launch, "ray_session", no_ray)
    assert main(["train", str(config), "trainer.backend=ray"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(rf"hfjax train: {message}.*", err[-1]), err[-1]
    assert not (tmp_path / "run").exists()  # nothing started: no run directory, no Ray


def test_prompts_that_fit_pass_preflight_without_validation_files(inputs, tmp_path):
    """data.truncation=filter with no data.val_files (the GPU check's GRPO run) has no validation prompts to check;
    with or without them, prompts that fit pass, and a data.max_prompt_length below every prompt still fails."""
    for val_files in ([], [inputs["test"]]):
        data = {"truncation": "filter", "max_prompt_length": 12, "val_files": val_files}
        check_rl_run(load_rl_config(rl_config(inputs, tmp_path / "run", "grpo", data=data)))
    data = {"truncation": "filter", "max_prompt_length": 9, "val_files": []}
    with pytest.raises(ConfigError, match=r"data.max_prompt_length=9: 32 of the 32 prompts of data.train_files"):
        check_rl_run(load_rl_config(rl_config(inputs, tmp_path / "run", "grpo", data=data)))
