"""The agent quickstart's RL config (no run): its tool environment parses the Hermes format its task writes, even
though the base model is a Llama (whose own format the rollout would pick otherwise), unless the config names one."""

from pathlib import Path

from hfjax.cli.packaged import config_path
from hfjax.cli.quickstart import QuickstartConfig, rl_config
from hfjax.typed_config import load_config

FILES = {"train": Path("train.parquet"), "test": Path("test.parquet")}


def _env_kwargs(*overrides: str) -> dict:
    cfg = load_config(QuickstartConfig, str(config_path("agent_quickstart.yaml")), list(overrides))
    return rl_config(cfg, Path("model"), FILES).rollout.agent.env_kwargs


def test_agent_quickstart_parser_is_its_tasks_format():
    assert _env_kwargs() == {"parser": "hermes"}
    assert _env_kwargs("rl.rollout.agent.env_kwargs.parser=llama3_json") == {"parser": "llama3_json"}
