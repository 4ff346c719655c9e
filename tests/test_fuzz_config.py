"""Fuzzing the config and dataset checks (issue #29): generated bad values (wrong types, numbers out of range, NaN,
unknown names, random strings for Literal and registry fields, zero or negative sizes) for every field of the RL and
SFT configs, and malformed prompt rows, must raise hfjax's own error (`ConfigError`, `DataError`) whose message names
the field, never another exception type. No checkpoint is needed: these are load-time checks."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hfjax.config.rl import RLConfig, load_rl_config
from hfjax.config.supervised import SFTConfig
from hfjax.data.prompts import parse_prompt_row
from hfjax.data.records import DataError, read_rows
from hfjax.typed_config import ConfigError, load_config, to_dict, yaml_key

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
RL_BASE = {"model_path": "m", "rollout": {"n": 2}}
SFT_BASE = {"model": {"path": "m"}, "data": {"train_files": ["t.jsonl"]}}


def scalar_fields(cls: type, prefix: str = "") -> list[tuple[str, typing.Any]]:
    """(dotted path, type) of every non-dataclass field of `cls` and its nested sections."""
    out = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        path, tp = f"{prefix}{yaml_key(field.name)}", hints[field.name]
        if dataclasses.is_dataclass(tp):
            out += scalar_fields(tp, f"{path}.")
        elif field.name != "devices":  # a removed key: any value is an error already
            out.append((path, tp))
    return out


def wrong_type(tp: typing.Any) -> st.SearchStrategy:
    """Values that are never of type `tp`: a nested list or mapping fits no scalar field."""
    text = st.text(min_size=1, max_size=12).filter(lambda s: not _numeric(s))
    if tp in (int, float):
        return st.one_of(text, st.lists(st.integers(), min_size=1, max_size=3), st.just(float("nan")))
    if tp is bool:
        return st.one_of(st.integers(), text, st.just({"a": 1}))
    if typing.get_origin(tp) is dict:  # any mapping fits dict[str, Any]: a list or a text does not
        return st.one_of(st.just([{"x": [1]}]), text)
    return st.one_of(st.just([{"x": [1]}]), st.just({"nested": {"x": 1}}))


def _numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def bad_number(tp: typing.Any) -> st.SearchStrategy:
    """Sizes, counts, coefficients out of every field's range: zero or negative (most fields), or huge."""
    if tp is int:
        return st.integers(max_value=-1)
    return st.floats(max_value=-1e-3, allow_nan=False, allow_infinity=False)


RL_FIELDS = scalar_fields(RLConfig)
SFT_FIELDS = scalar_fields(SFTConfig)
RL_NUMBERS = [(p, tp) for p, tp in RL_FIELDS if tp in (int, float)]
SFT_NUMBERS = [(p, tp) for p, tp in SFT_FIELDS if tp in (int, float)]
# fields where a negative number is meaningful: none may be negative except the Safe-RLHF cost limit
NEGATIVE_OK = {"algorithm.cost_limit"}


def set_path(base: dict, path: str, value: typing.Any) -> dict:
    config = json.loads(json.dumps(base))
    node = config
    *parents, last = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return config


def assert_names(error: Exception, path: str) -> None:
    message = str(error)
    assert path in message, f"{path!r} not named in: {message}"


@FUZZ
@given(data=st.data())
def test_rl_wrong_types_name_the_field(data):
    path, tp = data.draw(st.sampled_from(RL_FIELDS))
    value = data.draw(wrong_type(tp))
    with pytest.raises(ConfigError) as info:
        load_rl_config(set_path(RL_BASE, path, value))
    assert_names(info.value, path)


@FUZZ
@given(data=st.data())
def test_rl_out_of_range_numbers_name_the_field(data):
    path, tp = data.draw(st.sampled_from([f for f in RL_NUMBERS if f[0] not in NEGATIVE_OK]))
    value = data.draw(bad_number(tp))
    with pytest.raises(ConfigError) as info:
        load_rl_config(set_path(RL_BASE, path, value))
    assert_names(info.value, path)


def literal_and_registry_fields(cls: type) -> list[str]:
    registry = {"actor.policy_loss", "actor.kl_loss_type", "algorithm.kl_penalty"}
    fields = scalar_fields(cls)
    return [p for p, tp in fields if typing.get_origin(tp) is typing.Literal or p in registry]


@FUZZ
@given(data=st.data(), name=st.text(min_size=0, max_size=16))
def test_rl_unknown_names_name_the_field(data, name):
    path = data.draw(st.sampled_from(literal_and_registry_fields(RLConfig)))
    default = _value_at(to_dict(load_rl_config(RL_BASE)), path)
    if name == default:
        return
    try:
        load_rl_config(set_path(RL_BASE, path, name))
    except ConfigError as error:
        assert_names(error, path)
    else:  # a random string that happens to be another valid name
        assert name in typing.get_args(dict(scalar_fields(RLConfig))[path]) or _registered(path, name)


def _value_at(config: dict, path: str) -> typing.Any:
    for part in path.split("."):
        config = config[part]
    return config


def _registered(path: str, name: str) -> bool:
    from hfjax.algos.losses import policy_losses
    from hfjax.config.roles import KL_NAMES

    return name in (policy_losses() if path == "actor.policy_loss" else KL_NAMES)


@FUZZ
@given(data=st.data(), key=st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=10))
def test_rl_unknown_keys_name_the_section(data, key):
    section = data.draw(st.sampled_from(["", "data.", "actor.", "actor.optim.", "rollout.", "trainer.", "reward."]))
    known = {p for p, _ in RL_FIELDS} | {"actor.optim", "actor.rollout_correction", "reward.reward_model"}
    known |= {"reward.cost_model", "data", "actor", "rollout", "critic", "reward", "algorithm", "trainer", "async"}
    path = f"{section}{key}"
    if path in known or path.startswith("trainer.liveness"):
        return
    with pytest.raises(ConfigError) as info:
        load_rl_config(set_path(RL_BASE, path, 1))
    assert_names(info.value, f"{path}: unknown key")


@FUZZ
@given(data=st.data())
def test_sft_bad_values_name_the_field(data):
    path, tp = data.draw(st.sampled_from(SFT_FIELDS))
    numbers = [f for f in SFT_NUMBERS if f[0] != "trainer.total_steps"] + [("trainer.total_steps", int)]
    if tp in (int, float) and data.draw(st.booleans()):
        path, tp = data.draw(st.sampled_from(numbers))
        value = data.draw(bad_number(tp))
    else:
        value = data.draw(wrong_type(tp))
    with pytest.raises(ConfigError) as info:
        load_config(SFTConfig, set_path(SFT_BASE, path, value))
    assert_names(info.value, path)


ROW_FIELDS = ("prompt", "data_source", "ability", "reward_model", "extra_info")
GOOD_ROW = {
    "prompt": [{"role": "user", "content": "1+1"}],
    "data_source": "hfjax/addition",
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "2"},
    "extra_info": {"index": 0},
}


@FUZZ
@given(data=st.data())
def test_bad_prompt_rows_name_the_field(data, tmp_path):
    field = data.draw(st.sampled_from(ROW_FIELDS))
    row = dict(GOOD_ROW)
    if field in ("prompt", "data_source") and data.draw(st.booleans()):
        del row[field]
    else:
        row[field] = data.draw(
            st.one_of(st.integers(), st.floats(allow_nan=False), st.lists(st.integers(), min_size=1, max_size=3))
        )
    file = tmp_path / "rows.jsonl"
    file.write_text(json.dumps(GOOD_ROW) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError) as info:
        for ref, parsed in read_rows(file):
            parse_prompt_row(ref, parsed)
    assert "row 2" in str(info.value) and f"'{field}" in str(info.value)
