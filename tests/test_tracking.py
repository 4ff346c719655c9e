"""Experiment tracking: `trainer.logger` chooses the destinations (W&B in offline mode here), and a finished run
draws its plots."""

from __future__ import annotations

import pytest
from support.rl_setup import build_run_inputs, rl_config

from hfjax.config.rl import load_rl_config
from hfjax.records import read_metrics
from hfjax.trainer.launch import run_rl


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_run_inputs(tmp_path_factory.mktemp("tracking"))


def test_wandb_offline_gets_every_step_and_the_finished_run_is_plotted(inputs, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    trainer = {"total_steps": 2, "logger": ["jsonl", "wandb"], "plot": True, "experiment_name": "tiny-grpo"}
    history = run_rl(load_rl_config(rl_config(inputs, run_dir, "grpo", trainer=trainer)))
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2]
    assert not (run_dir / "tb").exists()  # tensorboard not listed
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    log = next(runs[0].glob("run-*.wandb")).read_bytes()
    for key in history[-1]:
        assert key.encode() in log, key
    assert (run_dir / "plots" / "overview.png").is_file()


def test_logger_names_are_checked_at_load(inputs, tmp_path):
    with pytest.raises(ValueError, match=r"trainer\.logger\[1\]: expected one of .*'wandb'.*, got 'wandbb'"):
        load_rl_config(rl_config(inputs, tmp_path, "grpo", trainer={"logger": ["console", "wandbb"]}))
