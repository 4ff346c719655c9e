"""The `hfjax` command: `inspect` and `layouts --pairs` on a local checkpoint (8 fake devices from conftest)."""

import json

import pytest
import torch
import yaml
from support.checkpoints import save_hf_model

from hfjax.cli.main import main, parse_args
from hfjax.typed_config import ConfigError

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


def test_layouts_with_lora_compares_the_base_moved_and_kept(tmp_path, capsys):
    """`--lora-rank`: each (pair, mode) twice, the LoRA base moved with the adapters and kept in the generation
    layout, where the transition moves the adapters alone and the base stays resident."""
    _, model_dir = save_hf_model(tmp_path, "qwen2", **WIDE)
    pairs = tmp_path / "pairs.yaml"
    pair = {"name": "a", "train": {"mesh": {"fsdp": 8}, "rules": "fsdp"}, "gen": {"mesh": {"data": 8}}}
    pairs.write_text(yaml.safe_dump({"pairs": [pair]}))
    out = tmp_path / "rows.json"
    args = ["layouts", "--model", str(model_dir), "--pairs", str(pairs), "--out", str(out), "--lora-rank", "4"]
    assert main(args) == 0
    rows = {(r["mode"], r["stationary"]): r for r in json.loads(out.read_text())["rows"]}
    moved, kept = rows["zero_redundancy", False], rows["zero_redundancy", True]
    assert 0 < kept["received_bytes_per_device"] < moved["received_bytes_per_device"] / 4  # rank-4 adapters alone
    assert kept["stationary_bytes_per_device"] > 0 == moved["stationary_bytes_per_device"]
    assert kept["peak_param_bytes_per_device"] == moved["peak_param_bytes_per_device"]  # one copy of the base
    assert "kept in gen" in capsys.readouterr().out


def test_layouts_rejects_a_bad_pairs_file(tmp_path, capsys):
    pairs = tmp_path / "pairs.yaml"
    pairs.write_text("pairs: {train: x}")
    assert main(["layouts", "--model", "llama-200m", "--pairs", str(pairs)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hfjax layouts: {pairs}: expected 'pairs:' as a list of {{name, train, gen}} layout entries"]


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
        {"prompt": [{"role": "user", "content": "the cat"}]},  # verl's schema: the prompt as messages
    ]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(out)]
    argv += ["--temperature", "0", "--max-new-tokens", "6", "--max-prefill-length", "32", "--slots", "2"]
    assert main(argv) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in results] == [0, 1, 2, 3, 4]
    assert results[4]["response_ids"] == results[0]["response_ids"]
    messages = [{"role": "user", "content": "the cat"}]
    chat = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    for prompt_ids, result in ((chat, results[0]), ([5, 9, 40, 41], results[2])):
        ids = torch.tensor([prompt_ids])
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        assert result["response_ids"] == expected[0, len(prompt_ids) :].tolist()
        assert result["response"] == tokenizer.decode(result["response_ids"], skip_special_tokens=True)
    assert results[3]["finish_reason"] == "rejected" and "exceeds max_prefill_length 32" in results[3]["error"]


def test_generate_agent_command(tmp_path, capsys):
    from hfjax.models.local_tokenizer import build_bpe_tokenizer

    tokenizer = build_bpe_tokenizer(["the cat sat on the mat", "a dog ran far away"] * 20, vocab_size=300)
    _, model_dir = save_hf_model(tmp_path, "llama", vocab_size=len(tokenizer), eos_token_id=2)
    tokenizer.save_pretrained(model_dir)
    env = tmp_path / "two_turns.py"
    env.write_text(
        "from hfjax.envs import Environment, StepResult\n"
        "class TwoTurns(Environment):\n"
        "    def reset(self, row):\n"
        "        self.row, self.turns = row, 0\n"
        "    def step(self, action):\n"
        "        self.turns += 1\n"
        "        if self.turns == 2:\n"
        "            return StepResult(None, reward=float(self.row['bonus']), done=True)\n"
        "        return StepResult('the mat', reward=0.5)\n"
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p, "bonus": b}) for p, b in (("the cat", 1), ("a dog", 2))))
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(out), "--slots", "2"]
    argv += ["--agent", f"{env}:TwoTurns", "--max-tokens-per-turn", "4", "--max-new-tokens", "24", "--n", "2"]
    assert main(argv) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    observation = tokenizer.encode("the mat", add_special_tokens=False)
    assert len(results) == 4
    for result in results:
        assert result["turns"] == 2 and result["finish_reason"] == "done"
        assert result["reward"] == 0.5 + result["bonus"]
        env_tokens = [t for t, m in zip(result["response_ids"], result["response_mask"], strict=True) if not m]
        assert env_tokens == observation
    assert main([*argv[:-2], "--agent", f"{env}:Missing"]) == 2
    assert "Missing" in capsys.readouterr().err


def _one_line_error(capsys, argv: list[str], command: str) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) >= 1 and lines[-1].startswith(f"hfjax {command}: ")
    assert not any("Traceback" in line for line in lines)
    return "\n".join(lines)


def test_every_subcommand_reports_a_bad_input_as_one_line_with_exit_code_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: {total_stepz: 3}\n")
    assert "trainer.total_stepz: unknown key" in _one_line_error(capsys, ["train", str(bad)], "train")
    assert "no shipped config of that name" in _one_line_error(capsys, ["train", "missing.yaml"], "train")
    assert "run_dir" in _one_line_error(capsys, ["quickstart", "quickstart.yaml", "run_dirr=x"], "quickstart")
    assert "trainer.epochz" in _one_line_error(capsys, ["sft", "sft_addition.yaml", "trainer.epochz=2"], "sft")
    assert "model.dtype" in _one_line_error(capsys, ["rm", "rm_example.yaml", "model.dtype=float8"], "rm")
    assert "config.yaml" in _one_line_error(
        capsys, ["export", str(tmp_path / "none"), "--out", str(tmp_path)], "export"
    )
    assert "metrics.jsonl" in _one_line_error(capsys, ["plot", str(tmp_path)], "plot")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1="}\n')
    generate = [
        "generate",
        "--model",
        str(tmp_path / "nomodel"),
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path / "o"),
    ]
    assert "no such directory" in _one_line_error(capsys, generate, "generate")


def test_quickstart_takes_overrides_without_a_config_name(capsys):
    args = parse_args(["quickstart", "rl.algorithm.name=ppo", "task.seed=3"])
    assert (args.config, args.overrides) == ("quickstart.yaml", ["rl.algorithm.name=ppo", "task.seed=3"])
    args = parse_args(["quickstart", "agent_quickstart.yaml", "task.seed=3"])
    assert (args.config, args.overrides) == ("agent_quickstart.yaml", ["task.seed=3"])
    assert parse_args(["quickstart"]).config == "quickstart.yaml"
    # the override reaches the shipped config (a bad key fails while loading it, before anything runs)
    assert "run_dirr: unknown key" in _one_line_error(capsys, ["quickstart", "run_dirr=x"], "quickstart")


def test_overrides_may_follow_the_options(capsys):
    args = parse_args(["compile", "c.yaml", "--target", "h100", "actor.micro_batch_size=8"])
    assert (args.config, args.target, args.overrides) == ("c.yaml", "h100", ["actor.micro_batch_size=8"])
    args = parse_args(["train", "c.yaml", "a=1", "--dry-run", "b=2"])
    assert (args.overrides, args.dry_run) == (["a=1", "b=2"], True)
    for bad in (["compile", "c.yaml", "--target", "h100", "--nope"], ["inspect", "ckpt", "x=1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert "unrecognized arguments" in capsys.readouterr().err


def test_debug_shows_the_traceback_and_version_is_printed(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: {total_stepz: 3}\n")
    with pytest.raises(ConfigError, match="total_stepz"):
        main(["--debug", "train", str(bad)])
    monkeypatch.setenv("HFJAX_DEBUG", "1")
    with pytest.raises(ConfigError, match="total_stepz"):
        main(["train", str(bad)])
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("hfjax 0.1.0")


def test_train_dry_run_prints_config_placement_layouts_and_memory_without_starting(tmp_path, capsys, monkeypatch):
    from support.rl_setup import build_run_inputs, rl_config

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    inputs = build_run_inputs(tmp_path / "inputs")
    config = rl_config(inputs, tmp_path / "run", "ppo", trainer={"placement": "split", "backend": "ray"})
    config["actor"]["train_layout"] = {"mesh": {"fsdp": 4}, "rules": "fsdp"}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(tmp_path / "run.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "placement 'split' on 1 host(s) x 8 devices" in out
    assert "group 0: actor: 1 process(es) (one per host) x 4 devices" in out
    assert "group 1: critic: 1 process(es) (one per host) x 4 devices" in out
    assert "actor (training): mesh(fsdp=4)" in out
    assert "# memory per device (cost model)" in out and "GiB of" in out and "host RAM" in out
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_the_command_line_starts_without_importing_jax():
    """`--devices` must be set before JAX is imported, so importing the entry point and every command's parser
    imports no JAX (each command imports what it needs when it runs)."""
    import subprocess
    import sys

    code = "import sys, hfjax.cli.main as m; m.build_parser(); print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
