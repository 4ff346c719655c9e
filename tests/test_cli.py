"""The `hfjax` command: `inspect` and `layouts --pairs` on a local checkpoint (8 fake devices from conftest)."""

import json

import pytest
import yaml
from checkpoints import save_hf_model

from hfjax.cli import main

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
