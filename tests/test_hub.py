"""Hugging Face Hub ids, offline: `model_path: org/name` and `hfjax data gsm8k` read a local Hub cache built here
(the cache's own layout: refs/main naming a snapshot), with HF_HUB_OFFLINE=1; what the cache lacks is a clear error."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from huggingface_hub import constants
from support.rl_setup import build_run_inputs, rl_config

from hfjax.cli.main import main as cli
from hfjax.config.rl import load_rl_config
from hfjax.data.records import read_rows, write_rows
from hfjax.models.hub import is_hub_id, resolve_model
from hfjax.trainer.launch import run_rl
from hfjax.typed_config import ConfigError

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache_repo(cache: Path, kind: str, repo_id: str) -> Path:
    """An empty snapshot of `repo_id` in the Hub cache layout; returns its folder."""
    repo = cache / f"{kind}s--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_hub_model_id_resolves_from_the_local_cache_and_trains(hub_cache, tmp_path):
    inputs = build_run_inputs(tmp_path / "inputs")
    shutil.copytree(inputs["policy"], _cache_repo(hub_cache, "model", "tiny-org/tiny-llama"), dirs_exist_ok=True)
    assert is_hub_id("tiny-org/tiny-llama") and not is_hub_id(inputs["policy"])
    assert Path(resolve_model("tiny-org/tiny-llama", "model_path")).parent.name == "snapshots"
    config = rl_config(
        {**inputs, "policy": "tiny-org/tiny-llama"}, tmp_path / "run", "grpo", trainer={"total_steps": 1}
    )
    assert len(run_rl(load_rl_config(config))) == 1
    saved = load_rl_config(tmp_path / "run" / "config.yaml")  # the run records where the model came from locally
    assert Path(saved.model_path).is_dir() and COMMIT in saved.model_path

    with pytest.raises(ConfigError, match=r"model_path: 'tiny-org/missing' is not in the local Hugging Face cache"):
        resolve_model("tiny-org/missing", "model_path")


def test_hfjax_data_gsm8k_reads_the_hub_dataset_from_the_cache(hub_cache, tmp_path, capsys):
    snapshot = _cache_repo(hub_cache, "dataset", "openai/gsm8k")
    rows = [{"question": "Ann has 3 pens and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"}]
    write_rows(rows * 2, snapshot / "main" / "train-00000-of-00001.parquet")
    write_rows(rows, snapshot / "main" / "test-00000-of-00001.parquet")
    assert cli(["data", "gsm8k", "--out", str(tmp_path / "gsm8k")]) == 0
    assert len(read_rows(tmp_path / "gsm8k" / "train.parquet")) == 2
    assert read_rows(tmp_path / "gsm8k" / "test.parquet")[0][1]["reward_model"]["ground_truth"] == "7"
    capsys.readouterr()

    shutil.rmtree(hub_cache / "datasets--openai--gsm8k")
    assert cli(["data", "gsm8k", "--out", str(tmp_path / "again")]) == 2
    error = capsys.readouterr().err
    assert "'openai/gsm8k' is not in the local Hugging Face cache" in error and "HF_HUB_OFFLINE" in error
