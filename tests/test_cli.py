"""The `hfjax` command: `inspect`, `layouts --pairs` and `generate` on a local checkpoint, and `automap` on a tiny
RL run config (8 fake devices from conftest)."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from checkpoints import save_hf_model
from rl_setup import build_run_inputs, rl_config

from hfjax.cli import main
from hfjax.config import load_rl_config
from hfjax.parallel import Layout
from hfjax.typed_config import ConfigError

pytest_plugins = ["ray_cluster"]  # the session-scoped `ray_cluster` fixture

WIDE = dict(vocab_size=128, num_attention_heads=8, num_key_value_heads=8, hidden_size=64, intermediate_size=96)


def test_layouts_compares_pairs(tmp_path, capsys):
    _, model_dir = save_hf_model(tmp_path, "qwen2", **WIDE)
    pairs = tmp_path / "pairs.yaml"
    pairs.write_text(
        yaml.safe_dump(
            {
                "pairs": [
                    {
                        "name": "a",
                        "train": {"mesh": {"fsdp": 2, "tensor": 4}, "rules": "fsdp_tp"},
                        "gen": {"mesh": {"data": 4, "tensor": 2}, "rules": "dp_tp_gen"},
                    }
                ]
            }
        )
    )
    out = tmp_path / "rows.json"
    assert main(["layouts", "--model", str(model_dir), "--pairs", str(pairs), "--out", str(out), "--repeats", "1"]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    zero, naive = rows["zero_redundancy"], rows["naive"]
    assert zero["contained"] and zero["received_bytes_per_device"] == zero["per_parameter_moved_bytes"]
    assert zero["peak_param_bytes_per_device"] == zero["gen_bytes_per_device"]
    assert naive["redundant_bytes_per_device"] == naive["train_bytes_per_device"]
    assert zero["to_gen_s"] > 0 and zero["to_train_s"] > 0
    assert "zero_redundancy" in capsys.readouterr().out


def test_layouts_rejects_a_bad_pairs_file(tmp_path):
    pairs = tmp_path / "pairs.yaml"
    pairs.write_text("pairs: {train: x}")
    with pytest.raises(SystemExit, match="expected 'pairs:' as a list"):
        main(["layouts", "--model", "llama-200m", "--pairs", str(pairs)])


def test_inspect_prints_partitions(tmp_path, capsys):
    _, model_dir = save_hf_model(tmp_path, "llama", **WIDE)
    assert main(["inspect", str(model_dir), "--mesh", "fsdp=4,tensor=2", "--dtype", "float32"]) == 0
    text = capsys.readouterr().out
    assert "('tensor', None, 'fsdp')" in text and "MiB per device on 8 devices" in text


def test_generate_command(tmp_path):
    from hfjax.models.local_tokenizer import build_bpe_tokenizer

    tokenizer = build_bpe_tokenizer(["the cat sat on the mat", "a dog ran far away"] * 20, vocab_size=300)
    hf, model_dir = save_hf_model(tmp_path, "llama", vocab_size=len(tokenizer), eos_token_id=2)
    tokenizer.save_pretrained(model_dir)
    prompts = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "the cat"},
        {"messages": [{"role": "user", "content": "a dog"}]},
        {"input_ids": [5, 9, 40, 41]},
        {"input_ids": list(range(3, 60))},
    ]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(out)]
    argv += ["--temperature", "0", "--max-new-tokens", "6", "--max-prefill-length", "32", "--slots", "2"]
    assert main(argv) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in results] == [0, 1, 2, 3]
    messages = [{"role": "user", "content": "the cat"}]
    chat = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    for prompt_ids, result in ((chat, results[0]), ([5, 9, 40, 41], results[2])):
        ids = torch.tensor([prompt_ids])
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        assert result["response_ids"] == expected[0, len(prompt_ids) :].tolist()
        assert result["response"] == tokenizer.decode(result["response_ids"], skip_special_tokens=True)
    assert results[3]["finish_reason"] == "rejected" and "exceeds max_prefill_length 32" in results[3]["error"]


def automap(tmp_path: Path, run: dict, capsys) -> tuple[dict, str, str]:
    """Runs `hfjax automap` on `run` for one host of 8 A100s; returns the written config, its text and the table."""
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump({"hosts": 1, "profile": "a100-80gb"}))
    args = ["automap", "--cluster", str(tmp_path / "cluster.yaml"), "--config", str(tmp_path / "run.yaml")]
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "mapped.yaml"), "--top", "3"]) == 0
    text = (tmp_path / "mapped.yaml").read_text()
    return yaml.safe_load(text), text, capsys.readouterr().out


def check_mapped(run: dict, mapped: dict, text: str, table: str) -> None:
    """The written config is `run` with only the mapping's keys changed, loads as an RL config, its layouts are
    valid `Layout`s of its groups, and its placement and layouts are the printed best candidate's."""
    assert text.startswith("# hfjax automap of ") and re.search(r"predicted [0-9.]+ s per iteration", text)
    mapped_keys = {"trainer": ("placement", "devices", "backend"), "actor": ("train_layout",)}
    mapped_keys |= {"rollout": ("gen_layout",), "critic": ("layout",), "reward": ("reward_model", "cost_model")}
    for section in set(run) | set(mapped):
        keep = mapped_keys.get(section, ())
        before, after = run.get(section), mapped.get(section)
        if isinstance(after, dict):
            assert {k: v for k, v in after.items() if k not in keep} == {
                k: v for k, v in (before or {}).items() if k not in keep
            }
        else:
            assert after == before, section
    cfg = load_rl_config(mapped)
    layouts = {"actor": cfg.actor.train_layout, "critic": cfg.critic.layout if cfg.uses_critic else None}
    layouts["reward"] = cfg.reward.reward_model.layout
    layouts = {role: Layout.from_config(config) for role, config in layouts.items() if config is not None}
    gen = Layout.from_config(cfg.rollout.gen_layout)
    groups = {"colocate": 1, "split": 2, "standalone": len(layouts)}[cfg.trainer.placement]
    assert all(layout.size == cfg.trainer.devices // groups for layout in (*layouts.values(), gen))
    best = next(line for line in table.splitlines() if line.startswith("│ 1 "))
    assert cfg.trainer.placement in best
    for role, layout in layouts.items():
        data, fsdp, tensor = (layout.axis_size(a) for a in ("data", "fsdp", "tensor"))
        assert f"{role} d{data}.f{fsdp}.t{tensor}" in best
    assert f"gen t{cfg.rollout.gen_layout['mesh']['tensor']}" in best


def test_automap_writes_a_config_hfjax_train_runs(tmp_path, capsys):
    """GRPO (actor with its reference): `colocate` is the only placement; the written config runs an iteration
    in-process as is."""
    from hfjax.trainer.launch import run_rl

    run = rl_config(build_run_inputs(tmp_path / "inputs"), tmp_path / "run", "grpo", trainer={"total_steps": 1})
    mapped, text, table = automap(tmp_path, run, capsys)
    check_mapped(run, mapped, text, table)
    assert mapped["trainer"]["placement"] == "colocate" and mapped["trainer"]["backend"] == "local"
    history = run_rl(load_rl_config(str(tmp_path / "mapped.yaml")))
    assert len(history) == 1 and all(np.isfinite(v) for v in history[0].values())


@pytest.mark.ray
def test_automap_of_separate_groups_runs_on_ray(ray_cluster, tmp_path, capsys):
    """PPO with a reward model: the best mapping on 8 A100s puts the roles in separate groups; the written config
    (on Ray) runs an iteration as is."""
    from hfjax.trainer.launch import run_rl

    inputs = build_run_inputs(tmp_path / "inputs")
    run = rl_config(
        inputs,
        tmp_path / "run",
        "ppo",
        trainer={"total_steps": 1},
        reward={"reward_model": {"model_path": inputs["scorer"]}},
    )
    mapped, text, table = automap(tmp_path, run, capsys)
    check_mapped(run, mapped, text, table)
    assert mapped["trainer"]["placement"] != "colocate" and mapped["trainer"]["backend"] == "ray"
    history = run_rl(load_rl_config(str(tmp_path / "mapped.yaml")))
    assert len(history) == 1 and all(np.isfinite(v) for v in history[0].values())


def test_automap_rejects_bad_input(tmp_path):
    """A run config the schema rejects fails with the schema's error naming the key; --out may not be --config."""
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump({"hosts": 1, "profile": "a100-80gb"}))
    run = tmp_path / "run.yaml"
    args = ["automap", "--cluster", str(tmp_path / "cluster.yaml"), "--config", str(run)]
    for bad, key in (({"actor": {"ppo_epochs": 0}}, "ppo_epochs"), ({"actor": {"ppo_epoch": 2}}, r"actor\.ppo_epoch")):
        run.write_text(yaml.safe_dump({"model_path": "x", **bad}))
        with pytest.raises(ConfigError, match=key):
            main(args)
    with pytest.raises(SystemExit, match="is the run config --config"):
        main([*args, "--out", str(run)])
