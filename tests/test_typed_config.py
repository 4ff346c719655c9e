"""Typed config loading: YAML + overrides into nested dataclasses, every supported type checked, errors naming the
full dotted path, the origin and what was expected, and the resolved config round-tripping through YAML."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import yaml

from hfjax.typed_config import ConfigError, dump_yaml, load_config, to_dict


@dataclasses.dataclass(frozen=True)
class Optim:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclasses.dataclass(frozen=True)
class Role:
    path: str = "model"
    optim: Optim = dataclasses.field(default_factory=Optim)
    mesh: dict[str, int] = dataclasses.field(default_factory=lambda: {"fsdp": 1})
    max_len: int | None = None
    layers: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    actor: Role = dataclasses.field(default_factory=Role)
    critic: Role = dataclasses.field(default_factory=lambda: Role(path="critic", optim=Optim(lr=5e-4, warmup_steps=7)))
    use_kl: bool = True
    out: Path = Path("runs/x")
    seed: int | str = 0


def _yaml(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _error(*args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    return str(info.value)


def test_yaml_overrides_and_defaults(tmp_path):
    rng = np.random.default_rng()
    lr, warm, n = float(rng.uniform(1e-6, 1e-2)), int(rng.integers(1, 100)), int(rng.integers(1, 9))
    path = _yaml(tmp_path, {"name": "a", "actor": {"optim": {"lr": lr}, "mesh": {"tensor": n}}, "use_kl": False})
    cfg = load_config(Run, path, [f"actor.optim.warmup_steps={warm}", "actor.layers=[3, 1]", "critic.max_len=64"])
    assert cfg.actor.optim == Optim(lr=lr, warmup_steps=warm)
    assert cfg.actor.mesh == {"tensor": n}  # a dict field is replaced, not merged
    assert cfg.actor.layers == [3, 1] and cfg.actor.max_len is None and cfg.use_kl is False
    # A partial section updates the field's default instance: critic keeps its own lr/warm-up defaults.
    assert cfg.critic == Role(path="critic", optim=Optim(lr=5e-4, warmup_steps=7), max_len=64)
    assert cfg.out == Path("runs/x") and isinstance(cfg.actor.optim.betas, tuple)


def test_scalar_coercions():
    cfg = load_config(Run, {"name": "a", "actor": {"optim": {"lr": "1e-5", "betas": [1, 0.5]}}, "seed": "s1"})
    assert cfg.actor.optim.lr == 1e-5 and cfg.actor.optim.betas == (1.0, 0.5)  # PyYAML's '1e-5' string is a float
    assert cfg.seed == "s1" and load_config(Run, {"name": "a", "seed": 4}).seed == 4
    assert load_config(Run, {"name": "b"}, ["out=/tmp/o"]).out == Path("/tmp/o")
    assert load_config(Run, {"name": "b", "actor": None}).actor == Role()  # an empty section keeps the defaults


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor.optim.lr=abc", "actor.optim.lr: expected a float, got 'abc' (from overrides)"),
        ("actor.optim.warmup_steps=1.5", "actor.optim.warmup_steps: expected an int, got 1.5 (from overrides)"),
        ("actor.optim.warmup_steps=true", "actor.optim.warmup_steps: expected an int, got True (from overrides)"),
        ("use_kl=1", "use_kl: expected a bool (true/false), got 1 (from overrides)"),
        ("actor.path=3", "actor.path: expected a string, got 3 (from overrides)"),
        ("actor.optim.schedule=linear", "actor.optim.schedule: expected one of 'constant', 'cosine', got 'linear'"),
        ("actor.max_len=x", "actor.max_len: expected an int or null, got 'x' (from overrides)"),
        ("actor.layers=[1, a]", "actor.layers[1]: expected an int, got 'a' (from overrides)"),
        ("actor.layers=4", "actor.layers: expected a list (list[int]), got 4 (from overrides)"),
        ("actor.optim.betas=[0.9]", "actor.optim.betas: expected a list of 2 items"),
        ("actor.mesh.tensor=two", "actor.mesh.tensor: expected an int, got 'two' (from overrides)"),
        ("seed=[1]", "seed: expected an int or a string, got [1] (from overrides)"),
        ("seed=null", "seed: expected an int or a string, got None (from overrides)"),
        ("actor.optim=3", "actor.optim: expected a mapping of Optim fields, got 3 (from overrides)"),
        ("actor.optim.lr=-1", "actor.optim.lr must be > 0, got -1.0 (from overrides)"),
        ("actor.optim.lrr=0.1", "actor.optim.lrr: unknown key (from overrides); did you mean 'lr'?"),
        ("actor.path.x=1", "actor.path: expected a string, got {'x': 1} (from overrides)"),
    ],
)
def test_bad_overrides_name_path_origin_and_expectation(tmp_path, override, message):
    assert message in _error(Run, _yaml(tmp_path, {"name": "n"}), [override])


def test_file_errors_name_the_file_and_collect_all_problems(tmp_path):
    path = _yaml(tmp_path, {"name": "n", "actor": {"optm": {"lr": 1}, "optim": {"warmup_steps": "x"}}, "use_kll": 1})
    lines = _error(Run, path).splitlines()
    assert f"actor.optm: unknown key (from {path}); did you mean 'optim'?" in lines
    assert f"actor.optim.warmup_steps: expected an int, got 'x' (from {path})" in lines
    assert f"use_kll: unknown key (from {path}); did you mean 'use_kl'?" in lines
    assert len(lines) == 3
    assert "name: missing required key" in _error(Run, {})
    assert "zzz: unknown key (from the given mapping); known keys: name, actor" in _error(Run, {"name": "n", "zzz": 0})
    # A section's check that names its field is reported at that field, with where the field's value came from.
    assert f"actor.optim.lr must be > 0, got -1.0 (from {path})" in _error(
        Run, _yaml(tmp_path, {"name": "n", "actor": {"optim": {"lr": -1.0}}}), ["actor.optim.warmup_steps=2"]
    )


def test_bad_inputs(tmp_path):
    assert "no such config file" in _error(Run, tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("a: [1, 2\n")
    assert f"{tmp_path / 'bad.yaml'}: invalid YAML" in _error(Run, tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    assert "expected a mapping at the top level, got list" in _error(Run, tmp_path / "list.yaml")
    assert "actor.path: expected a mapping to set actor.path.x in, got 'm' (from the given mapping)" in _error(
        Run, {"name": "n", "actor": {"path": "m"}}, ["actor.path.x=1"]
    )
    assert "expected key.path=value" in _error(Run, {"name": "n"}, ["actor.optim.lr"])
    assert "expected key.path=value" in _error(Run, {"name": "n"}, ["actor..lr=1"])
    with pytest.raises(TypeError, match="expected a dataclass type"):
        load_config(dict, {})


def test_given_mapping_is_not_modified():
    source = {"name": "n", "actor": {"optim": {"lr": 0.5}}}
    load_config(Run, source, ["actor.optim.lr=0.25", "critic.path=c"])
    assert source == {"name": "n", "actor": {"optim": {"lr": 0.5}}}


def test_to_dict_and_dump_yaml_round_trip(tmp_path):
    rng = np.random.default_rng()
    overrides = [f"actor.optim.lr={rng.uniform(1e-5, 1):.6g}", f"critic.mesh={{a: {rng.integers(1, 8)}}}"]
    cfg = load_config(Run, {"name": "r", "actor": {"layers": rng.integers(0, 9, 3).tolist(), "max_len": 9}}, overrides)
    saved = dump_yaml(cfg, tmp_path / "out" / "config.yaml")
    data = yaml.safe_load(saved.read_text())
    assert data == to_dict(cfg) and list(data) == ["name", "actor", "critic", "use_kl", "out", "seed"]
    assert data["actor"]["optim"]["betas"] == [0.9, 0.999] and data["out"] == "runs/x"
    assert load_config(Run, saved) == cfg
